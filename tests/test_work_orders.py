"""Work orders through a real relay and a real drone, streaming from a local upstream peer.

Each test is run once per provider (openai SDK against an SSE peer, ollama SDK against an
NDJSON peer) where the ``upstream`` fixture is used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from bench.peers import OllamaPeer, OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.agent import MAX_STEPS
from hangar.server.store import TurnRecord
from hangar.shared.protocol import ABORT_SIGNALED, NO_ACTIVE_WORK_ORDER
from tests.conftest import Browser, RelayHandle, Upstream, eventually

SLOW = Reply(chunks=[f"word{i} " for i in range(200)], delay=0.03)


async def stored(relay: RelayHandle, turn_id: str) -> TurnRecord:
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None
    return turn


async def test_work_order_streams_to_completion(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["The ", "answer ", "is ", "42."], delay=0.01))
    await start_drone(upstream)

    ack = await browser.submit("What is the answer?")
    assert ack["ok"] is True
    turn_id = ack["turnId"]
    _, success, message = await browser.completion(turn_id)

    assert success is True and message == "The answer is 42."
    assert browser.text(turn_id) == "The answer is 42."
    turn = await stored(relay, turn_id)
    assert turn.status == "finished"
    assert turn.text == "The answer is 42."
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "What is the answer?"),
        ("assistant", "The answer is 42."),
    ]
    assert upstream.peer.last is not None and upstream.peer.last.completed


async def test_chunks_apart_in_time_reach_the_browser_one_by_one(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["The ", "answer ", "is ", "42."], delay=0.2))
    await start_drone(upstream)
    turn_id = (await browser.submit("What is the answer?"))["turnId"]
    await browser.completion(turn_id)

    assert [p["text"] for p in browser.progress(turn_id)] == ["The ", "answer ", "is ", "42."]


async def test_a_fast_stream_is_coalesced_into_fewer_deltas_in_order(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    chunks = [f"t{i} " for i in range(400)]
    upstream.peer.script(Reply(chunks=chunks, delay=0.001))
    await start_drone(upstream)
    turn_id = (await browser.submit("Count fast"))["turnId"]
    _, success, _ = await browser.completion(turn_id)

    assert success is True
    deltas = browser.progress(turn_id)
    assert "".join(p["text"] for p in deltas) == "".join(chunks)
    assert len(deltas) < len(chunks) / 4, f"{len(deltas)} deltas for {len(chunks)} chunks"
    assert [p["seq"] for p in deltas] == list(range(1, len(deltas) + 1))
    # Every delta is relayed before the finished message that holds the same text.
    kinds = [
        args["kind"]
        for event, args in browser.events
        if event == "workOrderProgress" and args["turnId"] == turn_id
    ]
    assert kinds == ["text"] * len(deltas) + ["message"]


async def test_abort_mid_stream_closes_upstream_and_keeps_partial_text(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(SLOW)
    await start_drone(upstream)
    turn_id = (await browser.submit("Write a long essay"))["turnId"]
    await browser.wait_text(turn_id, pieces=3)

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")

    assert browser.order_of(turn_id) == ["abortAck", "workOrderComplete"]
    await upstream.peer.wait_for_disconnect()
    assert not upstream.peer.last.completed  # type: ignore[union-attr]
    assert len(upstream.peer.requests) == 1, "an aborted request must not be retried"
    turn = await stored(relay, turn_id)
    assert turn.status == "aborted" and turn.result == "aborted"
    assert turn.text and SLOW.text.startswith(turn.text) and turn.text != SLOW.text
    assert turn.messages[-1].role == "assistant" and turn.messages[-1].aborted is True
    assert turn.messages[-1].content == turn.text


async def test_abort_during_stall_before_first_chunk_closes_upstream_at_once(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["never"], stall_before=60))
    await start_drone(upstream)
    turn_id = (await browser.submit("Think hard"))["turnId"]
    await upstream.peer.wait_for_requests(1)

    aborted_at = time.monotonic()
    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    disconnected_at = await upstream.peer.wait_for_disconnect(timeout=5)

    assert disconnected_at - aborted_at < 2.0, "the stall must not hold the abort"
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    turn = await stored(relay, turn_id)
    assert turn.status == "aborted"
    assert [m.role for m in turn.messages] == ["user"]


async def test_abort_during_stall_mid_stream_closes_upstream_at_once(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["Half ", "an ", "answer"], stall_after=(2, 60)))
    await start_drone(upstream)
    turn_id = (await browser.submit("Answer slowly"))["turnId"]
    await browser.wait_text(turn_id, pieces=2)

    aborted_at = time.monotonic()
    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    disconnected_at = await upstream.peer.wait_for_disconnect(timeout=5)

    assert disconnected_at - aborted_at < 2.0
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    turn = await stored(relay, turn_id)
    assert turn.status == "aborted" and turn.text == "Half an "
    assert turn.messages[-1].content == "Half an " and turn.messages[-1].aborted


async def test_abort_with_nothing_running_is_refused(
    relay: RelayHandle, openai_peer: Any, start_drone: Callable[..., Any], browser: Browser
) -> None:
    await start_drone(Upstream("openai", openai_peer))
    assert await browser.abort() == (False, NO_ACTIVE_WORK_ORDER)


async def test_abort_after_the_turn_finished_changes_nothing(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    await start_drone(upstream)
    turn_id = (await browser.submit("Say hello"))["turnId"]
    assert (await browser.completion(turn_id))[1:] == (True, "Hello world")

    assert await browser.abort(turn_id) == (False, NO_ACTIVE_WORK_ORDER)

    assert (await stored(relay, turn_id)).status == "finished"
    await _next_turn_finishes(browser, turn_id)
    assert len(browser.completions(turn_id)) == 1


async def test_abort_twice_is_idempotent_and_ends_the_turn_once(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(SLOW)
    await start_drone(upstream)
    turn_id = (await browser.submit("Go on and on"))["turnId"]
    await browser.wait_text(turn_id, pieces=2)

    first, second = await asyncio.gather(browser.abort(turn_id), browser.abort(turn_id))

    assert first == (True, ABORT_SIGNALED)
    assert second in ((True, ABORT_SIGNALED), (False, NO_ACTIVE_WORK_ORDER))
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    assert await browser.abort(turn_id) == (False, NO_ACTIVE_WORK_ORDER)
    await _next_turn_finishes(browser, turn_id)
    assert len(browser.completions(turn_id)) == 1
    assert (await stored(relay, turn_id)).status == "aborted"


async def test_next_work_order_after_an_abort_sends_a_valid_history(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(SLOW, Reply(chunks=["Sure, ", "a short one."]))
    await start_drone(upstream)
    first = await browser.submit("Write a long essay")
    await browser.wait_text(first["turnId"], pieces=3)
    await browser.abort(first["turnId"])
    await browser.completion(first["turnId"])
    partial = (await stored(relay, first["turnId"])).text

    second = await browser.submit("Shorter, please", sessionId=first["sessionId"])
    assert await browser.completion(second["turnId"]) == (
        second["turnId"],
        True,
        "Sure, a short one.",
    )

    sent = upstream.peer.requests[-1].messages
    assert [(m["role"], m["content"]) for m in sent] == [
        ("user", "Write a long essay"),
        ("assistant", partial),
        ("user", "Shorter, please"),
    ]
    assert upstream.peer.requests[-1].rejected is None
    assert (await stored(relay, second["turnId"])).status == "finished"


async def test_prompts_no_answer_followed_reach_the_model_with_the_next_one_as_one_message(
    relay: RelayHandle, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """A turn aborted, or failed, before the model said anything keeps only its prompt
    (docs/architecture.md). Chat templates such as Mistral's and Gemma's, on vLLM or llama.cpp,
    refuse two user messages in a row: every later turn of the session failed there."""
    async with OpenAIPeer(alternating=True) as peer:
        peer.script(
            Reply(chunks=["never"], stall_before=60),
            Reply(status=500, error_message="model exploded"),
            Reply(chunks=["Both ", "done."]),
            Reply(chunks=["Fine."]),
        )
        await start_drone(Upstream("openai", peer), max_retries=0)
        first = await browser.submit("Write a long essay")
        await eventually(lambda: peer.requests, timeout=10, what="the first request")
        await browser.abort(first["turnId"])
        assert await browser.completion(first["turnId"]) == (first["turnId"], True, "aborted")
        session = {"sessionId": first["sessionId"]}
        second = await browser.submit("And a poem", **session)
        assert (await browser.completion(second["turnId"]))[1] is False

        third = await browser.submit("And a poem", **session)  # Retry
        assert await browser.completion(third["turnId"]) == (third["turnId"], True, "Both done.")
        fourth = await browser.submit("Thanks", **session)
        assert await browser.completion(fourth["turnId"]) == (fourth["turnId"], True, "Fine.")

    merged = "Write a long essay\n\nAnd a poem"  # the prompt sent again, once
    assert [[(m["role"], m["content"]) for m in r.messages] for r in peer.requests[2:]] == [
        [("user", merged)],
        [("user", merged), ("assistant", "Both done."), ("user", "Thanks")],
    ]
    assert [r.rejected for r in peer.requests] == [None, None, None, None]
    assert [m.role for m in (await stored(relay, first["turnId"])).messages] == ["user"]


async def test_an_upstream_error_ends_the_turn_in_error_with_a_reason(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(*[Reply(status=500, error_message="model exploded")] * 3)
    await start_drone(upstream, max_retries=0)
    turn_id = (await browser.submit("Hello"))["turnId"]

    _, success, message = await browser.completion(turn_id)

    assert success is False
    assert "500" in message and "model exploded" in message
    turn = await stored(relay, turn_id)
    assert (turn.status, turn.reason) == ("error", "model_failed")
    assert (await browser.ending(turn_id))["reason"] == "model_failed"


async def test_a_chunk_that_is_not_the_apis_ends_the_turn_as_the_model_services_failure(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
) -> None:
    openai_peer.script(Reply(chunks=["Partial "], garbage="[1, 2]"), Reply(chunks=["Fine."]))
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("Hello")

    assert await browser.completion(first["turnId"]) == (
        first["turnId"],
        False,
        "The model service sent a chunk that is not a chat completion chunk.",
    )
    turn = await stored(relay, first["turnId"])
    assert (turn.status, turn.reason, turn.text) == ("error", "model_failed", "Partial ")
    assert not [r for r in caplog.records if r.exc_info], "no traceback for what a service sent"
    second = await browser.submit("Again", sessionId=first["sessionId"])
    assert await browser.completion(second["turnId"]) == (second["turnId"], True, "Fine.")
    assert openai_peer.requests[-1].rejected is None


UNREADABLE = {
    "openai": "The model service sent a chunk that is not a chat completion chunk.",
    "ollama": "The Ollama server sent a line that is not a chat response.",
}
ENDED_EARLY = "The model service's stream ended before its answer did."


@pytest.mark.parametrize(
    ("sent", "garbage"),
    [
        ("broken JSON", '{"choices": [{"delta": {"content": "x"'),
        ("null", "null"),
        ("a blank line", ""),  # for OpenAI's SSE, an empty chunk: not JSON either
        ("another shape", '{"choices": 5, "message": 5}'),
    ],
)
async def test_a_line_the_sdk_cannot_read_ends_the_turn_as_the_model_services_failure(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Callable[..., Any],
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
    sent: str,
    garbage: str,
) -> None:
    """What a service sends is never the drone's failure, nor a traceback in its log."""
    upstream.peer.script(Reply(chunks=["Partial "], garbage=garbage), Reply(chunks=["Fine."]))
    await start_drone(upstream)
    first = await browser.submit("Hello")

    assert await browser.completion(first["turnId"]) == (
        first["turnId"],
        False,
        UNREADABLE[upstream.provider],
    )
    turn = await stored(relay, first["turnId"])
    assert (turn.status, turn.reason, turn.text) == ("error", "model_failed", "Partial ")
    assert not [r for r in caplog.records if r.exc_info], "no traceback for what a service sent"
    second = await browser.submit("Again", sessionId=first["sessionId"])
    assert await browser.completion(second["turnId"]) == (second["turnId"], True, "Fine.")


