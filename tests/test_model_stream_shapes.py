"""Streams of shapes a model service may send besides the usual one: several choices, an
emoji's UTF-16 halves in two chunks, an answer that ends with ``[DONE]`` but no finish reason
(docs/protocol.md, "Ordering and endings"); and the drone's log line as it tries a request
again."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.providers.base import ENDED_EARLY
from hangar.drone.service import AgentService
from hangar.shared.abort import AbortController
from tests.conftest import Upstream
from tests.test_agent_service import Recorder, finished, order, tools_in
from tests.test_upstream_close import provider_for


class Shown(Recorder):
    """A recorder that keeps the text streamed to the relay too (what a person is shown)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[str] = []
        self.streaming = asyncio.Event()

    async def text(self, text: str, depth: int, chunks: int = 1) -> None:
        self.shown.append(text)
        self.streaming.set()


def service_for(upstream: Upstream, tmp_path: Path, recorder: Recorder) -> AgentService:
    provider = provider_for(upstream.provider, upstream.peer.base_url)
    return AgentService(
        provider, recorder, root=AbortController().signal, tools=tools_in(tmp_path), stall=5.0
    )


def chunk(*choices: dict[str, Any], usage: dict[str, int] | None = None) -> str:
    """One chunk of the stream, as OpenAI's JSON."""
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": "gpt-test",
            "choices": list(choices),
            "usage": usage,
        }
    )


