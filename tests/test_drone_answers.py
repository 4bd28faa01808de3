"""What a drone answers the relay, however wrong: its turn ends once, with a reason a person can
read, and nothing is sent again for ever (docs/protocol.md, "Drone events"); and what a relay
sends a drone, however wrong, gets an answer that says so."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from hangar.drone.connection import ONE_ARGUMENT
from hangar.drone.tools.policy import ToolPolicy
from hangar.drone.worker import DroneConfig, run_drone
from hangar.server.dispatch import REFUSAL_CHARS
from hangar.server.reports import MOST_WAITING, TOO_MANY_WAITING
from hangar.server.snapshots import json_size
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.protocol import (
    DRONE_NAMESPACE,
    NO_ACTIVE_WORK_ORDER,
    WORK_ORDER,
    WORK_ORDER_COMPLETE,
)
from tests.bare_relay import BareRelay
from tests.browser.hand_drone import ANSWER_TIMEOUT, HandDrone
from tests.conftest import DRONE_TOKEN, Browser, RelayHandle, drone_hello, eventually
from tests.test_access import refusal_of

HUGE = "x" * 2_000_000


@pytest.mark.parametrize(
    ("error", "told"),
    [
        ("bad \ud800 news", "bad \ufffd news"),
        (HUGE, f"{'x' * REFUSAL_CHARS}[… {len(HUGE) - REFUSAL_CHARS} more characters not shown]"),
        ({"nested": ["a", 1]}, "The drone refused the work order."),
        ("   ", "The drone refused the work order."),
    ],
    ids=["half-a-surrogate-pair", "huge", "not-text", "blank"],
)
async def test_a_drones_refusal_of_any_shape_ends_its_turn_once_in_words(
    relay: RelayHandle,
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
    error: Any,
    told: str,
) -> None:
    """A refusal holding half a surrogate pair could not be stored: the turn went back in line
    and was sent again, 23 times in 7 s, for ever. A refusal of 2,000,000 characters was stored
    whole and the session's page was told to resync instead of seeing the turn end; one that
    was no text was stored as Python's repr of it."""
    caplog.set_level(logging.INFO)
    orders: list[dict[str, Any]] = []

    async def refuse(data: dict[str, Any]) -> dict[str, Any]:
        orders.append(data)
        return {"ok": False, "error": error}

    async with HandDrone(relay.url) as drone:
        drone.client.on(WORK_ORDER, refuse, namespace=DRONE_NAMESPACE)
        turn_id = (await browser.submit("Refuse this"))["turnId"]

        assert await browser.completion(turn_id, timeout=10) == (turn_id, False, told)
    turn = await relay.relay.store.get_turn(turn_id, messages=False)
    assert turn is not None and (turn.status, turn.reason, turn.result) == (
        "error",
        "drone_failed",
        told,
    )
    assert len(orders) == 1 and "resync" not in [event for event, _ in browser.events]
    assert "Traceback" not in caplog.text


async def test_a_message_number_no_store_holds_is_refused_for_good(
    relay: RelayHandle, browser: Browser, caplog: pytest.LogCaptureFixture
) -> None:
    """A message numbered 2**63 (2**31 on PostgreSQL) did not fit the store's integer: the drone
    was told to send it again, for ever, and so was a completion carrying it, which never
    landed: the turn stayed processing."""
    caplog.set_level(logging.INFO)
    message = {"role": "assistant", "content": "Hello"}
    async with HandDrone(relay.url) as drone:
        turn_id = (await browser.submit("Number it"))["turnId"]
        assert await drone.next_order() == turn_id
        for number in (2**63, 2**31):
            payload = {"kind": "message", "turnId": turn_id, "number": number, "message": message}
            ack = await drone.client.call(
                "workOrderProgress", payload, namespace=DRONE_NAMESPACE, timeout=ANSWER_TIMEOUT
            )
            assert ack["ok"] is False and "retry" not in ack and "number" in ack["error"], ack
        ending = {"reason": "finished", "messages": [{"number": 2**63, "message": message}]}
        ack = await drone.client.call(
            WORK_ORDER_COMPLETE,
            (turn_id, True, "Hello", ending),
            namespace=DRONE_NAMESPACE,
            timeout=ANSWER_TIMEOUT,
        )
        assert ack["ok"] is False and "retry" not in ack, ack
        await drone.complete(turn_id, True, "Hello", {"reason": "finished"})
        assert await browser.completion(turn_id) == (turn_id, True, "Hello")
    assert "Traceback" not in caplog.text


