"""A turn's completion carries its last finished messages (an aborted turn's partial answer, say):
one event and one answer instead of one each. The relay stores them before the ending, once each;
a relay that does not take such a bundle gets them one at a time (docs/protocol.md,
``workOrderComplete``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import socketio

from bench.peers import OpenAIPeer, Reply
from hangar.drone.tools.policy import ToolPolicy
from hangar.drone.worker import DroneConfig, run_drone
from hangar.server.drones import UNREADABLE_ENDING
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.protocol import DRONE_NAMESPACE, NO_ACTIVE_WORK_ORDER
from tests.bare_relay import BareRelay
from tests.conftest import DRONE_TOKEN, Browser, RelayHandle, drone_hello, eventually


class HandDrone:
    """A drone driven by hand: it takes every order and reports only what a test tells it."""

    def __init__(self) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.orders: asyncio.Queue[str] = asyncio.Queue()
        self.abort_answer = (True, "Abort signaled")
        self.approval_answer: Any = {"ok": True}
        self.sio.on("workOrder", self.on_work_order, namespace=DRONE_NAMESPACE)
        self.sio.on("abortWorkOrder", self.on_abort, namespace=DRONE_NAMESPACE)
        self.sio.on("approveToolCall", self.on_approve, namespace=DRONE_NAMESPACE)

    async def connect(self, url: str) -> HandDrone:
        await self.sio.connect(
            url, namespaces=[DRONE_NAMESPACE], transports=["websocket"], auth=drone_hello("hand-1")
        )
        return self

    async def on_work_order(self, order: dict[str, Any]) -> dict[str, Any]:
        self.orders.put_nowait(order["turnId"])
        return {"ok": True}

    async def on_abort(self, order: dict[str, Any]) -> tuple[bool, str]:
        return self.abort_answer

    async def on_approve(self, answer: dict[str, Any]) -> Any:
        return self.approval_answer

    async def report(self, event: dict[str, Any]) -> Any:
        return await self.sio.call("workOrderProgress", event, namespace=DRONE_NAMESPACE)

    async def message(self, turn_id: str, number: int, message: dict[str, Any]) -> Any:
        event = {"kind": "message", "turnId": turn_id, "number": number, "message": message}
        return await self.sio.call("workOrderProgress", event, namespace=DRONE_NAMESPACE)

    async def complete(self, turn_id: str, ending: dict[str, Any]) -> Any:
        return await self.sio.call(
            "workOrderComplete", (turn_id, True, "aborted", ending), namespace=DRONE_NAMESPACE
        )


@pytest.fixture
async def hand_drone(relay: RelayHandle) -> AsyncIterator[HandDrone]:
    drone = await HandDrone().connect(relay.url)
    await eventually(lambda: relay.relay.directory.local, what="the drone")
    yield drone
    await drone.sio.disconnect()


def partial(content: str, number: int = 0) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "aborted": True}
    return {"number": number, "message": message}


ESSAY = [("user", "Write an essay"), ("assistant", "Essays are")]
"""The history of a turn asked to write an essay that ended with its partial answer."""


async def a_running_turn(browsers: Any, hand_drone: HandDrone) -> tuple[Browser, dict[str, Any]]:
    """A new person's browser and the ack of their turn, which the hand-driven drone runs."""
    browser = await browsers()
    ack = await browser.submit("Write an essay")
    assert await asyncio.wait_for(hand_drone.orders.get(), 5) == ack["turnId"]
    return browser, ack


async def stored(browser: Browser, session_id: str) -> list[tuple[str, str]]:
    opened = await browser.call("openSession", {"sessionId": session_id})
    return [(m["role"], m["content"]) for t in opened["turns"] for m in t["messages"]]


