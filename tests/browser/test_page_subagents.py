"""A sub-agent's output in real Chromium, across a reload and in a page opened mid-sub-agent:
the page shows all the sub-agent streamed before it (the relay's snapshot holds it, the tab
keeps what it showed), never only its tail, and what streams while the snapshot is on its way
is shown once. Each page is compared with a second page of the same person that stayed open
all along."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, has_class, open_hangar, submit, turn_id_of
from tests.browser.test_page_tool_snapshot import shows_exactly
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser

SPAWN_ARGS = json.dumps({"task": "List the files and say what they hold"})

# What a turn's output shows, part by part: text segments (with their depth and their drawn
# Markdown) and tool lines (depth, call, badge, result).
SHOWN = """(id) => {
    const out = document.querySelector(`article.turn[data-turn-id="${id}"] .turn-output`);
    if (!out) return null;
    return [...out.children].map((el) =>
        el.classList.contains("tool")
            ? ["tool", el.dataset.depth, el.dataset.callId,
               el.querySelector(".tool-badge").textContent,
               el.querySelector(".tool-result-body").textContent]
            : ["text", el.dataset.depth, el.innerHTML]);
}"""


async def shown(page: Page, turn_id: str) -> Any:
    return await page.evaluate(SHOWN, turn_id)


async def settled(page: Page, turn_id: str, words: str) -> Any:
    """What the turn shows once ``words`` are drawn in it (the stayed page's view)."""
    await page.wait_for_function(
        """([id, words]) => {
            const out = document.querySelector(`article.turn[data-turn-id="${id}"] .turn-output`);
            return out !== null && out.textContent.includes(words);
        }""",
        arg=[turn_id, words],
        timeout=WAIT_MS,
    )
    # One more frame: text streamed in one event is drawn in the frame after it arrived.
    await page.evaluate("() => new Promise((done) => requestAnimationFrame(() => done()))")
    return await shown(page, turn_id)


async def shows_the_same(reloaded: Page, turn_id: str, expected: Any) -> None:
    await shows_exactly(reloaded, SHOWN, turn_id, expected)


async def start_delegating(page: Page, drone: HandDrone) -> str:
    """Submit a prompt whose turn says a few words and starts a sub-agent (depth 0 call)."""
    turn = await submit(page, "Delegate the file listing")
    turn_id = await drone.next_order()
    assert turn_id == await turn_id_of(turn)
    await drone.text(turn_id, "I will ask a helper.\n\n")
    call = {"id": "spawn1", "name": "spawn_subagent", "arguments": SPAWN_ARGS}
    content = "I will ask a helper.\n\n"
    await drone.message(turn_id, 0, {"role": "assistant", "content": content, "toolCalls": [call]})
    await drone.tool(turn_id, "spawn1", "start", name="spawn_subagent", arguments=SPAWN_ARGS)
    return turn_id


async def looks_around(drone: HandDrone, turn_id: str, files: str) -> None:
    """The sub-agent says a few words and lists the files (``files``, one a line)."""
    await drone.text(turn_id, "Looking around first.\n\n", depth=1)
    await drone.tool(turn_id, "ls1", "start", name="list_directory", arguments="{}", depth=1)
    await drone.tool(turn_id, "ls1", "end", name="list_directory", result=files, depth=1)


async def ends_with_one_file(drone: HandDrone, turn_id: str) -> None:
    """The sub-agent's call ends ("One file."), and the turn with a sentence of its own."""
    await drone.tool(turn_id, "spawn1", "end", name="spawn_subagent", result="One file.")
    result = {"role": "tool", "content": "One file.", "toolCallId": "spawn1"}
    await drone.message(turn_id, 1, {**result, "name": "spawn_subagent"})
    await drone.text(turn_id, "The helper found one file.")
    answer = {"role": "assistant", "content": "The helper found one file."}
    await drone.message(turn_id, 2, answer)
    await drone.complete(turn_id, True, "Done.")


async def watching(page: Page, turn_id: str) -> Page:
    """A second tab of the same person on the same session, left open throughout: it has the
    session's snapshot (the sub-agent's call running), so it gets all that follows."""
    other = await page.context.new_page()
    await other.goto(page.url)
    spawn = other.locator(f'article.turn[data-turn-id="{turn_id}"] .tool[data-call-id="spawn1"]')
    await expect(spawn.locator(".tool-badge")).to_have_text("running", timeout=WAIT_MS)
    return other


async def reload(page: Page) -> None:
    await page.reload()
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )


