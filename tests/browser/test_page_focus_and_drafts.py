"""The page's header and its prompt, in real Chromium.

Tab goes through the header in the order it is drawn (rows top to bottom, each left to right)
on a desktop, a phone and a short screen, also while the connection is lost (its Reconnect
then has a row of its own on the small screens). And a draft outlasts a reload: whole when the
tab has room for it (also one full of quotes and line breaks, also beside a sub-agent's output
the page keeps too), and when it has not, its beginning (or nothing, in a tab already full),
with a note by the prompt that says so before the reload and after it; nothing throws as the
page goes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import TypedDict

import pytest
from playwright.async_api import Page, expect

from hangar.shared.protocol import IDE_NAMESPACE
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, open_hangar
from tests.browser.test_page_subagents import settled, start_delegating
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser


class Stop(TypedDict):
    """Where Tab stopped: the element (its id), whether it is in the header, and its box."""

    name: str
    header: bool
    left: float
    top: float
    right: float
    bottom: float


FOCUSED = """() => {
    const el = document.activeElement;
    if (!el || el === document.body) return null;
    const r = el.getBoundingClientRect();
    return {
        name: el.id || el.className || el.tagName,
        header: Boolean(el.closest(".sidebar")),
        left: r.left, top: r.top, right: r.right, bottom: r.bottom,
    };
}"""

# What each layout's header offers the keyboard, besides its sessions list.
CONTROLS = {
    "desktop": {"log-out", "new-session", "drone", "sessions-search"},
    "phone": {"log-out", "sessions-toggle", "new-session", "drone"},
    "short": {"log-out", "sessions-toggle", "new-session", "drone"},
}
SIZES = {"desktop": (1280, 800), "phone": (375, 667), "short": (900, 400)}


@contextlib.asynccontextmanager
async def sized_page(page: Page, relay: RelayHandle, layout: str) -> AsyncIterator[Page]:
    """The tester's page, connected, in a light window of the layout's size (a phone's is a
    touch screen); uncaught JavaScript errors in it fail the test."""
    browser = page.context.browser
    assert browser is not None
    width, height = SIZES[layout]
    touch = layout == "phone"
    context = await browser.new_context(
        viewport={"width": width, "height": height},
        is_mobile=touch,
        has_touch=touch,
        color_scheme="light",
    )
    try:
        opened = await context.new_page()
        errors: list[str] = []
        opened.on("pageerror", lambda error: errors.append(str(error)))
        await open_hangar(opened, relay)
        yield opened
        assert not errors, f"uncaught JavaScript errors in the page: {errors}"
    finally:
        await context.close()


async def lose_connection(page: Page, relay: RelayHandle) -> None:
    """The relay ends the page's connection: the page says so, and offers Reconnect."""
    sio = relay.relay.sio
    for sid, _ in list(sio.manager.get_participants(IDE_NAMESPACE, None)):
        await sio.disconnect(sid, namespace=IDE_NAMESPACE)
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "disconnected", timeout=WAIT_MS
    )
    await expect(page.locator("#reconnect")).to_be_visible()


async def header_stops(page: Page) -> list[Stop]:
    """Tab from the skip link to the prompt: where it stops in the header, in turn."""
    await page.locator(".skip-link").focus()
    stops: list[Stop] = []
    for _ in range(40):
        await page.keyboard.press("Tab")
        stop: Stop | None = await page.evaluate(FOCUSED)
        assert stop is not None, f"Tab left the page after {[s['name'] for s in stops]}"
        if stop["name"] == "prompt":
            return stops
        if stop["header"]:
            stops.append(stop)
    raise AssertionError(f"Tab never reached the prompt: {[s['name'] for s in stops]}")


def drawn_before(a: Stop, b: Stop) -> bool:
    """Whether a person reading the page (rows top to bottom, each left to right) meets ``a``
    before ``b``: two boxes that share some height are on one row."""
    same_row = a["top"] < b["bottom"] and b["top"] < a["bottom"]
    return a["left"] < b["left"] if same_row else a["top"] < b["top"]