async def test_a_completion_carrying_its_last_message_stores_it_first_and_once(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any
) -> None:
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]
    assert await browser.abort(turn_id) == (True, "Abort signaled")

    bundle = {"reason": "aborted", "messages": [partial("Essays are")]}
    assert await hand_drone.complete(turn_id, bundle) == {"ok": True}
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    # The page hears of the message before the turn's end, as when it comes on its own.
    heard = [
        "message" if event == "workOrderProgress" else event
        for event, args in browser.events
        if event in ("workOrderProgress", "workOrderComplete")
    ]
    assert heard == ["message", "workOrderComplete"]
    assert browser.progress(turn_id, "message")[0]["message"]["content"] == "Essays are"
    assert (await browser.ending(turn_id))["status"] == "aborted"
    session = ack["sessionId"]
    assert await stored(browser, session) == ESSAY

    # Sent again (its answer was lost): refused as ended, and the message is still there once.
    again = await hand_drone.complete(turn_id, bundle)
    assert again == {"ok": False, "error": "The turn has already ended."}
    assert await stored(browser, session) == ESSAY


async def test_a_completion_carrying_a_bad_message_is_refused_whole_and_loses_nothing(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any
) -> None:
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]

    robot = {"number": 0, "message": {"role": "robot", "content": "beep"}}
    too_many = [partial(f"part {n}", n) for n in range(65)]
    for messages in ([robot], too_many, [{"number": -1, "message": partial("x")["message"]}]):
        answer = await hand_drone.complete(turn_id, {"reason": "finished", "messages": messages})
        assert answer["ok"] is False
        assert "messages" in answer["error"]
    # Nothing of them was kept, and the turn still runs: a good one then ends it.
    assert browser.completions(turn_id) == []
    assert browser.progress(turn_id, "message") == []
    good = {"reason": "finished", "messages": [partial("Essays are")]}
    assert await hand_drone.complete(turn_id, good) == {"ok": True}
    await browser.completion(turn_id)
    assert await stored(browser, ack["sessionId"]) == ESSAY


@pytest.mark.parametrize(
    ("message", "ending", "why"),
    [
        ("x" * 100_001, {"reason": "model_failed"}, "at most 100000 characters"),
        ("done", {"reason": "finished", "usage": {"promptTokens": 2**63}}, "usage"),
        ("done", {"reason": "finished", "usage": {"promptTokens": -1}}, "usage"),
    ],
    ids=["a message too long", "a count too large", "a negative count"],
)
async def test_an_ending_the_relay_cannot_take_ends_the_turn_in_error_not_never(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any, message: str, ending: Any, why: str
) -> None:
    """A drone does not send a refused completion again: a turn whose completion the relay
    cannot read stayed processing for ever, and its drone's next turns waited behind it
    (docs/protocol.md, ``workOrderComplete``). It ends in error, saying why."""
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]

    answer = await hand_drone.sio.call(
        "workOrderComplete", (turn_id, True, message, ending), namespace=DRONE_NAMESPACE
    )

    assert answer["ok"] is False and why in answer["error"]
    _, success, result = await browser.completion(turn_id)
    assert success is False and result.startswith(UNREADABLE_ENDING) and why in result
    assert (await browser.ending(turn_id))["reason"] == "drone_failed"
    assert await stored(browser, ack["sessionId"]) == [("user", "Write an essay")]


@pytest.mark.parametrize(
    "arguments",
    [
        lambda turn: (turn, True),
        lambda turn: (turn, True, "done", {"reason": "finished"}, "more"),
        lambda turn: ({"turnId": turn, "success": True, "message": "done"},),
    ],
    ids=["two", "five", "one object"],
)
async def test_an_ending_with_the_wrong_arguments_ends_the_turn_in_error_not_never(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any, arguments: Any
) -> None:
    """Refused with "Invalid payload", a completion of two or five arguments, or of one object,
    left its turn processing for as long as the drone stayed connected."""
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]

    answer = await hand_drone.sio.call(
        "workOrderComplete", arguments(turn_id), namespace=DRONE_NAMESPACE
    )

    assert answer["ok"] is False and "expected turnId, success, message" in answer["error"]
    _, success, result = await browser.completion(turn_id)
    assert success is False and result.startswith(UNREADABLE_ENDING)
    assert (await browser.ending(turn_id))["reason"] == "drone_failed"