async def test_a_stream_cut_short_ends_the_turn_in_error_not_as_a_whole_answer(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["The first ", "half"], cut_short=True))
    await start_drone(upstream)
    ack = await browser.submit("Hello")

    assert await browser.completion(ack["turnId"]) == (ack["turnId"], False, ENDED_EARLY)
    turn = await stored(relay, ack["turnId"])
    assert (turn.status, turn.reason, turn.text) == ("error", "model_failed", "The first half")


async def test_a_connection_dropped_mid_answer_says_it_broke_not_that_it_was_unreachable(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["Cut ", "off"], drop=True), Reply(chunks=["Fine."]))
    await start_drone(upstream)
    first = await browser.submit("Hello")

    assert await browser.completion(first["turnId"]) == (
        first["turnId"],
        False,
        "The connection to the model service broke in the middle of its answer.",
    )
    turn = await stored(relay, first["turnId"])
    assert (turn.status, turn.reason, turn.text) == ("error", "model_failed", "Cut off")
    second = await browser.submit("Again", sessionId=first["sessionId"])
    assert await browser.completion(second["turnId"]) == (second["turnId"], True, "Fine.")


async def test_an_error_the_ollama_server_sends_in_its_stream_is_shown_without_a_status(
    relay: RelayHandle, start_drone: Callable[..., Any], browser: Browser
) -> None:
    async with OllamaPeer() as peer:
        peer.script(Reply(chunks=["Partial "], garbage='{"error": "unexpected EOF"}'))
        await start_drone(Upstream("ollama", peer))
        ack = await browser.submit("Hello")

        assert await browser.completion(ack["turnId"]) == (
            ack["turnId"],
            False,
            "The Ollama server reported an error: unexpected EOF",
        )