@pytest.mark.parametrize("connection", ["connected", "lost"])
@pytest.mark.parametrize("layout", ["desktop", "phone", "short"])
async def test_tab_goes_through_the_header_in_the_order_it_is_drawn(
    page: Page, relay: RelayHandle, layout: str, connection: str
) -> None:
    """WCAG 2.4.3: on a phone the sessions button (☰) is drawn first on its row but was
    reached after "+" and the drone picker; on a short screen, whose one row ends with the
    person and Log out, Log out came first. A lost connection's Reconnect is drawn below Log
    out on a small screen and above it on a desktop."""
    async with sized_page(page, relay, layout) as sized:
        expected = set(CONTROLS[layout])
        if connection == "lost":
            await lose_connection(sized, relay)
            expected.add("reconnect")

        stops = await header_stops(sized)

        names = [stop["name"] for stop in stops]
        assert expected <= set(names), f"Tab never reached {expected - set(names)}: {names}"
        wrong = [
            f"{a['name']} then {b['name']}" for a, b in pairwise(stops) if not drawn_before(a, b)
        ]
        assert not wrong, f"Tab goes {names}, against the drawn order at: {wrong}"


# ---------------------------------------------------------------------------- drafts

# The draft, made in the page (a paste of millions of characters): ``unit`` over and over,
# cut to ``size``; pasted as one input event, as a clipboard paste is.
PASTE = """([unit, size]) => {
    const text = unit.repeat(Math.ceil(size / unit.length)).slice(0, size);
    const prompt = document.getElementById("prompt");
    prompt.focus();
    prompt.setRangeText(text, 0, prompt.value.length, "end");
    prompt.dispatchEvent(new InputEvent("input", { bubbles: true, inputType: "insertFromPaste" }));
}"""
# What the prompt holds after the reload: its length, and whether it is the draft's beginning.
KEPT = """([unit, size]) => {
    const text = unit.repeat(Math.ceil(size / unit.length)).slice(0, size);
    const kept = document.getElementById("prompt").value;
    return [kept.length, text.startsWith(kept)];
}"""
# The page's pagehide listeners, run as the page goes, here in a page that stays: what they
# throw (an exception as a page really goes is reported nowhere a test can see).
HIDE = """() => {
    const errors = [];
    const note = (event) => errors.push(String(event.error ?? event.message));
    addEventListener("error", note);
    dispatchEvent(new PageTransitionEvent("pagehide"));
    removeEventListener("error", note);
    return errors;
}"""
# About what a Chromium tab's sessionStorage holds: 5,242,880 UTF-16 code units, keys included.
TAB_ROOM = 5_242_880


async def reload_with_draft(page: Page) -> None:
    """Reload (nothing thrown as the page goes), and wait until the page has connected again
    and given the draft back."""
    assert await page.evaluate(HIDE) == [], "an exception as the page goes"
    await page.reload()
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )
    await page.wait_for_function(
        "() => document.getElementById('prompt').value !== ''", timeout=WAIT_MS
    )


