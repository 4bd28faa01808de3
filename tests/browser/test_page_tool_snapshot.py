"""A model step's tool calls in real Chromium, in a page that stayed open and in one that opened
(or reloaded) mid-step: the drone runs a step's calls one at a time, so a page that stayed open
shows each call once it starts. A page built from the session's snapshot must show the same, not
every call of the step as running at once."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from playwright.async_api import Page, expect

from tests.browser.conftest import artifact
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, has_class, open_hangar, submit, turn_id_of
from tests.browser.test_page_render import still
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser

SCHEMES: tuple[Literal["light", "dark"], ...] = ("light", "dark")
CALLS = [
    {"id": f"call_{name}", "name": "read_file", "arguments": json.dumps({"path": f"{name}.md"})}
    for name in ("README", "NOTES", "TODO")
]

# What a turn's output shows, part by part: text, and each tool line's call, name, arguments,
# badge and result.
SHOWN = """(id) => {
    const out = document.querySelector(`article.turn[data-turn-id="${id}"] .turn-output`);
    if (!out) return null;
    const text = (el, sel) => el.querySelector(sel)?.textContent ?? null;
    return [...out.children].map((el) =>
        el.classList.contains("tool")
            ? ["tool", el.dataset.callId, text(el, ".tool-name"), text(el, ".tool-args"),
               text(el, ".tool-badge"), text(el, ".tool-result-body"),
               el.querySelector(".approval") !== null]
            : ["text", el.textContent]);
}"""


async def shown(page: Page, turn_id: str) -> Any:
    return await page.evaluate(SHOWN, turn_id)


async def badge_is(page: Page, turn_id: str, call_id: str, badge: str) -> None:
    line = page.locator(f'article.turn[data-turn-id="{turn_id}"] .tool[data-call-id="{call_id}"]')
    await expect(line.locator(".tool-badge")).to_have_text(badge, timeout=WAIT_MS)


async def shows_exactly(page: Page, seen: str, turn_id: str, expected: Any) -> None:
    """Wait (bounded) until ``page`` shows exactly ``expected`` of the turn, as the script
    ``seen`` reads it."""
    try:
        await page.wait_for_function(
            "([id, want]) => JSON.stringify((" + seen + ")(id)) === JSON.stringify(want)",
            arg=[turn_id, expected],
            timeout=WAIT_MS,
        )
    except Exception:
        assert await page.evaluate(seen, turn_id) == expected  # says what differs
        raise


async def shows_the_same(page: Page, turn_id: str, expected: Any) -> None:
    await shows_exactly(page, SHOWN, turn_id, expected)


async def step_of_three_calls(page: Page, drone: HandDrone, second_state: str = "start") -> str:
    """A turn whose model step asks for three calls: the first has run, the second runs (or
    waits for the person: ``second_state``)."""
    turn = await submit(page, "Read the three notes")
    turn_id = await drone.next_order()
    assert turn_id == await turn_id_of(turn)
    words = "I will read the three files.\n\n"
    await drone.text(turn_id, words)
    await drone.message(turn_id, 0, {"role": "assistant", "content": words, "toolCalls": CALLS})
    first, second, _ = CALLS
    await drone.tool(turn_id, first["id"], "start", name="read_file", arguments=first["arguments"])
    await drone.tool(turn_id, first["id"], "end", name="read_file", result="# Readme")
    tool_message = {"role": "tool", "content": "# Readme", "toolCallId": first["id"]}
    await drone.message(turn_id, 1, {**tool_message, "name": "read_file"})
    await drone.tool(
        turn_id, second["id"], second_state, name="read_file", arguments=second["arguments"]
    )
    return turn_id


async def opened_mid_step(page: Page) -> Page:
    """A second tab of the same person on the same session: it starts from the snapshot."""
    other = await page.context.new_page()
    await other.goto(page.url)
    await expect(other.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )
    return other


async def test_a_page_opened_mid_step_shows_only_the_calls_that_started(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await step_of_three_calls(page, drone)
        await badge_is(page, turn_id, "call_NOTES", "running")
        stayed = await shown(page, turn_id)
        # The page that stayed open: the first call done, the second running, the third not yet.
        assert [part[1] for part in stayed if part[0] == "tool"] == ["call_README", "call_NOTES"]

        other = await opened_mid_step(page)
        turn = other.locator(f'article.turn[data-turn-id="{turn_id}"]')
        await expect(turn).to_have_class(has_class("processing"), timeout=WAIT_MS)
        await shows_the_same(other, turn_id, stayed)
        for device, size in (("desktop", (1280, 800)), ("phone", (390, 844))):
            await other.set_viewport_size({"width": size[0], "height": size[1]})
            for scheme in SCHEMES:
                await other.emulate_media(color_scheme=scheme)
                await turn.scroll_into_view_if_needed()
                await still(other)  # the new width's layout has settled (a drawer slides)
                await other.screenshot(path=artifact(f"tool-snapshot-{device}-{scheme}.png"))
        await other.emulate_media(color_scheme="light")

        # Reloaded too, it shows the same.
        await other.reload()
        await shows_the_same(other, turn_id, stayed)

        # The second call ends and the third starts: both pages show it where it belongs.
        second, third = CALLS[1], CALLS[2]
        await drone.tool(turn_id, second["id"], "end", name="read_file", result="some notes")
        tool_message = {"role": "tool", "content": "some notes", "toolCallId": second["id"]}
        await drone.message(turn_id, 2, {**tool_message, "name": "read_file"})
        await drone.tool(
            turn_id, third["id"], "start", name="read_file", arguments=third["arguments"]
        )
        await badge_is(page, turn_id, third["id"], "running")
        during = await shown(page, turn_id)
        await shows_the_same(other, turn_id, during)

        await drone.tool(turn_id, third["id"], "end", name="read_file", result="- ship it")
        await drone.text(turn_id, "All three are read.")
        await drone.complete(turn_id, True, "Done.")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        await expect(page.locator(f'article.turn[data-turn-id="{turn_id}"]')).to_have_class(
            has_class("finished"), timeout=WAIT_MS
        )
        await shows_the_same(other, turn_id, await shown(page, turn_id))


async def test_a_page_opened_while_a_call_waits_shows_the_later_calls_not_started(
    page: Page, relay: RelayHandle
) -> None:
    """The second call waits for the person's approval: the snapshot's `waiting` brings its
    card back, and the third call, not started, is not shown as running."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await step_of_three_calls(page, drone, "waiting")
        second = CALLS[1]
        await badge_is(page, turn_id, second["id"], "waiting for approval")
        stayed = await shown(page, turn_id)
        assert [part[1] for part in stayed if part[0] == "tool"] == ["call_README", "call_NOTES"]

        other = await opened_mid_step(page)
        await shows_the_same(other, turn_id, stayed)
        await expect(other.locator(".turn .approval")).to_have_count(1)