async def _next_turn_finishes(browser: Browser, previous_turn_id: str) -> None:
    """Submit another work order in a new session and wait for it: any duplicate completion of
    ``previous_turn_id`` sent before it would have arrived by then (events keep their order)."""
    ack = await browser.submit("One more")
    _, success, _ = await browser.completion(ack["turnId"])
    assert success is True


async def test_a_snapshot_mid_stream_plus_later_deltas_rebuilds_the_text_exactly(
    relay: RelayHandle, openai_peer: Any, start_drone: Callable[..., Any], browsers: Any
) -> None:
    openai_peer.script(Reply(chunks=[f"c{i} " for i in range(400)], delay=0.002))
    await start_drone(Upstream("openai", openai_peer))
    writer: Browser = await browsers("snapshot-person")
    ack = await writer.submit("Stream fast")
    await writer.wait_text(ack["turnId"], pieces=20)
    readers: list[tuple[Browser, dict[str, Any]]] = []
    for _ in range(5):
        reader: Browser = await browsers("snapshot-person")
        opened = await reader.call("openSession", {"sessionId": ack["sessionId"]})
        readers.append((reader, opened["turns"][0]))

    await writer.completion(ack["turnId"])
    stored_text = (await stored(relay, ack["turnId"])).text
    for reader, snapshot in readers:
        await reader.completion(ack["turnId"])
        later = [p for p in reader.progress(ack["turnId"]) if p["seq"] > snapshot["textSeq"]]
        assert snapshot["text"] + "".join(p["text"] for p in later) == stored_text