@pytest.mark.parametrize(
    ("reason", "shown"),
    [("removed", "aborted"), ("unanswered", "aborted"), ("relay_restarted", "drone_failed")],
)
async def test_a_drone_cannot_end_a_turn_for_a_reason_only_the_relay_gives(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any, reason: str, shown: str
) -> None:
    """A drone ending its turn "as its person was removed", "after the drone did not answer" or
    "as the relay restarted" had that shown to the person, who was not removed, and whose
    relay had not restarted."""
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]
    success = shown != "drone_failed"

    answer = await hand_drone.sio.call(
        "workOrderComplete",
        (turn_id, success, "aborted" if success else "It broke.", {"reason": reason}),
        namespace=DRONE_NAMESPACE,
    )

    assert answer == {"ok": True}
    assert (await browser.ending(turn_id))["reason"] == shown


async def test_a_tool_result_that_makes_calls_is_refused_and_the_history_stays_valid(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any
) -> None:
    """A tool message carrying calls of its own was stored, and the ending gave that call a
    result after the final answer: a history every model service refuses, for every later turn
    of the session."""
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]
    calls = [{"id": "c1", "name": "read_file", "arguments": "{}"}]
    assert await hand_drone.message(
        turn_id, 0, {"role": "assistant", "content": "", "toolCalls": calls}
    ) == {"ok": True}

    another = [{**calls[0], "id": "c2"}]
    odd: list[dict[str, Any]] = [
        {"role": "tool", "content": "x", "toolCallId": "c1", "toolCalls": another},
        {"role": "assistant", "content": "Done.", "toolCallId": "c1"},
    ]
    answers = [await hand_drone.message(turn_id, 1, message) for message in odd]
    assert await hand_drone.message(
        turn_id, 1, {"role": "tool", "content": "x", "toolCallId": "c1"}
    ) == {"ok": True}
    assert await hand_drone.complete(turn_id, {"reason": "finished"}) == {"ok": True}
    await browser.completion(turn_id)

    assert [answer["ok"] for answer in answers] == [False, False]
    assert all("tool result" in answer["error"] for answer in answers)
    assert await stored(browser, ack["sessionId"]) == [
        ("user", "Write an essay"), ("assistant", ""), ("tool", "x")
    ]  # fmt: skip


async def test_a_message_without_its_number_is_refused_not_taken_and_lost(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any
) -> None:
    """Messages sent without a number were stored; a numbered one after them was answered
    ``ok`` and never stored (taken for one of theirs, sent again)."""
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]
    unnumbered = {"kind": "message", "turnId": turn_id, "message": partial("a")["message"]}

    answer = await hand_drone.report(unnumbered)
    assert await hand_drone.message(turn_id, 0, partial("Essays are")["message"]) == {"ok": True}
    assert await hand_drone.complete(turn_id, {"reason": "aborted"}) == {"ok": True}
    await browser.completion(turn_id)

    assert answer["ok"] is False and "number" in answer["error"]
    assert await stored(browser, ack["sessionId"]) == ESSAY


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        ({"ok": False}, "No such tool call is waiting for approval."),
        ({"ok": False, "error": {"nested": [1, 2]}}, "No such tool call is waiting for approval."),
        ({"ok": False, "error": "Busy \ud800" + "x" * 10_000}, "Busy \ufffd" + "x" * 3_994),
    ],
    ids=["no reason", "no text", "too long"],
)
async def test_a_drones_refusal_of_an_approval_reaches_the_person_as_text(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any, answer: Any, shown: str
) -> None:
    """A drone's refusal was passed on as it came: "None", a Python repr, or all of 10,000
    characters."""
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]
    waiting = {"kind": "tool", "turnId": turn_id, "callId": "c1", "name": "run_command",
               "state": "waiting", "arguments": "{}"}  # fmt: skip
    assert await hand_drone.report(waiting) == {"ok": True}
    hand_drone.approval_answer = answer

    refused = await browser.call(
        "approveToolCall", {"turnId": turn_id, "callId": "c1", "approve": True}
    )

    assert refused["ok"] is False and refused["error"].startswith(shown)
    assert len(refused["error"]) < 4100


