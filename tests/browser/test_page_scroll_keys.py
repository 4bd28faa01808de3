"""Scrolling a streaming answer up with the keyboard or a finger, in real Chromium: a key that
scrolls the conversation up (Home, Ctrl+Home, PageUp, Shift+Space, ArrowUp) stops following the
stream at once, as the mouse wheel does, so the key's whole scroll applies and the view is not
pinned to the bottom again halfway; keys typed in the prompt leave the following alone; and a
finger dragging the text down, however slowly, is not pinned back either."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from bench.peers import OpenAIPeer, Reply
from tests.browser.conftest import phone_page
from tests.browser.test_page import WAIT_MS, has_class, open_hangar, submit
from tests.conftest import RelayHandle, Upstream

pytestmark = pytest.mark.browser

# A long answer (~18 s): one paragraph a chunk, so the turns grow every 30 ms while keys scroll.
LONG = Reply(chunks=[f"Line {i} of a long answer.\n\n" for i in range(600)], delay=0.03)
# A key's smooth scroll takes a fraction of a second; a loaded machine may take longer.
SCROLL_MS = 5_000

CONVERSATION = "document.getElementById('conversation')"


async def watch_keys(page: Page) -> None:
    """Record where the conversation was scrolled to as each key went down (before the page or
    the browser did anything with it): a key's scroll is measured from there."""
    await page.evaluate(
        f"""() => {{
            window.__keyTops = [];
            const record = () => window.__keyTops.push({CONVERSATION}.scrollTop);
            window.addEventListener("keydown", record, {{ capture: true }});
        }}"""
    )


async def metrics(page: Page) -> dict[str, float]:
    found: dict[str, float] = await page.evaluate(
        f"""() => {{
            const el = {CONVERSATION};
            return {{
                top: el.scrollTop,
                client: el.clientHeight,
                fromBottom: el.scrollHeight - el.scrollTop - el.clientHeight,
                keyTop: window.__keyTops.at(-1) ?? null,
            }};
        }}"""
    )
    return found


async def following_at_bottom(page: Page) -> None:
    """The view follows the stream: it is at the bottom, new lines and all."""
    await page.wait_for_function(
        f"""() => {{
            const el = {CONVERSATION};
            return el.scrollHeight - el.scrollTop - el.clientHeight < 4 && el.scrollTop > 0;
        }}""",
        timeout=WAIT_MS,
    )
    await expect(page.locator("#jump-latest")).to_be_hidden()


async def settled(page: Page) -> None:
    """Wait (bounded) until the conversation's scroll has come to rest: the same for 10 frames."""
    await page.wait_for_function(
        f"""() => {{
            const top = {CONVERSATION}.scrollTop;
            const seen = (window.__rest ??= {{ top, frames: 0 }});
            seen.frames = seen.top === top ? seen.frames + 1 : 0;
            seen.top = top;
            if (seen.frames < 10) return false;
            delete window.__rest;
            return true;
        }}""",
        timeout=SCROLL_MS,
    )


async def grows(page: Page, px: int = 400) -> None:
    """Wait (bounded) until the turns have grown by `px` more: more text streamed and drawn."""
    await page.wait_for_function(
        """([px]) => {
            const list = document.getElementById("turns");
            window.__grownFrom ??= list.offsetHeight;
            if (list.offsetHeight < window.__grownFrom + px) return false;
            delete window.__grownFrom;
            return true;
        }""",
        arg=[px],
        timeout=WAIT_MS,
    )


async def streaming(
    page: Page, start_drone: Callable[..., Any], openai_peer: OpenAIPeer
) -> Locator:
    openai_peer.script(LONG)
    await start_drone(Upstream("openai", openai_peer))
    turn = await submit(page, "A long answer, please")
    await expect(turn.locator(".turn-output")).to_contain_text("Line 40 of", timeout=WAIT_MS)
    await following_at_bottom(page)
    await watch_keys(page)
    return turn


async def stop(page: Page, turn: Locator) -> None:
    await expect(turn).to_have_class(has_class("processing"))  # all of it happened mid-stream
    await page.click("#cancel")
    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)