async def reloaded(page: Page, turn_id: str, status: str, expected: Any) -> Locator:
    """Reload ``page``: the turn comes back ``status``, showing ``expected``; returns it."""
    await reload(page)
    turn = page.locator(f'article.turn[data-turn-id="{turn_id}"]')
    await expect(turn).to_have_class(has_class(status), timeout=WAIT_MS)
    await shows_the_same(page, turn_id, expected)
    return turn


class HeldSnapshot:
    """The relay's read of a session's snapshot held open at ``method`` of its live state, so
    that events come while the snapshot is on its way."""

    def __init__(self, relay: RelayHandle, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        live = relay.relay.rooms.live
        read = getattr(live, method)
        self.reading, self.answer = asyncio.Event(), asyncio.Event()
        self.answer.set()

        async def held(turn_id: str) -> Any:
            value = await read(turn_id)
            self.reading.set()
            await self.answer.wait()
            return value

        monkeypatch.setattr(live, method, held)

    def hold(self) -> None:
        """Hold the next snapshot's read."""
        self.answer.clear()
        self.reading.clear()

    async def read(self, page: Page) -> None:
        """Wait until the relay has read it, then count the progress events ``page`` gets."""
        await asyncio.wait_for(self.reading.wait(), WAIT_MS / 1000)
        await page.evaluate(
            """() => {
                window.__progress = 0;
                window.hangar.socket.on("workOrderProgress", () => (window.__progress += 1));
            }"""
        )

    @staticmethod
    async def page_got(page: Page, events: int) -> None:
        await page.wait_for_function(f"() => window.__progress === {events}", timeout=WAIT_MS)

    def release(self) -> None:
        self.answer.set()


async def drop_connection(page: Page) -> None:
    """The page's connection drops, and stays down until ``connect_again``."""
    await page.evaluate(
        """() => {
            const io = window.hangar.socket.io;
            io.reconnection(false);
            io.engine.close();
        }"""
    )
    await expect(page.locator("#connection")).not_to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )


async def connect_again(page: Page) -> None:
    await page.evaluate(
        """() => {
            const socket = window.hangar.socket;
            socket.io.reconnection(true);
            socket.connect();
        }"""
    )


