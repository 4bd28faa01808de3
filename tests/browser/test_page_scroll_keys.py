"""Scrolling a streaming answer with the keyboard, in real Chromium: a key that scrolls the
conversation up (Home, Ctrl+Home, PageUp, Shift+Space, ArrowUp) stops following the stream at
once, as the mouse wheel does, so the key's whole scroll applies and the view is not pinned to
the bottom again halfway; keys typed in the prompt leave the following alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from bench.peers import OpenAIPeer, Reply
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
            window.addEventListener(
                "keydown", () => window.__keyTops.push({CONVERSATION}.scrollTop), {{ capture: true }},
            );
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


async def streaming(page: Page, start_drone: Callable[..., Any], openai_peer: OpenAIPeer) -> Locator:
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


@pytest.mark.parametrize(
    ("key", "most"),
    [("PageUp", 0.6), ("Shift+Space", 0.6), ("ArrowUp", None)],
    ids=["page-up", "shift-space", "arrow-up"],
)
async def test_a_key_scrolls_up_its_whole_step_on_a_phone_while_an_answer_streams(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    key: str,
    most: float | None,
) -> None:
    """PageUp and Shift+Space move up by most of a screen, ArrowUp by a line (Chromium's 40
    px); the view stays there while more text streams in below it."""
    await page.set_viewport_size({"width": 375, "height": 667})
    await open_hangar(page, relay)
    turn = await streaming(page, start_drone, openai_peer)

    await page.locator("#conversation").focus()
    await page.keyboard.press(key)

    client = (await metrics(page))["client"]
    step = most * client if most else 30
    await page.wait_for_function(
        f"""([step]) => {{
            const start = window.__keyTops.at(-1);
            return start - {CONVERSATION}.scrollTop >= step;
        }}""",
        arg=[step],
        timeout=SCROLL_MS,
    )
    await expect(page.locator("#jump-latest")).to_be_visible(timeout=WAIT_MS)
    held = await metrics(page)
    await grows(page)
    now = await metrics(page)
    assert now["top"] == held["top"], f"the view moved as the answer grew: {held} -> {now}"
    assert now["keyTop"] - now["top"] >= step, now
    await stop(page, turn)
