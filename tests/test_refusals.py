"""Bad inputs and missing parts: each gets a clear answer, and nothing stored changes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import socketio

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.server.limits import NOT_UNICODE
from hangar.server.turns import EMPTY_PROMPT
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    DRONE_NAMESPACE,
    NO_ACTIVE_WORK_ORDER,
    STOP_AFTER_STEP,
    UNKNOWN_TURN,
    WORK_ORDER_COMPLETE,
)
from tests.browser.hand_drone import HandDrone
from tests.conftest import HANGAR, Browser, RelayHandle, Upstream, drone_hello, eventually

SLOW = Reply(chunks=[f"w{i} " for i in range(400)], delay=0.03)


async def test_an_abort_after_the_drone_died_is_honoured_by_the_relay(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
) -> None:
    openai_peer.script(SLOW)
    process = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone process")
    turn_id = (await browser.submit("Stream for a while"))["turnId"]
    await browser.wait_text(turn_id, pieces=2)

    process.send_signal(signal.SIGKILL)
    await eventually(lambda: not relay.relay.directory.local, what="the relay to notice")

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    assert await browser.completion(turn_id) == (turn_id, True, ABORTED)
    assert (await browser.ending(turn_id))["reason"] == "unanswered"
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None and turn.status == "aborted"
    assert turn.text == browser.text(turn_id)
    # What streamed before the drone died stays in the history, flagged as cut short.
    assert [(m.role, m.content, m.aborted) for m in turn.messages] == [
        ("user", "Stream for a while", None),
        ("assistant", browser.text(turn_id), True),
    ]


@pytest.mark.parametrize(
    ("auth", "reason"),
    [
        (None, "A drone token is required."),
        ({"token": "wrong"}, "Invalid drone token."),
    ],
)
async def test_a_drone_with_a_bad_token_is_refused_with_a_reason(
    relay: RelayHandle, auth: dict[str, str] | None, reason: str
) -> None:
    client = socketio.AsyncClient(reconnection=False)
    errors: list[Any] = []
    client.on("connect_error", errors.append, namespace=DRONE_NAMESPACE)

    with pytest.raises(socketio.exceptions.ConnectionError):
        await client.connect(
            relay.url, namespaces=[DRONE_NAMESPACE], auth=auth, transports=["websocket"]
        )

    assert errors == [{"message": reason}]
    assert not relay.relay.directory.local


async def test_the_drone_command_exits_with_one_clear_line_on_a_bad_token(
    relay: RelayHandle,
) -> None:
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "drone", "--server", relay.url,
        "--token", "wrong", "--provider", "openai", "--base-url", "http://127.0.0.1:9/v1",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 30)

    assert process.returncode == 2
    lines = stderr.decode().strip().splitlines()
    assert lines[-1] == "hangar drone: the relay refused this drone: Invalid drone token."
    assert "Traceback" not in stderr.decode()


async def test_a_browser_cannot_see_or_abort_another_browsers_turn(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browsers: Callable[..., Any],
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer))
    owner: Browser = await browsers()
    stranger: Browser = await browsers()
    ack = await owner.submit("Mine")
    await owner.wait_text(ack["turnId"], pieces=1)

    # Someone else's turn is refused exactly as a turn that does not exist.
    assert await stranger.abort(ack["turnId"]) == (False, UNKNOWN_TURN)
    assert await stranger.abort("t_doesnotexist") == (False, UNKNOWN_TURN)
    assert await stranger.abort() == (False, NO_ACTIVE_WORK_ORDER)
    opened = await stranger.call("openSession", {"sessionId": ack["sessionId"]})
    assert opened == {"ok": False, "error": "Unknown session."}
    refused = await stranger.submit("Into yours", sessionId=ack["sessionId"])
    assert refused == {"ok": False, "error": "Unknown session."}

    assert not stranger.progress(ack["turnId"])
    assert await owner.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    assert await owner.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")


async def test_the_same_person_sees_their_sessions_from_a_new_connection(
    relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    first: Browser = await browsers("remembered")
    ack = await first.submit("Remember me")  # waits in line: no drone is online

    again: Browser = await browsers("remembered")
    listed = await again.call("listSessions", {})

    assert [s["sessionId"] for s in listed["sessions"]] == [ack["sessionId"]]


async def test_abort_of_an_unknown_turn_is_refused(relay: RelayHandle, browser: Browser) -> None:
    assert await browser.abort("t_doesnotexist") == (False, UNKNOWN_TURN)


@pytest.mark.parametrize(
    ("event", "payload"),
    [
        ("submitWorkOrder", {}),
        ("submitWorkOrder", {"prompt": ""}),
        ("submitWorkOrder", {"prompt": 42}),
        ("submitWorkOrder", {"prompt": "hi", "unexpected": True}),
        ("submitWorkOrder", "just a string"),
        ("submitWorkOrder", {"prompt": "hi", "sessionId": "../../etc"}),
        ("submitWorkOrder", {"prompt": "x" * 100_001}),
        ("openSession", {}),
        ("openSession", [1, 2]),
        # A value of the wrong JSON type is refused, not converted.
        ("listSessions", {"limit": "5"}),
        ("listSessions", {"limit": 5.0}),
        ("listSessions", {"everyone": "true"}),
        ("listSessions", {"everyone": 1}),
        ("openSession", {"sessionId": "s_1", "limit": "5"}),
        ("submitWorkOrder", {"prompt": "hi", "sessionId": 12345}),
    ],
)
async def test_malformed_browser_payloads_get_an_error_ack_and_change_nothing(
    relay: RelayHandle, browser: Browser, event: str, payload: Any
) -> None:
    ack = await browser.call(event, payload)

    assert ack["ok"] is False and ack["error"].startswith("Invalid payload")
    assert await relay.relay.store.list_sessions(browser_owner(relay)) == []
    assert await relay.relay.store.processing_turns() == []


@pytest.mark.parametrize(
    "prompt",
    ["   \n\t ", "\u200b\u200b", "\u200e \ufeff\u2060", "\u3164\u2800", "\x00\x01\x7f"],
    ids=["white-space", "zero-width-spaces", "marks-and-joiners", "fillers", "controls"],
)
async def test_a_prompt_with_nothing_to_read_is_refused_and_makes_no_session(
    relay: RelayHandle, browser: Browser, prompt: str
) -> None:
    """The page refuses it; a script sending it got a turn and a session titled with nothing
    a person can see."""
    ack = await browser.call("submitWorkOrder", {"prompt": prompt})

    assert ack == {"ok": False, "error": EMPTY_PROMPT}
    assert await relay.relay.store.list_sessions(browser_owner(relay)) == []


async def test_a_new_sessions_title_is_its_prompts_first_line_that_shows(
    relay: RelayHandle, browser: Browser
) -> None:
    ack = await browser.call("submitWorkOrder", {"prompt": "\u200b\u200e\n  \nPlan the release"})

    assert ack["ok"] is True
    [session] = await relay.relay.store.list_sessions(browser_owner(relay))
    assert session.title == "Plan the release"


@pytest.mark.parametrize("event", ["submitWorkOrder", "renameSession", "listSessions"])
async def test_text_that_is_not_unicode_is_refused_in_words_a_person_reads(
    relay: RelayHandle, browser: Browser, event: str
) -> None:
    """A lone surrogate (JSON's "\\ud83d" with no pair) is no character: the answer says so,
    not what a codec inside the relay said."""
    half = "half an emoji \ud83d"
    payload = {"prompt": half, "sessionId": "s_1", "title": half, "query": half}
    keys = {"submitWorkOrder": ("prompt",), "renameSession": ("sessionId", "title")}

    ack = await browser.call(event, {k: payload[k] for k in keys.get(event, ("query",))})

    assert ack == {"ok": False, "error": NOT_UNICODE}
    assert await relay.relay.store.list_sessions(browser_owner(relay)) == []


@pytest.mark.parametrize("payload", ["nope", {"turnId": 7}, {"turnId": "a b"}, {"other": 1}])
async def test_malformed_abort_payloads_get_an_error_ack(
    relay: RelayHandle, browser: Browser, payload: Any
) -> None:
    answer = await browser.call("abortWorkOrder", payload)
    assert answer[0] is False and answer[1].startswith("Invalid payload")


@pytest.mark.parametrize("event", ["launchMissiles", "list_sessions", "ListSessions"])
async def test_an_unknown_browser_event_gets_an_error_ack(
    relay: RelayHandle, browser: Browser, event: str
) -> None:
    """Only the protocol's names: ``list_sessions`` and ``ListSessions`` were taken as
    ``listSessions``, so a client written against them would break on any other server."""
    assert await browser.call(event, {}) == {"ok": False, "error": f"Unknown event {event!r}."}


async def test_a_drone_cannot_report_on_a_turn_it_does_not_run(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer))
    ack = await browser.submit("Real work")
    await browser.wait_text(ack["turnId"], pieces=1)
    rogue = socketio.AsyncClient(reconnection=False)
    await rogue.connect(
        relay.url,
        namespaces=[DRONE_NAMESPACE],
        transports=["websocket"],
        auth=drone_hello("rogue-1"),
    )
    try:
        completion = await rogue.call(
            "workOrderComplete", (ack["turnId"], True, "done"), namespace=DRONE_NAMESPACE
        )
        progress = await rogue.call(
            "workOrderProgress",
            {"kind": "text", "turnId": ack["turnId"], "text": "injected"},
            namespace=DRONE_NAMESPACE,
        )
        unknown = await rogue.call(
            "workOrderComplete", ("t_nope", True, "done"), namespace=DRONE_NAMESPACE
        )
        malformed = await rogue.call(
            "workOrderProgress", {"kind": "bogus"}, namespace=DRONE_NAMESPACE
        )
        wrong_shape = await rogue.call(
            "workOrderComplete", (ack["turnId"], "yes", 3), namespace=DRONE_NAMESPACE
        )
    finally:
        await rogue.disconnect()

    assert completion == progress == unknown == {"ok": False, "error": UNKNOWN_TURN}
    assert malformed["ok"] is False and malformed["error"].startswith("Invalid payload")
    assert wrong_shape["ok"] is False and wrong_shape["error"].startswith("Invalid payload")
    assert "injected" not in browser.text(ack["turnId"])
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None and turn.status == "processing"


def browser_owner(relay: RelayHandle) -> str:
    sessions = next(iter(relay.relay.sio.namespace_handlers["/ide"].connections.values()))
    owner: str = sessions.owner
    return owner


async def test_a_model_services_long_error_ends_the_turn_cut_and_the_drone_goes_on(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Callable[..., Any],
    browser: Browser,
) -> None:
    """A service's error of 200,000 characters went into the turn's ending whole; the relay
    could not take it, and the turn stayed processing with the drone's next turns behind it.
    The drone sends 4,000 characters of it, saying how much more there was."""
    upstream.peer.script(
        Reply(status=400, error_message="Your request was bad. " + "x" * 200_000),
        Reply(chunks=["Fine ", "now."]),
    )
    await start_drone(upstream)
    ack = await browser.submit("Fail long")

    _, success, result = await browser.completion(ack["turnId"], timeout=20)

    assert success is False and "Your request was bad." in result
    assert len(result) < 4200 and result.endswith("more characters not shown]")
    assert (await browser.ending(ack["turnId"]))["reason"] == "model_failed"
    again = await browser.submit("Again", sessionId=ack["sessionId"])
    assert await browser.completion(again["turnId"], timeout=20) == (
        again["turnId"],
        True,
        "Fine now.",
    )


@pytest.mark.parametrize(
    "answer",
    [None, {"weird": 1}, (False, "nope"), (True, STOP_AFTER_STEP)],
    ids=["none", "an-object", "a-refusal-of-its-own", "stop-after-step-to-now"],
)
async def test_an_abort_a_drone_answers_with_no_answer_of_the_protocol_still_lands(
    relay: RelayHandle, browser: Browser, answer: Any
) -> None:
    """A drone's handler with a bug answered None: the person was told the abort failed, and
    the turn ran on (an interrupt sent behind it waited as long), to end 'finished'."""
    async with HandDrone(relay.url, "hand-1", abort_answer=answer) as drone:
        first = await browser.submit("Run on", droneId="hand-1")
        turn_id = await drone.next_order()

        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
        assert await browser.completion(turn_id, timeout=10) == (turn_id, True, "aborted")
        late = await drone.client.call(
            WORK_ORDER_COMPLETE, (turn_id, True, "late"), namespace=DRONE_NAMESPACE, timeout=10
        )
        assert late == {"ok": False, "error": "The turn has already ended."}

        after = await browser.submit("Next", sessionId=first["sessionId"], droneId="hand-1")
        assert await drone.next_order() == after["turnId"]
    ending = await browser.ending(turn_id)
    assert (ending["status"], ending["reason"]) == ("aborted", "unanswered")
    assert len(browser.completions(turn_id)) == 1


async def test_stop_after_this_step_a_drone_answers_by_stopping_now_ends_the_turn_aborted(
    relay: RelayHandle, browser: Browser
) -> None:
    """A drone that stops a turn at once when asked to stop after its step (a 'now' abort was
    under way, say) answers "Abort signaled": the relay neither kept that the person asked nor
    watched the turn, which stayed processing while its drone sent nothing more."""
    async with HandDrone(relay.url, "hand-1", abort_answer=(True, ABORT_SIGNALED)) as drone:
        await browser.submit("Run on", droneId="hand-1")
        turn_id = await drone.next_order()

        gentle = await browser.call("abortWorkOrder", {"turnId": turn_id, "mode": "after_step"})
        assert gentle == (True, ABORT_SIGNALED)

        assert await browser.completion(turn_id, timeout=relay.config.abort_grace + 5) == (
            turn_id,
            True,
            "aborted",
        )
    ending = await browser.ending(turn_id)
    assert (ending["status"], ending["reason"]) == ("aborted", "unanswered")
    assert ending["endedBy"].startswith("person-")


FORGED = "2026-11-28 12:00:00,000 INFO hangar.relay turn ended turn=t_forged status=finished"


async def test_a_tool_name_a_model_makes_up_cannot_forge_a_line_of_the_drones_log(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
    tmp_path: Path,
) -> None:
    """README ("Operating"): the logs are one line per event. A call's tool name is the model's
    to choose: one with a line break wrote a line of its own into the drone's log, and one with
    an escape sequence cleared the terminal of the person running the drone."""
    name = f"x\n{FORGED}\x1b[2J"
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall(name, {})]), Reply(chunks=["done"])
    )
    drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone process")
    turn_id = (await browser.submit("Call it"))["turnId"]
    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "done")

    said = f"tool refused turn={turn_id} tool={name!r}: There is no tool named"
    log = await eventually(
        lambda: said in (text := (tmp_path / "proc-drone-0.log").read_text()) and text,
        timeout=10,
        what="the drone's line",
    )
    assert not [line for line in log.splitlines() if line.startswith(FORGED)]
    assert "\x1b[2J" not in log