async def test_simultaneous_submits_spread_over_idle_drones(
    relay: RelayHandle, openai_peer: Any, start_drone: Callable[..., Any], browsers: Any
) -> None:
    openai_peer.default = SLOW
    first = await start_drone(Upstream("openai", openai_peer), concurrency=3)
    second = await start_drone(Upstream("openai", openai_peer), concurrency=3)
    people: list[Browser] = [await browsers() for _ in range(6)]

    acks = await asyncio.gather(*(person.submit("All at once") for person in people))

    turns = [await stored(relay, ack["turnId"]) for ack in acks]
    assert all(turn.status == "processing" for turn in turns), [t.result for t in turns]
    assert sorted(t.drone_id or "" for t in turns) == sorted(
        [first.drone_id] * 3 + [second.drone_id] * 3
    )


async def test_every_tool_call_of_a_turn_has_its_own_id_when_the_model_repeats_one(
    relay: RelayHandle, upstream: Upstream, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """Ollama numbers each request's calls from ``call_1`` (some OpenAI-compatible services do
    too): a turn's ``spawn_subagent`` and its sub-agent's first call were both ``call_1``, and a
    page drew the sub-agent's call over the call that started it."""
    upstream.peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": "a"}, "call_1")]),
        Reply(chunks=[], tool_calls=[ScriptedToolCall("list_directory", {}, "call_1")]),
        Reply(chunks=["Nothing much."]),
        Reply(chunks=["Done."]),
    )
    await start_drone(upstream)
    turn_id = (await browser.submit("Delegate a look"))["turnId"]

    assert (await browser.completion(turn_id))[1:] == (True, "Done.")
    ids = {(p["depth"], p["name"]): p["callId"] for p in browser.progress(turn_id, "tool")}
    assert ids.keys() == {(0, "spawn_subagent"), (1, "list_directory")}
    assert len(set(ids.values())) == 2
    call, result = (await stored(relay, turn_id)).messages[1:3]
    assert call.tool_calls is not None and call.tool_calls[0].id == ids[(0, "spawn_subagent")]
    assert result.tool_call_id == ids[(0, "spawn_subagent")] and result.content == "Nothing much."