async def test_an_event_from_the_relay_with_more_arguments_is_refused_in_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A work order, an abort or an approval sent with two arguments: the drone's handler failed
    with a traceback ("takes from 0 to 1 positional arguments but 2 were given") and the
    relay got no answer at all."""
    caplog.set_level(logging.INFO)
    relay = BareRelay()
    port = await relay.start()
    config = DroneConfig(
        server=f"http://127.0.0.1:{port}",
        token=DRONE_TOKEN,
        name="strict",
        provider="openai",
        model="gpt-test",
        base_url="http://127.0.0.1:9/v1",
        api_key="test-key",
        tools=ToolPolicy.allow_all(),
        workdir=str(tmp_path),
        workers=0,
    )
    root = AbortController()
    drone = asyncio.ensure_future(run_drone(config, root))
    try:
        sid = await eventually(lambda: relay.drone, timeout=30, what="the drone")
        order = {"turnId": "t_1", "sessionId": "s_1", "prompt": "Hi", "history": []}
        for event, data, refused in (
            (WORK_ORDER, order, {"ok": False, "error": ONE_ARGUMENT}),
            ("abortWorkOrder", {"turnId": "t_1"}, (False, ONE_ARGUMENT)),
            ("approveToolCall", {"turnId": "t_1"}, {"ok": False, "error": ONE_ARGUMENT}),
        ):
            answer = await relay.sio.call(
                event, (data, "more"), to=sid, namespace=DRONE_NAMESPACE, timeout=5
            )
            assert answer == refused, event
    finally:
        root.abort(AbortError("The test is over.", cause="operator"))
        await asyncio.wait_for(drone, 10)
        await relay.runner.cleanup()
    assert "Traceback" not in caplog.text


async def test_a_turn_its_drone_completed_before_accepting_its_order_stays_ended(
    relay: RelayHandle, browser: Browser
) -> None:
    """A drone that reported a turn's completion and only then answered its work order "ok":
    the relay took the ended turn for running. Its later text went to pages, an abort of it
    was answered "Abort signaled", and its live state was never dropped."""
    async with HandDrone(relay.url) as drone:

        async def complete_first(data: dict[str, Any]) -> dict[str, Any]:
            await drone.complete(data["turnId"], True, "Done at once.", {"reason": "finished"})
            return {"ok": True}

        drone.client.on(WORK_ORDER, complete_first, namespace=DRONE_NAMESPACE)
        turn_id = (await browser.submit("Be quick"))["turnId"]
        assert await browser.completion(turn_id) == (turn_id, True, "Done at once.")
        await eventually(lambda: relay.relay.turns.ended_here, what="the ending stored")

        assert await browser.abort(turn_id) == (False, NO_ACTIVE_WORK_ORDER)
        assert turn_id not in relay.relay.turns.live
        assert turn_id not in relay.relay.turns.accepted


@pytest.mark.parametrize(
    ("success", "message", "said", "kept"),
    [
        (True, "done", "aborted", ("aborted", "aborted")),
        (False, "boom", "finished", ("error", "drone_failed")),
        (True, "aborted", "finished", ("finished", "finished")),
        (False, "aborted", "operator", ("error", "drone_failed")),
    ],
    ids=["aborted-saying-done", "failed-for-finished", "an-answer-aborted", "failed-for-operator"],
)
async def test_a_completion_whose_reason_contradicts_it_is_kept_as_it_reads(
    relay: RelayHandle,
    browser: Browser,
    success: bool,
    message: str,
    said: str,
    kept: tuple[str, str],
) -> None:
    """A completion of (True, "done") with the reason "aborted", or (False, "boom") with
    "finished": the turn was stored finished-and-aborted, or in error for having finished, and
    pages were told so in ``turnEnded``. Its reason says how it ended, unless it says a failed
    turn did not fail; and a model whose whole answer was "aborted" finished."""
    async with HandDrone(relay.url) as drone:
        turn_id = (await browser.submit("Contradict yourself"))["turnId"]
        assert await drone.next_order() == turn_id
        await drone.complete(turn_id, success, message, {"reason": said})
        assert await browser.completion(turn_id) == (turn_id, success, message)
    turn = await relay.relay.store.get_turn(turn_id, messages=False)
    assert turn is not None and (turn.status, turn.reason) == kept
    ended = await browser.ending(turn_id)
    assert (ended["status"], ended["reason"]) == kept


async def test_a_drone_keeps_a_few_calls_waiting_for_approval_not_a_flood(
    relay: RelayHandle, browser: Browser, caplog: pytest.LogCaptureFixture
) -> None:
    """A drone runs a step's calls one at a time, so a turn has one call waiting for approval
    (docs/protocol.md, ``tool``). One that reported 40 calls of 100,000 characters waiting had
    them all kept: every snapshot of the session carried 4 MB of them, past the 4 MiB a default
    python-socketio client reads. Past ``MOST_WAITING`` a waiting call is refused in words."""
    caplog.set_level(logging.INFO)
    arguments = '{"command": "' + "y" * 99_000 + '"}'
    async with HandDrone(relay.url) as drone:
        ack = await browser.submit("Wait for many")
        turn_id = ack["turnId"]
        assert await drone.next_order() == turn_id
        answers = []
        for number in range(40):
            payload = {
                "kind": "tool",
                "turnId": turn_id,
                "callId": f"call_{number}",
                "name": "run_command",
                "state": "waiting",
                "arguments": arguments,
                "depth": 0,
            }
            answers.append(
                await drone.client.call(
                    "workOrderProgress", payload, namespace=DRONE_NAMESPACE, timeout=ANSWER_TIMEOUT
                )
            )
        refused = [a for a in answers if a != {"ok": True}]
        assert answers[:MOST_WAITING] == [{"ok": True}] * MOST_WAITING
        assert refused and all(a == {"ok": False, "error": TOO_MANY_WAITING} for a in refused)

        snapshot = await browser.call("openSession", {"sessionId": ack["sessionId"]})
        assert json_size(snapshot) < 1_000_000
        [turn] = snapshot["turns"]
        assert [c["callId"] for c in turn["waiting"]] == [f"call_{n}" for n in range(MOST_WAITING)]
        # An answered call makes room for the next.
        await drone.tool(turn_id, "call_0", "declined", name="run_command", result="No.")
        await drone.tool(turn_id, "call_40", "waiting", name="run_command", arguments="{}")
        await drone.complete(turn_id, True, "Done", {"reason": "finished"})
        assert await browser.completion(turn_id) == (turn_id, True, "Done")
    assert "Traceback" not in caplog.text


async def test_a_drone_naming_more_turns_than_it_could_run_is_refused_in_words(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture
) -> None:
    """A drone runs at most 1,024 turns at once (its concurrency's bound), and a few unwinding
    an abort. One that named 100,000 as running when it connected was taken at its word: the
    relay told it to abort each, one call after another, some 4,000 a second."""
    running = [f"t_{n:06d}" for n in range(100_000)]
    refused = await refusal_of(
        relay.url,
        DRONE_NAMESPACE,
        auth={**drone_hello("many-1"), "running": running},
        transports=["websocket"],
    )
    assert refused == {
        "message": "Invalid payload (running: List should have at most 4096 items after "
        "validation, not 100000)."
    }
    assert "Traceback" not in caplog.text