async def test_a_turn_its_drone_finished_ends_as_the_drone_says_while_it_delivers_its_messages(
    relay: RelayHandle, hand_drone: HandDrone, browsers: Any
) -> None:
    """A drone that answers an abort "No active work order to abort" has finished the turn and
    may still be sending what it said, a message per answer (thousands of tool results): the
    relay waited its grace (2 s) from the abort, ended the turn aborted ("unanswered"), and
    stored the results still on their way as lost. Each message gives the drone the grace again."""
    hand_drone.abort_answer = (False, NO_ACTIVE_WORK_ORDER)
    browser, ack = await a_running_turn(browsers, hand_drone)
    turn_id = ack["turnId"]
    calls = [{"id": f"c{n}", "name": "list_directory", "arguments": "{}"} for n in range(3)]
    asked = {"role": "assistant", "content": "", "toolCalls": calls}
    assert await hand_drone.message(turn_id, 0, asked) == {"ok": True}

    assert await browser.abort(turn_id) == (False, NO_ACTIVE_WORK_ORDER)
    for n in range(3):  # 3.6 s of deliveries, past the grace
        await asyncio.sleep(1.2)  # the drone's pace, not a wait for the relay
        result = {"role": "tool", "content": f"files {n}", "toolCallId": f"c{n}"}
        assert await hand_drone.message(turn_id, n + 1, result) == {"ok": True}
    last = {"number": 4, "message": {"role": "assistant", "content": "Listed."}}
    done = ("workOrderComplete", (turn_id, True, "Listed.", {"reason": "finished",
                                                             "messages": [last]}))  # fmt: skip
    assert await hand_drone.sio.call(*done, namespace=DRONE_NAMESPACE) == {"ok": True}

    assert await browser.completion(turn_id) == (turn_id, True, "Listed.")
    assert (await browser.ending(turn_id))["reason"] == "finished"
    history = await stored(browser, ack["sessionId"])
    assert history[-4:] == [("tool", "files 0"), ("tool", "files 1"), ("tool", "files 2"),
                            ("assistant", "Listed.")]  # fmt: skip


class OlderRelay(BareRelay):
    """A relay of before bundles, on ``/drone`` only: it refuses a completion with messages (its
    ``Ending`` has no such field) and takes messages and completions one at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[str, Any]] = []
        self.ended = asyncio.Event()

    async def on_progress(self, sid: str, data: dict[str, Any]) -> dict[str, Any]:
        if data["kind"] == "message":
            self.received.append(("message", data["message"]["content"]))
        return {"ok": True}

    async def on_complete(self, sid: str, *args: Any) -> dict[str, Any]:
        if len(args) == 4 and "messages" in args[3]:
            self.received.append(("refused bundle", len(args[3]["messages"])))
            return {"ok": False, "error": "Invalid payload (ending.messages: not permitted)."}
        self.received.append(("complete", args[1]))
        self.ended.set()
        return {"ok": True}


@pytest.mark.parametrize("workers", [0, 1], ids=["in the drone", "in a worker process"])
async def test_a_drone_whose_relay_refuses_bundles_sends_them_one_at_a_time(
    openai_peer: OpenAIPeer, tmp_path: Any, workers: int
) -> None:
    older = OlderRelay()
    port = await older.start()
    config = DroneConfig(
        server=f"http://127.0.0.1:{port}",
        token=DRONE_TOKEN,
        name="newer",
        provider="openai",
        model="gpt-test",
        base_url=openai_peer.base_url + "/v1",
        api_key="test-key",
        tools=ToolPolicy.allow_all(),
        workdir=str(tmp_path),
        workers=workers,
    )
    root = AbortController()
    drone = asyncio.ensure_future(run_drone(config, root))
    try:
        await eventually(lambda: older.drone, timeout=30, what="the drone")
        openai_peer.script(Reply(chunks=["Hello", " there"]))
        order = {"turnId": "t_1", "sessionId": "s_1", "prompt": "Hi", "history": []}
        accepted = await older.sio.call(
            "workOrder", order, to=older.drone, namespace=DRONE_NAMESPACE
        )
        assert accepted == {"ok": True}
        await asyncio.wait_for(older.ended.wait(), 10)
        # Tried together first, then each on its own: nothing lost, nothing twice.
        assert older.received == [
            ("refused bundle", 1), ("message", "Hello there"), ("complete", True)
        ]  # fmt: skip
    finally:
        root.abort(AbortError("The test is over.", cause="operator"))
        await asyncio.wait_for(drone, 10)
        await older.runner.cleanup()
