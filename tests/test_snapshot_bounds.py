"""A running turn's snapshot (``openSession``) stays within a page (``SNAPSHOT_BYTES``), so a
default python-socketio client (4 MiB a message) reads it, however much its sub-agents streamed
and however long the arguments of its calls waiting for approval are: their largest parts come
cut, each saying how much was left out, and a call cut so stays answerable (docs/protocol.md,
``openSession``). Before, 500,000 emoji from a sub-agent made a snapshot of 6 MB, four waiting
calls of 600,000 "é" one of 14 MB, and the browser that opened the session was disconnected
instead of getting it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from hangar.server.snapshots import SNAPSHOT_BYTES, Page, json_size
from hangar.shared.protocol import APPROVE_TOOL_CALL, DRONE_NAMESPACE
from tests.browser.hand_drone import HandDrone
from tests.conftest import Browser, RelayHandle, eventually

EMOJI = "\U0001f600"  # 12 bytes as JSON (escaped), one character to Python
MAX_TEXT_EVENT = 65_536  # characters of one text event (docs/protocol.md)
CUT = re.compile(r"(.*?)(\n\n)?\[… (\d+) more characters not shown\](\n\n)?", re.DOTALL)


class AnsweringDrone(HandDrone):
    """A hand-driven drone that takes every answer to its waiting calls, and keeps them."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.client.on(APPROVE_TOOL_CALL, self._answer, namespace=DRONE_NAMESPACE)

    async def _answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        await self.answers.put(answer)
        return {"ok": True}


@pytest.fixture
async def drone(relay: RelayHandle) -> AsyncIterator[AnsweringDrone]:
    async with AnsweringDrone(relay.url) as drone:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        yield drone


async def running_turn(
    browsers: Callable[..., Any], drone: AnsweringDrone
) -> tuple[Browser, dict[str, Any]]:
    """Ada's browser and the ack of her turn, which the hand-driven drone runs."""
    owner: Browser = await browsers("ada")
    ack: dict[str, Any] = await owner.submit("Delegate a long text")
    assert await drone.next_order() == ack["turnId"]
    return owner, ack


async def opened_elsewhere(
    browsers: Callable[..., Any], session_id: str
) -> tuple[Browser, dict[str, Any]]:
    """Another browser of Ada's (a reload, another tab) and the session's snapshot it got; it
    stays connected (a round trip after the snapshot)."""
    other: Browser = await browsers("ada")
    snapshot: dict[str, Any] = await other.call("openSession", {"sessionId": session_id})
    assert snapshot["ok"] is True
    assert (await other.call("listSessions", {}))["ok"] is True
    assert other.sio.connected
    assert json_size(snapshot["turns"]) <= SNAPSHOT_BYTES
    return other, snapshot


def cut_apart(text: str) -> tuple[str, int]:
    """A cut string's head and how many characters were left out after it."""
    found = CUT.fullmatch(text)
    assert found is not None, text[-200:]
    return found[1], int(found[3])


async def sub_agent_writes(drone: AnsweringDrone, turn_id: str, text: str) -> None:
    """The turn's own agent starts a sub-agent, which streams ``text`` at depth 1."""
    await drone.tool(turn_id, "spawn", "start", name="spawn_subagent", arguments="{}")
    for start in range(0, len(text), MAX_TEXT_EVENT):
        await drone.text(turn_id, text[start : start + MAX_TEXT_EVENT], depth=1)


async def test_a_page_opened_after_a_sub_agent_wrote_500_000_emoji_gets_what_fits(
    relay: RelayHandle, drone: AnsweringDrone, browsers: Callable[..., Any]
) -> None:
    owner, ack = await running_turn(browsers, drone)
    turn_id = ack["turnId"]
    await sub_agent_writes(drone, turn_id, EMOJI * 500_000)
    await eventually(  # its 8 events: the last passes the relay's bound, and is not kept
        lambda: [p for p in owner.progress(turn_id) if p["depth"] == 1][7:],
        what="the sub-agent's text",
    )

    _, snapshot = await opened_elsewhere(browsers, ack["sessionId"])

    [turn] = snapshot["turns"]
    assert turn["status"] == "processing"
    [run] = turn["subAgents"]
    assert run["after"] == "spawn"
    [part] = run["parts"]
    assert part["depth"] == 1
    head, left_out = cut_apart(part["text"])
    kept = [p for p in owner.progress(turn_id) if p["depth"] == 1 and "subSeq" in p]
    assert turn["subAgentSeq"] == 1 + len(kept)
    assert set(head) == {EMOJI} and len(head) > 200_000  # most of the page
    assert len(head) + left_out == sum(len(p["text"]) for p in kept)


async def test_a_page_opened_while_calls_with_long_arguments_wait_gets_them_cut_and_answers(
    relay: RelayHandle, drone: AnsweringDrone, browsers: Callable[..., Any]
) -> None:
    """Each event is under what the relay reads (3.6 MB): together they are not. The calls stay
    answerable, from the page that got them cut too (the relay keeps them whole)."""
    _, ack = await running_turn(browsers, drone)
    turn_id = ack["turnId"]
    for n in range(4):
        await drone.tool(turn_id, f"c{n}", "waiting", name="write_file", arguments="é" * 600_000)

    other, snapshot = await opened_elsewhere(browsers, ack["sessionId"])

    [turn] = snapshot["turns"]
    assert [c["callId"] for c in turn["waiting"]] == ["c0", "c1", "c2", "c3"]
    for call in turn["waiting"]:
        assert call["state"] == "waiting" and call["name"] == "write_file"
        head, left_out = cut_apart(call["arguments"])
        assert set(head) == {"é"} and len(head) + left_out == 600_000 and len(head) > 100_000
    for call_id, approve in (("c0", False), ("c1", True)):
        payload = {"turnId": turn_id, "callId": call_id, "approve": approve}
        assert await other.call("approveToolCall", payload) == {"ok": True}
        answer = await asyncio.wait_for(drone.answers.get(), 5)
        assert (answer["callId"], answer["approve"]) == (call_id, approve)


