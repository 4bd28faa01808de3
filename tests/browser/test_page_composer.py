"""The composer's arrows in real Chromium, at desktop and phone widths: a recalled prompt of one
long line wraps over several lines on screen, and ArrowUp/ArrowDown move the caret between
those lines as in any text box; only from the first line drawn (or the last) do they walk the
session's earlier prompts."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from playwright.async_api import Page, expect

from tests.browser.conftest import artifact
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import (
    WAIT_MS,
    has_class,
    open_hangar,
    record_outgoing,
    sent,
    submit,
    turn_id_of,
)
from tests.browser.test_page_render import still
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser

SIZES = {"desktop": (1280, 800), "phone": (390, 844)}
SCHEMES: tuple[Literal["light", "dark"], ...] = ("light", "dark")

# One line, no line breaks: long enough to wrap over several lines at either width.
LONG = (
    "Read every module of the relay and write a short summary of what each one does, "
    "which other modules it depends on, where its state lives, how it recovers after a "
    "restart, and which of its functions are the ones a newcomer should read first. "
    "Keep each summary to three sentences and end with a list of open questions."
)

# How many lines the prompt's text is drawn on.
DRAWN = """(p) => {
    const style = getComputedStyle(p);
    const line = parseFloat(style.lineHeight);
    const pad = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
    return Math.round((p.scrollHeight - pad) / line);
}"""


async def drawn_lines(page: Page) -> int:
    lines: int = await page.locator("#prompt").evaluate(DRAWN)
    return lines


async def caret(page: Page) -> int:
    at: int = await page.locator("#prompt").evaluate("p => p.selectionStart")
    return at


async def finished(page: Page, drone: HandDrone, prompt: str) -> None:
    turn = await submit(page, prompt)
    turn_id = await drone.next_order()
    assert turn_id == await turn_id_of(turn)
    await drone.text(turn_id, "Done.")
    await drone.complete(turn_id, True, "Done.")
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)


@pytest.mark.parametrize(
    ("device", "long"),
    [("desktop", LONG), ("phone", LONG), ("phone", " ".join([LONG] * 3))],
    ids=["desktop", "phone", "phone-scrolling"],
)
async def test_the_arrows_move_the_caret_between_the_drawn_lines_of_a_recalled_prompt(
    page: Page, relay: RelayHandle, device: str, long: str
) -> None:
    """At phone width a prompt three times as long is taller than the composer may grow: it
    scrolls, and its scrollbar narrows the lines."""
    width, height = SIZES[device]
    shot = f"{device}-scrolling" if len(long) > len(LONG) else device
    await page.set_viewport_size({"width": width, "height": height})
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        await finished(page, drone, "first")
        await finished(page, drone, long)
        prompt = page.locator("#prompt")

        await prompt.focus()
        await page.keyboard.press("ArrowUp")
        await expect(prompt).to_have_value(long)
        lines = await drawn_lines(page)
        assert lines >= 3, f"the long prompt should wrap over several lines, not {lines}"
        assert await caret(page) == len(long)  # at its end, on its last line

        # Up through its lines: the prompt stays, the caret rises a line each time.
        for _ in range(lines - 1):
            before = await caret(page)
            await page.keyboard.press("ArrowUp")
            await expect(prompt).to_have_value(long)
            assert await caret(page) < before
        for scheme in SCHEMES:
            await page.emulate_media(color_scheme=scheme)
            await still(page)
            await page.screenshot(
                path=artifact(f"composer-recalled-{shot}-{scheme}.png"), caret="initial"
            )
        await page.emulate_media(color_scheme="light")

        # And down again: the caret goes back a line at a time, the prompt stays.
        for _ in range(lines - 1):
            before = await caret(page)
            await page.keyboard.press("ArrowDown")
            await expect(prompt).to_have_value(long)
            assert await caret(page) > before
        # From its last line drawn, ArrowDown goes on to the empty composer.
        await page.keyboard.press("ArrowDown")
        await expect(prompt).to_have_value("")

        # From its first line drawn, ArrowUp goes on to the prompt before it.
        await page.keyboard.press("ArrowUp")
        await expect(prompt).to_have_value(long)
        for _ in range(lines - 1):
            await page.keyboard.press("ArrowUp")
        await expect(prompt).to_have_value(long)
        await page.keyboard.press("ArrowUp")
        await expect(prompt).to_have_value("first")


# Short lines, just under the 100,000 characters a prompt may have.
MANY_LINES = "x\n" * 49_500
# Pasted in, the composer's direction was taken by the browser's dir="auto" over the whole
# text: about 8 s here (near the limit, tens of seconds on a slower machine, and the socket's
# ping timed out). A person pasting a long log waits a second or two at most.
RESPONSIVE_S = 4.5

# What a paste does to the composer: its whole text changes, then "input" is fired. (Playwright's
# fill types the text through the editor line by line, which takes minutes for so many lines.)
PASTE = """(text) => {
    const prompt = document.getElementById("prompt");
    prompt.focus();
    prompt.value = text;
    prompt.dispatchEvent(new InputEvent("input", { bubbles: true, inputType: "insertFromPaste" }));
}"""


async def test_a_prompt_of_many_short_lines_keeps_the_page_responsive(
    page: Page, relay: RelayHandle
) -> None:
    await open_hangar(page, relay)
    prompt = page.locator("#prompt")
    loop = asyncio.get_running_loop()

    start = loop.time()
    await page.evaluate(PASTE, MANY_LINES)
    await page.keyboard.type("y")
    await page.wait_for_function("() => document.getElementById('prompt').value.endsWith('y')")
    took = loop.time() - start

    assert took < RESPONSIVE_S, f"pasting and a keystroke took {took:.1f} s"
    assert await prompt.evaluate("(p) => p.value.length") == len(MANY_LINES) + 1
    assert await prompt.evaluate("(p) => getComputedStyle(p).direction") == "ltr"
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    # Pasted over, a Hebrew prompt reads right to left; one that starts with a number too.
    await page.evaluate(PASTE, "3 שאלות קצרות?\nשורה שנייה.")
    assert await prompt.evaluate("(p) => getComputedStyle(p).direction") == "rtl"
    await prompt.fill("")
    assert await prompt.evaluate("(p) => getComputedStyle(p).direction") == "ltr"


async def test_a_prompt_of_only_invisible_characters_is_not_sent(
    page: Page, relay: RelayHandle
) -> None:
    """Zero-width spaces and joiners, a word joiner, a byte order mark: nothing to read, so
    nothing is sent, as for a prompt of spaces."""
    await open_hangar(page, relay)
    await record_outgoing(page)
    prompt = page.locator("#prompt")
    for blank in ("\u200b\u200b", " \u200b\u2060\ufeff \n\u200d", "   "):
        await prompt.fill(blank)
        await prompt.press("Enter")
        await page.click("#submit")

    turn = await submit(page, "Something to read")  # sent after them, shown after them

    await expect(page.locator("#turns article.turn")).to_have_count(1)
    await expect(turn.locator(".turn-prompt")).to_have_text("Something to read")
    assert (await sent(page)).count("submitWorkOrder") == 1
    await expect(prompt).to_be_focused()
    await expect(page.locator("#sessions .session-title")).to_have_text(["Something to read"])
    await expect(page.locator("#session-title")).to_have_text("Something to read")