async def test_a_reload_mid_sub_agent_shows_what_a_page_that_stayed_open_shows(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        stayed = await watching(page, turn_id)
        await looks_around(drone, turn_id, "a.txt\nb.txt")
        # The sub-agent is in the middle of a Markdown list when the page reloads.
        await drone.text(turn_id, "Found two files:\n\n- `a.txt`, the notes\n- `b", depth=1)
        before = await settled(stayed, turn_id, "the notes")
        await settled(page, turn_id, "the notes")

        turn = await reloaded(page, turn_id, "processing", before)

        # The sub-agent goes on where it was: its list continues, it is not started afresh.
        await drone.text(turn_id, ".txt`, the plan\n\nBoth are short.", depth=1)
        during = await settled(stayed, turn_id, "Both are short.")
        await shows_the_same(page, turn_id, during)
        subs = page.locator(f'article.turn[data-turn-id="{turn_id}"] .seg.sub')
        await expect(subs.last.locator("li")).to_have_text(["a.txt, the notes", "b.txt, the plan"])

        # The sub-agent ends, the turn's own answer goes on and ends.
        await drone.tool(turn_id, "spawn1", "end", name="spawn_subagent", result="Both are short.")
        await drone.text(turn_id, "The helper found two short files.")
        await drone.complete(turn_id, True, "Done.")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        after = await settled(stayed, turn_id, "two short files")
        await shows_the_same(page, turn_id, after)
        answer = await page.evaluate("(id) => window.hangar.answerText(id)", turn_id)
        assert answer == "I will ask a helper.\n\nThe helper found two short files."


async def test_sub_agent_output_that_comes_before_the_snapshot_is_shown(
    page: Page, relay: RelayHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay puts the page in the session's room before it reads the snapshot: what a
    sub-agent streams while the relay is slow to answer reaches the page first, and is not in
    the snapshot."""
    held = HeldSnapshot(relay, monkeypatch, "waiting")
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        stayed = await watching(page, turn_id)
        await settled(page, turn_id, "I will ask a helper.")

        held.hold()
        await page.reload()
        await held.read(page)
        await drone.text(turn_id, "Sub-agent words while the snapshot was on its way. ", depth=1)
        await drone.tool(turn_id, "ls1", "start", name="list_directory", arguments="{}", depth=1)
        # The page has them (they came before the snapshot it still waits for).
        await HeldSnapshot.page_got(page, 2)
        expected = await settled(stayed, turn_id, "while the snapshot was on its way")
        held.release()

        await shows_the_same(page, turn_id, expected)


async def test_a_page_opened_mid_sub_agent_shows_what_the_sub_agent_streamed_before_it(
    page: Page, relay: RelayHandle
) -> None:
    """A tab that had nothing to carry over: the sub-agent's output comes from the snapshot."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        await looks_around(drone, turn_id, "a.txt\nb.txt")
        await drone.text(turn_id, "Found two files:\n\n- `a.txt`, the notes\n- `b", depth=1)
        before = await settled(page, turn_id, "the notes")

        opened = await page.context.new_page()
        await opened.goto(page.url)
        await shows_the_same(opened, turn_id, before)

        await drone.text(turn_id, ".txt`, the plan", depth=1)
        during = await settled(page, turn_id, "the plan")
        await shows_the_same(opened, turn_id, during)


async def test_a_reconnect_mid_sub_agent_keeps_what_streamed_while_the_snapshot_was_on_its_way(
    page: Page, relay: RelayHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page that had the turn's card already (its connection dropped and came back): what the
    sub-agent streams after the relay read the snapshot, and before the page has it, reaches the
    card shown until then. The snapshot holds more than that card (it missed what streamed while
    it was away), yet what came after the snapshot must not be lost with the card it replaces."""
    held = HeldSnapshot(relay, monkeypatch, "sub_agent_events")
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        stayed = await watching(page, turn_id)
        await drone.text(turn_id, "Before the connection dropped. ", depth=1)
        await settled(page, turn_id, "Before the connection dropped.")

        # The connection drops, and stays down while the sub-agent goes on.
        await drop_connection(page)
        await drone.text(turn_id, "Words the page missed while it was away. " * 3, depth=1)
        await drone.tool(turn_id, "ls1", "start", name="list_directory", arguments="{}", depth=1)

        held.hold()
        await connect_again(page)
        await held.read(page)
        await drone.tool(turn_id, "ls1", "end", name="list_directory", result="a.txt", depth=1)
        await drone.text(turn_id, "Words after the snapshot was read.", depth=1)
        await HeldSnapshot.page_got(page, 2)
        expected = await settled(stayed, turn_id, "after the snapshot was read")
        held.release()

        await shows_the_same(page, turn_id, expected)
        await drone.text(turn_id, " And more.", depth=1)
        await shows_the_same(page, turn_id, await settled(stayed, turn_id, "And more."))


async def test_a_turn_that_ended_while_the_page_was_away_keeps_the_sub_agent_output_it_showed(
    page: Page, relay: RelayHandle
) -> None:
    """The snapshot of an ended turn holds its messages, not what its sub-agents streamed: the
    page keeps what it showed of them, as a page that stayed open does."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        stayed = await watching(page, turn_id)
        await looks_around(drone, turn_id, "a.txt")
        await drone.text(turn_id, "One file: `a.txt`.", depth=1)
        await settled(page, turn_id, "One file")

        await drop_connection(page)
        await ends_with_one_file(drone, turn_id)
        expected = await settled(stayed, turn_id, "found one file")
        await connect_again(page)

        turn = page.locator(f'article.turn[data-turn-id="{turn_id}"]')
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        await shows_the_same(page, turn_id, expected)


async def test_a_reload_after_the_turn_ended_keeps_its_sub_agent_output(
    page: Page, relay: RelayHandle
) -> None:
    """The snapshot of an ended turn holds none of its sub-agents' output: a reload showed the
    turn without it, unlike the tab that stayed open."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn_id = await start_delegating(page, drone)
        stayed = await watching(page, turn_id)
        await looks_around(drone, turn_id, "a.txt")
        await ends_with_one_file(drone, turn_id)
        expected = await settled(stayed, turn_id, "found one file")
        await settled(page, turn_id, "found one file")

        await reloaded(page, turn_id, "finished", expected)