async def test_calls_the_drone_cannot_take_as_they_are_get_error_results_and_the_turn_goes_on(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """A model's call with arguments nested past any depth, with no name, with a name longer
    than any tool's, or with an id that is no id: each gets an error result the model reads,
    and the turn goes on, as for any tool that fails. Before, the first killed the drone's
    worker (and every turn on it) and the others failed the turn as the drone's failure. A name
    OpenAI never takes (``functions.read_file``, or past 64 characters) was then sent back as
    the model wrote it: the service refused the history with 400, and every later turn of the
    session failed so."""
    nested = '{"path": ' + "[" * 100_000 + "]" * 100_000 + "}"
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                ScriptedToolCall("read_file", nested),
                ScriptedToolCall("", {}),
                ScriptedToolCall("x" * 300, {}),
                ScriptedToolCall("list_directory", {}, "not an id! " * 20),
                ScriptedToolCall("functions.read_file", {"path": "a.txt"}),
            ],
        ),
        Reply(chunks=["Some of those failed."]),
        Reply(chunks=["Still here."]),
    )
    await start_drone(Upstream("openai", openai_peer))
    turn_id = (await browser.submit("Call odd tools"))["turnId"]

    assert (await browser.completion(turn_id, timeout=20))[1:] == (True, "Some of those failed.")
    messages = (await stored(relay, turn_id)).messages
    calls = messages[1].tool_calls or []
    results = {m.tool_call_id: m.content for m in messages[2:7]}
    names = ["read_file", "unnamed", "x" * 128, "list_directory", "functions.read_file"]
    assert [c.name for c in calls] == names  # as the model wrote them, for the page
    assert len({c.id for c in calls}) == 5 and set(results) == {c.id for c in calls}
    assert "nested too deeply" in results[calls[0].id]
    assert all("There is no tool named" in results[c.id] for c in [*calls[1:3], calls[4]])
    assert "'functions.read_file'" in results[calls[4].id]
    assert not results[calls[3].id].startswith("Error")
    sent_back = openai_peer.requests[-1]
    assert sent_back.rejected is None  # the history the service got is a valid one
    sent_names = [c["function"]["name"] for c in sent_back.messages[1]["tool_calls"]]
    assert sent_names == ["read_file", "unnamed", "x" * 64, "list_directory", "functions_read_file"]
    session_id = (await stored(relay, turn_id)).session_id
    again = (await browser.submit("And now?", sessionId=session_id))["turnId"]
    assert (await browser.completion(again, timeout=20))[1:] == (True, "Still here.")


async def then_on_ollama(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    call: ScriptedToolCall,
) -> tuple[TurnRecord, list[dict[str, Any]]]:
    """A turn on an OpenAI drone whose model makes ``call`` and then says "That failed.", and
    the session's next turn on an Ollama drone, which must finish: the first turn as stored,
    and the messages the Ollama server was sent."""
    openai_peer.script(Reply(chunks=[], tool_calls=[call]), Reply(chunks=["That failed."]))
    first_drone = await start_drone(Upstream("openai", openai_peer))
    async with OllamaPeer() as peer:
        peer.script(Reply(chunks=["Going on."]))
        second_drone = await start_drone(Upstream("ollama", peer))
        first = await browser.submit("Call it", droneId=first_drone.drone_id)
        assert (await browser.completion(first["turnId"], timeout=20))[1:] == (True, "That failed.")
        second = await browser.submit(
            "And now?", sessionId=first["sessionId"], droneId=second_drone.drone_id
        )
        assert (await browser.completion(second["turnId"]))[1:] == (True, "Going on.")
        sent: list[dict[str, Any]] = peer.requests[-1].messages
    stored = await relay.relay.store.get_turn(first["turnId"])
    assert stored is not None
    return stored, sent


async def test_a_session_with_a_call_nested_past_any_depth_goes_on_through_ollama(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """The call's arguments, sent back to an Ollama server as the history's object, ran the
    drone out of stack: every later turn of the session failed on every Ollama drone ("The
    drone failed: maximum recursion depth exceeded..."), and the model was never asked."""
    nested = '{"path": ' + "[" * 5_000 + "]" * 5_000 + "}"

    call = ScriptedToolCall("read_file", nested)

    _, sent = await then_on_ollama(relay, openai_peer, start_drone, browser, call)

    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "user"]
    assert sent[1]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": {}}