async def test_a_call_waiting_comes_whole_and_the_sub_agents_output_gives_way(
    relay: RelayHandle, drone: AnsweringDrone, browsers: Callable[..., Any]
) -> None:
    """The longest arguments a drone puts to a person (100,000 characters) come whole beside a
    sub-agent's output too large for the page: the output is cut instead."""
    owner, ack = await running_turn(browsers, drone)
    turn_id = ack["turnId"]
    await sub_agent_writes(drone, turn_id, EMOJI * 400_000)
    arguments = '{"command": "' + "é" * 99_900 + '"}'
    await drone.tool(turn_id, "ask", "waiting", name="run_shell", arguments=arguments)
    await eventually(lambda: owner.progress(turn_id, "tool")[1:], what="the waiting call")

    _, snapshot = await opened_elsewhere(browsers, ack["sessionId"])

    [turn] = snapshot["turns"]
    [call] = turn["waiting"]
    assert call["arguments"] == arguments
    [run] = turn["subAgents"]
    head, left_out = cut_apart(run["parts"][0]["text"])
    assert len(head) + left_out == 400_000 and len(head) > 100_000


@pytest.mark.parametrize(
    ("prompt", "limits"),
    [("a follow-up", (1, 3)), (EMOJI * 99_990, (30,))],
    ids=["three follow-ups, a page of 1 or 3", "three follow-ups of 1.2 MB each"],
)
async def test_the_running_turn_and_its_waiting_calls_are_in_the_first_page_whatever_follows(
    relay: RelayHandle,
    drone: AnsweringDrone,
    browsers: Callable[..., Any],
    prompt: str,
    limits: tuple[int, ...],
) -> None:
    """docs/protocol.md: "A processing turn is always in the first page". The follow-ups
    queued behind it are newer and filled the page first: it held only queued turns, and the
    page, with nothing to stream into, showed the session idle. The session's view said no
    call waited for approval, where the session list said one did."""
    owner, ack = await running_turn(browsers, drone)
    turn_id, session_id = ack["turnId"], ack["sessionId"]
    await drone.tool(turn_id, "ask", "waiting", name="run_shell", arguments='{"command": "ls"}')
    await eventually(lambda: owner.progress(turn_id, "tool"), what="the waiting call")
    for n in range(3):
        assert (await owner.submit(f"{n} {prompt}", sessionId=session_id))["ok"] is True
    other: Browser = await browsers("ada")

    for limit in limits:
        snapshot = await other.call("openSession", {"sessionId": session_id, "limit": limit})

        shown = [(turn["turnId"], turn["status"]) for turn in snapshot["turns"]]
        assert (turn_id, "processing") in shown, (limit, shown)
        assert [turn["status"] for turn in snapshot["turns"]][-3:] == ["queued"] * 3
        assert json_size(snapshot["turns"]) <= SNAPSHOT_BYTES
        assert snapshot["session"]["approvals"] == 1


def processing(**parts: Any) -> dict[str, Any]:
    """A running turn's view as a snapshot holds it (wire form)."""
    return {
        "turnId": "t_1",
        "sessionId": "s_1",
        "prompt": "Go",
        "status": "processing",
        "text": "",
        "textSeq": 0,
        "messages": [],
        "waiting": [],
        "stopping": False,
        "subAgents": [],
        "subAgentSeq": 0,
        **parts,
    }


def test_a_running_answer_keeps_its_text_and_the_call_waiting_gets_what_is_left() -> None:
    page = Page()
    call = {"kind": "tool", "callId": "c", "name": "run_shell", "state": "waiting"}
    text = "a" * 2_900_000
    page.add(processing(text=text, waiting=[{**call, "arguments": "b" * 200_000}]))

    [turn] = page.turns
    assert turn["text"] == text and json_size(turn) <= SNAPSHOT_BYTES
    head, left_out = cut_apart(turn["waiting"][0]["arguments"])
    assert len(head) + left_out == 200_000 and len(head) > 50_000


def test_sub_agent_output_of_too_many_parts_leaves_the_last_out_saying_how_many() -> None:
    """30,000 tool calls of a sub-agent: 4 MB even with no text at all."""
    calls = [
        {"tool": {"callId": f"call_{n:040d}", "depth": 1, "name": "list_directory", "state": "end"}}
        for n in range(30_000)
    ]
    page = Page()
    page.add(processing(subAgents=[{"after": "spawn", "parts": calls}]))

    [turn] = page.turns
    assert json_size(turn) <= SNAPSHOT_BYTES
    [run] = turn["subAgents"]
    *shown, last = run["parts"]
    assert shown == calls[: len(shown)] and len(shown) > 10_000
    left_out = re.fullmatch(r"\n*\[… (\d+) more parts not shown\]\n*", last["text"])
    assert left_out is not None and int(left_out[1]) == 30_000 - len(shown)