def choice(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


USAGE = chunk(usage={"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14})


async def test_only_the_first_choice_of_a_stream_with_several_is_read(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """Two choices interleaved: their text was merged ("Alpha Beta one.two."), and the second's
    ``length`` failed the turn. The drone asks for one choice: the others are not its answer,
    neither their text, nor their calls, nor how they ended."""
    write = {"name": "write_file", "arguments": '{"path": "x.txt", "content": "x"}'}
    openai_peer.script(
        Reply(
            events=[
                chunk(choice(0, {"role": "assistant", "content": "Alpha "}), choice(1, {
                    "role": "assistant", "content": "Beta "})),
                chunk(choice(0, {"content": "one."}), choice(1, {"content": "two.", "tool_calls": [
                    {"index": 0, "id": "call_B", "type": "function", "function": write}]})),
                chunk(choice(0, {}, "stop"), choice(1, {}, "length")),
                USAGE,
            ]
        )
    )  # fmt: skip
    recorder = Shown()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Say it"))

    assert await finished(recorder) == ("t_1", True, "Alpha one.")
    assert "".join(recorder.shown) == "Alpha one."
    assert [(m.role, m.content, m.tool_calls) for m in recorder.messages] == [
        ("assistant", "Alpha one.", None)
    ]
    assert recorder.tools == [] and not (tmp_path / "x.txt").exists()
    assert recorder.endings[-1].reason == "finished"


SPLIT = [
    (["smile \ud83d", "\ude00 done"], "smile \U0001f600 done"),
    (["a \ud83d", "\ud83d", "\ude00 b"], "a \ufffd\U0001f600 b"),
    (["lone \ud83d", " then"], "lone \ufffd then"),
    (["\ude00 low first"], "\ufffd low first"),
    (["at the end \ud83d"], "at the end \ufffd"),
]
"""A model's text in chunks, and how it reads: the two halves of a UTF-16 pair (JSON's
``"\\ud83d"`` and ``"\\ude00"``) in two chunks make their character; a half alone, even one
ending the answer, is U+FFFD."""


@pytest.mark.parametrize(("chunks", "said"), SPLIT, ids=["pair", "twice", "lone", "low", "end"])
async def test_an_emoji_split_between_two_chunks_reads_whole_and_a_lone_half_as_u_fffd(
    upstream: Upstream, tmp_path: Path, chunks: list[str], said: str
) -> None:
    """Each chunk's halves were read as U+FFFD on their own: "smile \ufffd\ufffd done"."""
    upstream.peer.script(Reply(chunks=chunks))
    recorder = Shown()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Smile"))

    assert await finished(recorder) == ("t_1", True, said)
    assert "".join(recorder.shown) == said
    assert [m.content for m in recorder.messages] == [said]


async def test_half_a_pair_held_back_before_a_tool_call_or_an_abort_is_kept_as_u_fffd(
    upstream: Upstream, tmp_path: Path
) -> None:
    """A half held back for the next chunk is not lost when a call, or an abort, comes
    instead."""
    call = ScriptedToolCall("list_directory", {"path": "."})
    upstream.peer.script(
        Reply(chunks=["Looking \ud83d"], tool_calls=[call]),
        Reply(chunks=["Waiting \ud83d", "never"], stall_after=(1, 60.0)),
    )
    recorder = Shown()
    service = service_for(upstream, tmp_path, recorder)
    service.accept(order("t_1", "Look, then wait"))

    await asyncio.wait_for(shown(recorder, "Waiting"), 5)
    service.abort("t_1")

    assert await finished(recorder) == ("t_1", True, "aborted")
    kept = [(m.role, m.content, bool(m.aborted)) for m in recorder.messages]
    assert kept[0] == ("assistant", "Looking \ufffd", False)
    assert kept[-1] == ("assistant", "Waiting \ufffd", True)
    assert "".join(recorder.shown) == "Looking \ufffdWaiting \ufffd"


async def shown(recorder: Shown, text: str) -> None:
    """Until the streamed text holds ``text``."""
    while text not in "".join(recorder.shown):
        recorder.streaming.clear()
        await recorder.streaming.wait()


SAID = [choice(0, {"role": "assistant", "content": "All "}), choice(0, {"content": "text."})]


@pytest.mark.parametrize(
    "events",
    [
        [chunk(SAID[0]), chunk(SAID[1]), USAGE],
        [chunk(SAID[0]), chunk(SAID[1]), chunk(choice(0, {}, "")), USAGE],
    ],
    ids=["no finish reason", "an empty one"],
)
async def test_an_answer_that_ends_with_done_is_whole_without_a_finish_reason(
    openai_peer: OpenAIPeer, tmp_path: Path, events: list[str]
) -> None:
    """The stream's ``[DONE]`` says it is whole; the SDK reads it and says nothing: the turn
    failed as if the stream had been cut ("The model service's stream ended before its answer
    did.")."""
    openai_peer.script(Reply(events=events))
    recorder = Shown()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Say it"))

    assert await finished(recorder) == ("t_1", True, "All text.")
    assert [m.content for m in recorder.messages] == ["All text."]
    assert recorder.endings[-1].reason == "finished"
    usage = recorder.endings[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (10, 4)


@pytest.mark.parametrize(
    "events",
    [[chunk(SAID[0]), chunk(SAID[1])], [chunk(SAID[0]), chunk(SAID[1]), chunk(choice(0, {}, ""))]],
    ids=["no finish reason", "an empty one"],
)
async def test_a_stream_cut_without_done_or_a_finish_reason_still_ended_early(
    openai_peer: OpenAIPeer, tmp_path: Path, events: list[str]
) -> None:
    openai_peer.script(Reply(events=events, cut_short=True))
    recorder = Shown()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Say it"))

    assert await finished(recorder) == ("t_1", False, ENDED_EARLY)
    assert recorder.messages == [] and recorder.endings[-1].reason == "model_failed"


async def test_the_log_line_of_a_request_tried_again_names_its_turn_in_sentences(
    openai_peer: OpenAIPeer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It read "The model service answered 429: Rate limit reached Trying again in 0.0 s.":
    no turn (with several at once, which one waits?) and no full stop after the service's
    words."""
    caplog.set_level(logging.INFO, logger="hangar.drone")
    limited = Reply(status=429, error_message="Rate limit reached", headers={"Retry-After": "0.01"})
    openai_peer.script(limited, Reply(chunks=["Fine."]))
    recorder = Shown()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Go"))

    assert await finished(recorder) == ("t_1", True, "Fine.")
    lines = [r.getMessage() for r in caplog.records if "Trying again" in r.getMessage()]
    assert len(lines) == 1, caplog.messages
    assert "turn=t_1" in lines[0]
    assert lines[0].endswith(
        "The model service answered 429: Rate limit reached. Trying again in 0.0 s."
    )


async def test_a_wait_too_long_to_take_is_told_in_a_sentence_of_its_own(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """It read "… answered 429: Rate limit reached It asks to be tried again in 600 s."."""
    limited = Reply(status=429, error_message="Rate limit reached", headers={"Retry-After": "600"})
    openai_peer.script(limited)
    recorder = Shown()
    service = service_for(Upstream("openai", openai_peer), tmp_path, recorder)
    service.accept(order("t_1", "Go"))

    said = "The model service answered 429: Rate limit reached. It asks to be tried again in 600 s."
    assert await finished(recorder) == ("t_1", False, said)