async def test_a_call_with_nan_or_infinity_in_its_arguments_does_not_break_the_session(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """``NaN`` and ``Infinity`` are not JSON, but Python reads them: the call ran, and its
    arguments went back to the model service with them, which an Ollama server (Go's JSON)
    refuses, failing every later turn of the session on every Ollama drone."""
    call = ScriptedToolCall("run_shell", '{"command": "echo ran", "n": NaN}')

    turn, sent = await then_on_ollama(relay, openai_peer, start_drone, browser, call)

    assert turn.messages[2].content == "Error: The arguments are not valid JSON: NaN is not JSON."
    assert sent[1]["tool_calls"][0]["function"] == {"name": "run_shell", "arguments": {}}
    assert openai_peer.requests[-1].messages[1]["tool_calls"][0]["function"]["arguments"] == "{}"


async def test_a_call_whose_text_holds_half_a_surrogate_pair_gets_a_clear_result(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """JSON may escape half of a surrogate pair (``"\\ud800"``), which no file name or command
    can hold: the model got Python's own words ("'utf-8' codec can't encode character...")."""
    half = '"\\ud800"'
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                ScriptedToolCall("read_file", f'{{"path": {half}}}'),
                ScriptedToolCall("list_directory", f'{{"path": {half}}}'),
                ScriptedToolCall("write_file", f'{{"path": {half}, "content": "x"}}'),
                ScriptedToolCall("run_shell", f'{{"command": "echo {half[1:-1]}"}}'),
            ],
        ),
        Reply(chunks=["Told."]),
    )
    await start_drone(Upstream("openai", openai_peer))
    turn_id = (await browser.submit("Odd names"))["turnId"]

    assert (await browser.completion(turn_id, timeout=20))[1:] == (True, "Told.")
    results = [m.content for m in (await stored(relay, turn_id)).messages[2:6]]
    assert results == [
        f"Error: The argument {key!r} is not valid Unicode (it holds half of a surrogate pair)."
        for key in ("path", "path", "path", "command")
    ]


async def test_a_model_that_never_stops_calling_tools_ends_the_turn_as_its_failure(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After 25 model calls without a final answer the turn ends, as the model's failure (not
    the drone's, with a traceback), and its history stays valid: every call has its result."""
    looping = Reply(chunks=[], tool_calls=[ScriptedToolCall("list_directory", {})])
    openai_peer.script(*[looping] * (MAX_STEPS + 1))
    await start_drone(Upstream("openai", openai_peer))
    turn_id = (await browser.submit("Look around forever"))["turnId"]

    limit = f"Stopped after {MAX_STEPS} model calls without a final answer."
    assert await browser.completion(turn_id, timeout=30) == (turn_id, False, limit)
    assert (await browser.ending(turn_id))["reason"] == "model_failed"
    turn = await stored(relay, turn_id)
    calls = [c.id for m in turn.messages for c in m.tool_calls or []]
    answered = [m.tool_call_id for m in turn.messages if m.role == "tool"]
    assert len(calls) == MAX_STEPS and answered == calls
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_tool_call_with_megabytes_of_arguments_does_not_put_the_page_behind(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """The call's message went to browsers whole (2.5 MB, past what a browser may have queued),
    and every page open on the session was told to resync, losing its live events. Browsers get
    it cut (the page shows neither its text nor its arguments); the store keeps it whole."""
    content = "y" * 2_500_000
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[ScriptedToolCall("write_file", {"path": "big.txt", "content": content})],
        ),
        Reply(chunks=["Written."]),
    )
    await start_drone(Upstream("openai", openai_peer))
    turn_id = (await browser.submit("Write a big file"))["turnId"]

    assert (await browser.completion(turn_id, timeout=20))[1:] == (True, "Written.")
    assert [e for e, _ in browser.events if e == "resync"] == []
    assert [p["state"] for p in browser.progress(turn_id, "tool")] == ["start", "end"]
    [shown] = [p for p in browser.progress(turn_id, "message") if p["message"].get("toolCalls")]
    assert len(shown["message"]["toolCalls"][0]["arguments"]) < 100_000
    stored_call = (await stored(relay, turn_id)).messages[1].tool_calls
    assert stored_call is not None and len(stored_call[0].arguments) > len(content)
