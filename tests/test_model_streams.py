"""What a model service may stream, and how the drone's agent takes it: a model writing a long
tool call or reasoning is not silent, a sub-agent's stalled model is a failed tool, calls the
service streams without an index or with arguments it cannot read, and an answer the service
cut (docs/protocol.md, "Ordering and endings")."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.providers import ollama_provider, openai_provider
from hangar.drone.providers.base import CUT_AT_LENGTH, EMPTY_ANSWER, FILTERED, NO_REASON
from hangar.drone.providers.event_stream import ReplacingDecoder
from hangar.drone.service import AgentService
from hangar.shared.abort import AbortController
from hangar.shared.wire import MOST_TOKENS
from tests.conftest import Upstream
from tests.test_agent_service import Recorder, finished, order, tools_in
from tests.test_upstream_close import provider_for


def service_for(upstream: Upstream, tmp_path: Path, recorder: Recorder) -> AgentService:
    provider = provider_for(upstream.provider, upstream.peer.base_url)
    return AgentService(
        provider, recorder, root=AbortController().signal, tools=tools_in(tmp_path), stall=0.5
    )


async def test_a_model_writing_a_long_tool_call_or_reasoning_is_not_taken_for_stalled(
    upstream: Upstream, tmp_path: Path
) -> None:
    """Seven pieces of reasoning, then a call's arguments in eight, 0.2 s apart: 3 s without a
    word of text against a stall bound of 0.5 s."""
    note = {"path": "note.txt", "content": "written slowly " * 8}
    upstream.peer.script(
        Reply(
            chunks=[],
            thinking=["Let me", " think", " about", " where", " it", " goes", "."],
            tool_calls=[ScriptedToolCall("write_file", note)],
            tool_call_pieces=8,
            delay=0.2,
        ),
        Reply(chunks=["Written."]),
    )
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Write a note"))

    assert await finished(recorder) == ("t_1", True, "Written.")
    assert (tmp_path / "note.txt").read_text() == note["content"]
    assert recorder.endings[-1].reason == "finished"


async def test_a_sub_agent_whose_model_stalls_is_a_failed_tool_and_the_turn_goes_on(
    upstream: Upstream, tmp_path: Path
) -> None:
    upstream.peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": "Look"})]),
        Reply(chunks=["never"], stall_before=60),  # the sub-agent's model
        Reply(chunks=["The sub-agent got stuck, so I looked myself."]),
    )
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Delegate it"))

    # Stalled after the drone's bound (0.5 s here), not the default 120 s; the turn went on.
    turn_id, success, answer = await finished(recorder)
    assert (turn_id, success) == ("t_1", True) and answer.startswith("The sub-agent got stuck")
    result = [m.content for m in recorder.messages if m.role == "tool"]
    assert result == ["Error: The sub-agent stopped: its model service sent nothing for 0.5 s."]
    assert ("spawn_subagent", "error") in recorder.tools


async def test_an_answer_the_service_cut_at_its_length_limit_is_not_passed_off_as_whole(
    upstream: Upstream, tmp_path: Path
) -> None:
    upstream.peer.script(
        Reply(chunks=["The answer is"], finish="length"), Reply(chunks=["Shorter."])
    )
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Tell me everything"))

    assert await finished(recorder) == ("t_1", False, CUT_AT_LENGTH)
    assert recorder.endings[-1].reason == "model_failed"
    assert recorder.messages == []  # the relay keeps what streamed, flagged as cut

    service.accept(order("t_2", "Briefly, then"))
    assert await finished(recorder) == ("t_2", True, "Shorter.")


async def test_an_answer_the_services_filter_withheld_fails_and_its_call_does_not_run(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    write = ScriptedToolCall("write_file", {"path": "x.txt", "content": "x"})
    openai_peer.script(Reply(chunks=["Sure"], tool_calls=[write], finish="content_filter"))
    recorder = Recorder()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Write x"))

    assert await finished(recorder) == ("t_1", False, FILTERED)
    assert not (tmp_path / "x.txt").exists() and recorder.tools == []


async def test_calls_streamed_without_an_index_stay_apart_and_unreadable_arguments_go_back_empty(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """A service that leaves out each call piece's ``index``; then a model whose arguments are
    no JSON object: the service is sent ``{}`` for them with the next request (it may refuse
    a history with arguments it cannot read), though the history keeps what the model said."""
    (tmp_path / "a.txt").write_text("hello from a.txt")
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[ScriptedToolCall("read_file", {"path": "a.txt"}), ScriptedToolCall(
                "list_directory")],
            unindexed=True,
        ),
        Reply(chunks=[], tool_calls=[ScriptedToolCall("read_file", "{not json"), ScriptedToolCall(
            "list_directory", "[1, 2]")]),
        Reply(chunks=["Both read; two calls failed."], usage_twice=True),
    )  # fmt: skip
    recorder = Recorder()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Read a.txt and list"))

    assert await finished(recorder) == ("t_1", True, "Both read; two calls failed.")
    _, second, last = (r.messages for r in openai_peer.requests)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in second[1]["tool_calls"]]
    assert calls == [("read_file", '{"path": "a.txt"}'), ("list_directory", "{}")]
    assert [m["content"] for m in second[2:]] == ["hello from a.txt", "a.txt"]
    sent_back = [c["function"]["arguments"] for c in last[4]["tool_calls"]]
    assert sent_back == ["{}", "{}"]
    assert [m["content"][:6] for m in last[5:]] == ["Error:", "Error:"]
    kept = recorder.messages[3].tool_calls
    assert kept is not None and [c.arguments for c in kept] == ["{not json", "[1, 2]"]
    # The last answer's usage came twice (on its finishing chunk too): counted once.
    usage = recorder.endings[-1].usage
    sent = sum(max(request.chunks_sent, 1) for request in openai_peer.requests)
    assert usage is not None and usage.completion_tokens == sent


async def test_two_calls_a_service_gives_one_index_stay_two_and_object_arguments_are_read(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """A service that streamed two calls (each with its own id and name) at index 0: they were
    fused into one call ``read_filelist_directory`` with ``{"path": "a.txt"}{}``, the first call
    lost, and the model told its JSON was wrong. Then a service that sends a call's arguments
    as a JSON object, not a string: the drone kept ``{'path': 'a.txt'}`` (Python's text) and
    told the model "not valid JSON"."""
    (tmp_path / "a.txt").write_text("hello from a.txt")
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                ScriptedToolCall("read_file", {"path": "a.txt"}, "call_A"),
                ScriptedToolCall("list_directory", {}, "call_B"),
            ],
            index_of=[0, 0],
        ),
        Reply(
            chunks=[],
            tool_calls=[ScriptedToolCall("read_file", {"path": "a.txt"})],
            arguments_whole=True,
        ),
        Reply(chunks=["Read twice, listed once."]),
    )
    recorder = Recorder()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Read a.txt and list"))

    assert await finished(recorder) == ("t_1", True, "Read twice, listed once.")
    _, second, last = (r.messages for r in openai_peer.requests)
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in second[1]["tool_calls"]
    ]
    assert calls == [
        ("call_A", "read_file", '{"path": "a.txt"}'),
        ("call_B", "list_directory", "{}"),
    ]
    assert [m["content"] for m in second[2:]] == ["hello from a.txt", "a.txt"]
    assert json.loads(last[4]["tool_calls"][0]["function"]["arguments"]) == {"path": "a.txt"}
    assert last[5]["content"] == "hello from a.txt"
    assert openai_peer.requests[-1].rejected is None


async def test_bytes_an_openai_service_streams_that_are_no_utf8_are_read_as_u_fffd(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """A byte no UTF-8 has (a lone 0xff, a character cut short) in a chunk's text failed the
    turn as an unreadable chunk. It is read as U+FFFD (as the Ollama SDK reads it) and the turn
    goes on.
    Each piece's line comes in two writes cut in its middle: a character split between them
    (the euro sign, the smiley) stays whole."""
    raw = [b"\xe2\x82\xac", b" and \xff", b" then \xe2\x82", b"\xf0\x9f\x98\x80 again."]
    openai_peer.script(Reply(chunks=["Price: "], raw_content=raw))
    recorder = Recorder()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Say it"))

    answer = "Price: \u20ac and \ufffd then \ufffd\U0001f600 again."
    assert await finished(recorder) == ("t_1", True, answer)
    assert recorder.endings[-1].reason == "finished"


async def test_a_character_split_between_any_two_reads_of_an_event_stream_stays_whole() -> None:
    """The stream's bytes cut at every place in two reads: the same events every time."""
    body = 'data: "\u20ac\U0001f600"\n\n'.encode() + b'data: "\xff \xe2\x82"\n\ndata: \xf0\x9f\n\n'
    said = ['"\u20ac\U0001f600"', '"\ufffd \ufffd"', "\ufffd"]

    async def reads(parts: list[bytes]) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    for cut in range(len(body) + 1):
        parts = [body[:cut], body[cut:]]
        assert [e.data async for e in ReplacingDecoder().aiter_bytes(reads(parts))] == said
        assert [e.data for e in ReplacingDecoder().iter_bytes(iter(parts))] == said


async def test_an_empty_answer_fails_the_turn_instead_of_passing_for_one(
    upstream: Upstream, tmp_path: Path
) -> None:
    """A model that only reasons, or says nothing: no empty message in the history, which some
    services refuse, and no "Done." over an empty answer."""
    upstream.peer.script(Reply(chunks=[], thinking=["Hmm."]), Reply(chunks=[" \n"]))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    for turn_id in ("t_1", "t_2"):
        service.accept(order(turn_id, "Well?"))
        assert await finished(recorder) == (turn_id, False, EMPTY_ANSWER)
        assert recorder.endings[-1].reason == "model_failed"
    assert recorder.messages == []


COUNTS = [(-1, 5), (2**63, 5), (10**30, 5)]
"""Counts no service could mean: negative, beyond what a turn's count holds."""


async def counted(upstream: Upstream, tmp_path: Path, counts: tuple[Any, Any]) -> None:
    """A count no service could mean failed the answer, or was sent on to the relay, which
    could not store it and left the turn processing: it is no count, and the call's usage is
    estimated (docs/protocol.md, ``usage``)."""
    upstream.peer.script(Reply(chunks=["All ", "done."], counts=counts))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Count"))

    assert await finished(recorder) == ("t_1", True, "All done.")
    usage = recorder.endings[-1].usage
    assert usage is not None and usage.estimated
    assert 0 <= usage.prompt_tokens <= MOST_TOKENS and 0 <= usage.completion_tokens <= MOST_TOKENS


@pytest.mark.parametrize("counts", COUNTS, ids=repr)
async def test_token_counts_no_service_could_mean_are_estimated_and_the_answer_stands(
    upstream: Upstream, tmp_path: Path, counts: tuple[Any, Any]
) -> None:
    await counted(upstream, tmp_path, counts)


@pytest.mark.parametrize("counts", [(1.5, 2), ("many", 2), (True, 2)], ids=repr)
async def test_token_counts_that_are_not_whole_numbers_are_estimated_through_openai(
    openai_peer: OpenAIPeer, tmp_path: Path, counts: tuple[Any, Any]
) -> None:
    """(The Ollama SDK refuses such a count itself, as an answer it cannot read.)"""
    await counted(Upstream("openai", openai_peer), tmp_path, counts)


async def test_an_answer_is_whole_at_its_end_though_the_stream_stays_open(
    upstream: Upstream, tmp_path: Path
) -> None:
    """The drone read on after Ollama's ``"done": true``, or after OpenAI's finish reason and
    usage when no ``[DONE]`` came, and the whole answer ended as stalled."""
    upstream.peer.script(Reply(chunks=["All ", "done."], linger=30.0))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Answer"))

    assert await finished(recorder) == ("t_1", True, "All done.")
    assert recorder.endings[-1].reason == "finished"


PAGE = (
    "<html><head><title>404 Not Found</title><style>body { color: red }</style></head>"
    "<body><h1>404 Not Found</h1><hr>nginx</body></html>"
)
ERROR_BODIES = [
    (("text/html", PAGE), "404 Not Found 404 Not Found nginx"),
    (("application/json", ""), NO_REASON),
    (("text/plain", "line one\nline two\x00\x1b[31m"), "line one line two [31m"),
]
"""Error bodies a model service (or a proxy before it) may answer with, and what a person
reads of them: the page's words, one line, no control character."""


@pytest.mark.parametrize(("body", "said"), ERROR_BODIES, ids=["html", "empty", "control"])
async def test_a_model_services_error_is_told_in_its_own_words_on_one_line(
    upstream: Upstream, tmp_path: Path, body: tuple[str, str], said: str
) -> None:
    """An HTML page was shown raw (Ollama) or lost for the SDK's "Error code: 404" (OpenAI); an
    empty body said nothing after its colon; newlines and escapes went into the drone's log."""
    upstream.peer.script(Reply(status=404, error_body=body))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Fail"))

    _, success, message = await finished(recorder)

    server = "The model service" if upstream.provider == "openai" else "The Ollama server"
    assert (success, message) == (False, f"{server} answered 404: {said}")


async def test_an_error_nested_past_any_depth_is_told_as_text(
    upstream: Upstream, tmp_path: Path
) -> None:
    """Reading it as JSON ran the drone out of stack: the turn failed as the drone's own
    failure, with a traceback in its log, and not in the service's words."""
    nested = "[" * 5_000 + "]" * 5_000
    upstream.peer.script(Reply(status=400, error_body=("application/json", nested)))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Fail"))

    _, success, message = await finished(recorder)

    server = "The model service" if upstream.provider == "openai" else "The Ollama server"
    assert success is False
    assert message.startswith(f"{server} answered 400: [[[["), message[:200]


async def test_a_line_nested_past_any_depth_in_the_stream_is_told_as_unreadable(
    upstream: Upstream, tmp_path: Path
) -> None:
    upstream.peer.script(Reply(chunks=["Partial "], garbage="[" * 5_000 + "]" * 5_000))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Fail"))

    _, success, message = await finished(recorder)

    module = openai_provider if upstream.provider == "openai" else ollama_provider
    assert (success, message) == (False, module.UNREADABLE)


@pytest.mark.parametrize(
    "line",
    [
        '{"error": "Input validation error: too long"}',
        '{"error": {"message": "Input validation error: too long", "code": 400}}',
        '{"object": "error", "message": "Input validation error: too long", "code": 400}',
    ],
    ids=["a string", "an object", "vLLM's"],
)
async def test_an_error_an_openai_service_sends_in_its_stream_is_told_in_its_words(
    openai_peer: OpenAIPeer, tmp_path: Path, line: str
) -> None:
    """The SDK says "An error occurred during streaming" for an error that is a string; an
    error chunk of vLLM's shape was taken for an empty chunk ("stream ended before its answer
    did")."""
    openai_peer.script(Reply(chunks=["Partial "], garbage=line, cut_short=True))
    recorder = Recorder()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Fail"))

    assert await finished(recorder) == (
        "t_1",
        False,
        "The model service reported an error: Input validation error: too long",
    )


async def test_an_error_that_is_a_json_string_is_told_in_its_words(
    upstream: Upstream, tmp_path: Path
) -> None:
    """The Ollama SDK reads a JSON body as an object: a string said "The Ollama server sent a
    line that is not a chat response"."""
    upstream.peer.script(Reply(status=404, error_body=("application/json", '"overloaded"')))
    recorder = Recorder()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Fail"))

    server = "The model service" if upstream.provider == "openai" else "The Ollama server"
    assert await finished(recorder) == ("t_1", False, f"{server} answered 404: overloaded")