async def test_home_in_the_conversation_reaches_the_top_at_once_while_an_answer_streams(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    await open_hangar(page, relay)
    turn = await streaming(page, start_drone, openai_peer)
    jump = page.locator("#jump-latest")

    # Home typed in the prompt moves its caret: the view goes on following the stream.
    await page.locator("#prompt").focus()
    await page.keyboard.press("Home")
    await grows(page)
    await following_at_bottom(page)

    await page.locator("#conversation").focus()
    await page.keyboard.press("Home")

    # One press is enough: the view reaches the top, however fast the answer grows meanwhile.
    await page.wait_for_function(f"() => {CONVERSATION}.scrollTop === 0", timeout=SCROLL_MS)
    await expect(jump).to_be_visible(timeout=WAIT_MS)
    await grows(page)
    now = await metrics(page)
    assert now["top"] == 0, f"the view left the top as the answer grew: {now}"
    assert now["fromBottom"] > now["client"], now

    # Back to following, then Ctrl+Home does the same.
    await jump.click()
    await following_at_bottom(page)
    await page.locator("#conversation").focus()
    await page.keyboard.press("Control+Home")
    await page.wait_for_function(f"() => {CONVERSATION}.scrollTop === 0", timeout=SCROLL_MS)
    await grows(page)
    assert (await metrics(page))["top"] == 0
    await stop(page, turn)


async def press(page: Page, key: str) -> float:
    """Press `key` in the conversation; how far (px) it scrolled up, once its scroll is over."""
    await page.locator("#conversation").focus()
    await page.keyboard.press(key)
    await page.wait_for_function(
        f"() => {CONVERSATION}.scrollTop < window.__keyTops.at(-1)", timeout=SCROLL_MS
    )
    await settled(page)
    now = await metrics(page)
    return now["keyTop"] - now["top"]


@pytest.mark.parametrize(
    ("key", "least"),
    [("PageUp", 0.6), ("Shift+Space", 0.6), ("ArrowUp", 0.05)],
    ids=["page-up", "shift-space", "arrow-up"],
)
async def test_a_key_scrolls_up_its_whole_step_on_a_phone_while_an_answer_streams(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    key: str,
    least: float,
) -> None:
    """PageUp and Shift+Space move up by most of a screen, ArrowUp by a line: pressed while the
    view follows the stream, by as much as the same key pressed again once it no longer does;
    and the view stays there while more text streams in below it. A few times over, each from
    the bottom again ("Jump to latest"): a key can come at any moment of a frame."""
    await page.set_viewport_size({"width": 375, "height": 667})
    await open_hangar(page, relay)
    turn = await streaming(page, start_drone, openai_peer)
    jump = page.locator("#jump-latest")

    for _ in range(3):
        first = await press(page, key)

        await expect(jump).to_be_visible(timeout=WAIT_MS)
        held = await metrics(page)
        await grows(page)
        now = await metrics(page)
        assert now["top"] == held["top"], f"the view moved as the answer grew: {held} -> {now}"
        again = await press(page, key)  # not following any more: the key's whole step
        assert again >= least * now["client"], (again, now)
        assert first >= again - 1, f"{key} moved {first} px while following, {again} px after"
        await jump.click()
        await following_at_bottom(page)
    await stop(page, turn)


async def test_a_slow_finger_dragging_the_text_down_stops_following_on_a_phone(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    """A finger moving a pixel or two a frame: each move scrolls less than a new line adds, and
    the view must not be pinned to the bottom again between them."""
    async with phone_page(page, relay) as phone:
        await expect(phone.locator("#connection")).to_have_attribute(
            "data-state", "connected", timeout=WAIT_MS
        )
        turn = await streaming(phone, start_drone, openai_peer)
        # Where the view was as the finger's first move came (the moves within the touch slop,
        # before it, are not the page's to see).
        await phone.evaluate(
            f"""() => window.addEventListener(
                "touchmove", () => window.__keyTops.push({CONVERSATION}.scrollTop),
                {{ capture: true, once: true, passive: true }},
            )"""
        )
        box = await phone.locator("#conversation").bounding_box()
        assert box is not None
        x, y = box["x"] + box["width"] / 2, box["y"] + 40
        cdp = await phone.context.new_cdp_session(phone)

        async def finger(kind: str, *at: float) -> None:
            points = [{"x": x, "y": at[0], "id": 1}] if at else []
            await cdp.send("Input.dispatchTouchEvent", {"type": kind, "touchPoints": points})

        await finger("touchStart", y)
        for step in range(1, 41):
            await phone.evaluate("() => new Promise(requestAnimationFrame)")  # a move a frame
            await finger("touchMove", y + 2 * step)
        await finger("touchEnd")

        await expect(phone.locator("#jump-latest")).to_be_visible(timeout=SCROLL_MS)
        await settled(phone)
        held = await metrics(phone)
        assert held["keyTop"] - held["top"] >= 20, f"the drag moved the view too little: {held}"
        await grows(phone)
        now = await metrics(phone)
        assert now["top"] == held["top"], f"the view moved as the answer grew: {held} -> {now}"
        await stop(phone, turn)