async def test_a_draft_too_long_for_the_tab_keeps_its_beginning_and_says_so(
    page: Page, relay: RelayHandle
) -> None:
    """A pasted log of 6,000,000 characters came back from a reload empty, with no word: the
    tab's storage refused it (QuotaExceededError as the page went) and all of it was lost."""
    await open_hangar(page, relay)
    draft = ("draft line ", 6_000_000)
    note = page.locator("#draft-note")
    await expect(note).to_be_hidden()

    await page.evaluate(PASTE, draft)

    # Said while there is time to act: before the reload, by the prompt (and to a screen
    # reader, once: the words do not change with each key while the draft is that long).
    await expect(note).to_be_visible()
    await expect(note).to_have_attribute("role", "status")
    await expect(note).to_contain_text("a reload keeps only its first")
    await expect(page.locator("#prompt")).to_have_attribute(
        "aria-describedby", "prompt-help draft-note"
    )
    said = await note.text_content()
    await page.locator("#prompt").press("End")
    await page.locator("#prompt").press("x")
    await page.wait_for_function(
        "(n) => document.getElementById('prompt').value.length === n", arg=draft[1] + 1
    )
    assert await note.text_content() == said

    await reload_with_draft(page)

    length, beginning = await page.evaluate(KEPT, draft)
    assert beginning, "what came back is not the draft's beginning"
    assert 0.9 * TAB_ROOM < length < draft[1], f"{length:,} characters came back"
    assert said is not None and f"first {length:,} characters" in said, said  # as foretold
    await expect(note).to_be_visible()
    await expect(note).to_contain_text(f"only its first {length:,} of 6,000,001 characters")

    # A draft the tab has room for says nothing more.
    await page.locator("#prompt").fill("A short one")
    await expect(note).to_be_hidden()


async def test_a_long_draft_the_tab_has_room_for_outlasts_a_reload_whole(
    page: Page, relay: RelayHandle
) -> None:
    """4,500,000 characters of quotes and line breaks fit the tab's storage as they are, but
    not as JSON (each quote and line break escaped: over 5,500,000): that draft was lost too."""
    await open_hangar(page, relay)
    draft = ('"quoted" ' * 10 + "\n", 4_500_000)
    note = page.locator("#draft-note")

    await page.evaluate(PASTE, draft)
    await expect(note).to_be_hidden()  # the note comes with the paste's input event, if at all
    await reload_with_draft(page)

    assert await page.evaluate(KEPT, draft) == [draft[1], True]
    await expect(note).to_be_hidden()


async def test_a_draft_the_tab_has_room_for_goes_before_the_pages_other_keepsakes(
    page: Page, relay: RelayHandle
) -> None:
    """As the page goes it also keeps a running sub-agent's output for the tab's next page (the
    relay's snapshot holds it too). Written first, 1,500,000 characters of it left a draft of
    4,000,000, which the tab has room for, too little: the draft goes first now."""
    report = ("A helper's long report, line after line. " * 5 + "\n\n") * 1_200  # 253,200
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        for _ in range(6):
            await drone.text(turn_id, report, depth=1)
        await drone.text(turn_id, "End of the report.", depth=1)
        await settled(page, turn_id, "End of the report.")
        draft = ("draft line ", 4_000_000)
        await page.evaluate(PASTE, draft)
        await expect(page.locator("#draft-note")).to_be_hidden()

        await reload_with_draft(page)

        assert await page.evaluate(KEPT, draft) == [draft[1], True]
        await expect(page.locator("#draft-note")).to_be_hidden()


async def test_a_draft_the_tab_has_no_room_for_at_all_is_said_lost(
    page: Page, relay: RelayHandle
) -> None:
    """Something else of the site's filled the tab's storage: the draft cannot be kept at all.
    The note says so before the reload, and after it, with nothing thrown as the page went."""
    await open_hangar(page, relay)
    draft = ("draft line ", 2_000_000)
    # What leaves the draft's text no room: the draft's keys and whose it is take the rest.
    meta = len('{"person":"tester","length":2000000}')
    full = TAB_ROOM - len("other") - len("hangar.draft") - meta - len("hangar.draft.text")
    await page.evaluate("(n) => sessionStorage.setItem('other', 'x'.repeat(n))", full)
    note = page.locator("#draft-note")

    await page.evaluate(PASTE, draft)
    await expect(note).to_have_text(
        "This draft is longer than this tab can keep: a reload keeps none of it."
    )

    assert await page.evaluate(HIDE) == [], "an exception as the page goes"
    await page.reload()
    await expect(note).to_have_text(
        "This draft did not come back: this tab had no room for its 2,000,000 characters.",
        timeout=WAIT_MS,
    )
    await expect(page.locator("#prompt")).to_have_value("")
