"""The fake upstream peers must be indistinguishable from the real services to the SDKs."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import ollama
import openai
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam

from bench.peers import OllamaPeer, OpenAIPeer, Reply, ScriptedToolCall

pytestmark = pytest.mark.asyncio

MODEL = "gpt-4o-mini"
OLLAMA_MODEL = "llama3.2:latest"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
PROMPT_DISCONNECT = 1.0  # seconds within which a client close must reach the peer


@pytest_asyncio.fixture
async def oai(openai_peer: OpenAIPeer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=openai_peer.base_url + "/v1", api_key="test", max_retries=0
    )
    yield client
    await client.close()


@pytest_asyncio.fixture
async def ol(ollama_peer: OllamaPeer) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=ollama_peer.base_url) as client:
        yield client


# --------------------------------------------------------------------------- OpenAI


async def test_openai_streams_scripted_text(
    openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI
) -> None:
    openai_peer.script(Reply(chunks=["The", " quick", " fox"]))
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, stream=True)
    text, roles, finish = "", [], []
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        assert chunk.model == MODEL
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        text += delta.content or ""
        finish.append(chunk.choices[0].finish_reason)
    assert text == "The quick fox"
    assert roles[0] == "assistant"
    assert finish[-1] == "stop" and finish[:-1] == [None] * (len(finish) - 1)
    rec = await openai_peer.wait_for_end()
    assert rec.completed and not rec.disconnected
    assert rec.body["stream"] is True and rec.model == MODEL
    assert rec.messages == USER and rec.chunks_sent == 3


async def test_openai_default_reply_usage_and_non_stream(
    openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI
) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2

    openai_peer.default = Reply(chunks=["plain"])
    completion = await oai.chat.completions.create(model=MODEL, messages=USER)
    assert completion.choices[0].message.content == "plain"
    assert completion.choices[0].finish_reason == "stop"
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["gpt-4o-mini"]


async def test_openai_tool_call_deltas_assemble(
    openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI
) -> None:
    args = {"city": "Paris", "units": "metric", "days": 3}
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                ScriptedToolCall("get_weather", args),
                ScriptedToolCall("get_time", {"tz": "CET"}, id="call_fixed"),
            ],
            tool_call_pieces=4,
        )
    )
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    async for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            if tc.function is not None:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == args
    assert calls[0]["id"].startswith("call_")
    assert calls[1] == {
        "id": "call_fixed",
        "name": "get_time",
        "arguments": '{"tz": "CET"}',
    }
    assert openai_peer.chunks_sent == 2 * (1 + 4)  # header + argument pieces per call


async def test_openai_close_mid_stream_is_seen_as_disconnect(
    openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI
) -> None:
    openai_peer.script(Reply(chunks=["one", " two", " three"], stall_after=(1, 30.0)))
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, stream=True)
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        if text:
            break
    assert text == "one"
    await openai_peer.wait_for_chunks(1)
    closed_at = time.monotonic()
    await stream.close()
    disconnected_at = await openai_peer.wait_for_disconnect(timeout=5)
    assert disconnected_at - closed_at < PROMPT_DISCONNECT
    rec = openai_peer.requests[-1]
    assert rec.disconnected and not rec.completed and rec.chunks_sent == 1


READ_ALL = """
import json, sys, urllib.request
body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
request = urllib.request.Request(sys.argv[1], json.dumps(body).encode(), method="POST")
request.add_header("Content-Type", "application/json")
with urllib.request.urlopen(request) as response:
    while response.read(1 << 16):
        pass
"""
"""Another process that reads a stream as fast as it comes, as a drone's worker does."""


async def test_an_unpaced_reply_leaves_the_loop_it_shares_to_others(
    openai_peer: OpenAIPeer,
) -> None:
    # The tests run the relay, the browsers and the peer on one loop: a peer that held it while
    # its reader kept up delayed everything else there, an abort's every hop included.
    openai_peer.script(Reply(chunks=["x"] * 1_500_000, chunks_per_write=100))
    url = openai_peer.base_url + "/v1/chat/completions"
    reader = await asyncio.create_subprocess_exec(sys.executable, "-c", READ_ALL, url)
    try:
        await openai_peer.wait_for_chunks(100, timeout=20)
        lags: list[float] = []
        while openai_peer.requests[-1].ended is None and len(lags) < 20_000:
            asked = time.monotonic()
            await asyncio.sleep(0.001)
            lags.append(time.monotonic() - asked)
        assert await asyncio.wait_for(reader.wait(), 20) == 0
    finally:
        if reader.returncode is None:
            reader.kill()
            await reader.wait()
    assert openai_peer.requests[-1].completed, "the reader read the whole stream"
    assert max(lags) < 0.1, f"the loop was held {max(lags) * 1000:.0f} ms"
    assert len(lags) > 50, "the loop was watched while the reply streamed"


async def test_openai_rejects_unanswered_tool_call(
    openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI
) -> None:
    openai_peer.script(Reply(chunks=["kept"]))
    call = {
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    history: Any = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "and?"},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=history, stream=True)
    assert info.value.status_code == 400
    assert "call_x" in info.value.message
    assert openai_peer.requests[-1].rejected is not None
    assert openai_peer.pending_replies == 1  # the rejection did not consume the script

    stray: Any = [*USER, {"role": "tool", "tool_call_id": "call_nope", "content": "42"}]
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model=MODEL, messages=stray, stream=True)

    answered: Any = [
        *history[:2],
        {"role": "tool", "tool_call_id": "call_x", "content": "ok"},
    ]
    stream = await oai.chat.completions.create(model=MODEL, messages=answered, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "kept"
    assert len(openai_peer.requests) == 3 and openai_peer.requests[-1].rejected is None


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("functions.read_file", "string does not match pattern"),
        ("read file", "string does not match pattern"),
        ("x" * 65, "string too long. Expected a string with maximum length 64"),
    ],
    ids=["dotted", "space", "too-long"],
)
async def test_openai_rejects_a_past_call_whose_name_it_never_takes(
    openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI, name: str, said: str
) -> None:
    """As OpenAI does: a history whose call is named outside ``^[a-zA-Z0-9_-]+$`` or past 64
    characters is refused, whatever the model wrote."""
    openai_peer.script(Reply(chunks=["kept"]))
    function = {"name": name, "arguments": "{}"}
    call = {"id": "call_x", "type": "function", "function": function}
    history: Any = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_x", "content": "ok"},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=history, stream=True)
    assert "'messages[1].tool_calls[0].function.name'" in info.value.message
    assert said in info.value.message
    function["name"] = "read_file"
    stream = await oai.chat.completions.create(model=MODEL, messages=history, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "kept"


async def test_openai_server_error(openai_peer: OpenAIPeer, oai: openai.AsyncOpenAI) -> None:
    openai_peer.script(Reply(status=500))
    with pytest.raises(openai.InternalServerError) as info:
        await oai.chat.completions.create(model=MODEL, messages=USER, stream=True)
    assert info.value.status_code == 500
    assert len(openai_peer.requests) == 1  # max_retries=0: no retry
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "server_error"


async def test_stop_does_not_hang_on_stalled_handler() -> None:
    peer = OpenAIPeer(default=Reply(stall_before=60.0))
    await peer.start()
    client = openai.AsyncOpenAI(base_url=peer.base_url + "/v1", api_key="t", max_retries=0)
    try:
        stream = await client.chat.completions.create(model=MODEL, messages=USER, stream=True)
        started = time.monotonic()
        await asyncio.wait_for(peer.stop(), timeout=5)
        assert time.monotonic() - started < 3
        assert not peer.requests[0].disconnected and not peer.requests[0].completed
        with pytest.raises(openai.APIError):
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
    finally:
        await client.close()
        await peer.stop()


# --------------------------------------------------------------------------- Ollama


async def test_ollama_streams_scripted_text(
    ollama_peer: OllamaPeer, ol: ollama.AsyncClient
) -> None:
    ollama_peer.script(Reply(chunks=["Bon", "jour", "!"], delay=0.01))
    parts = [p async for p in await ol.chat(model=OLLAMA_MODEL, messages=USER, stream=True)]
    assert "".join(p.message.content or "" for p in parts) == "Bonjour!"
    assert all(p.model == OLLAMA_MODEL and p.created_at for p in parts)
    assert [p.done for p in parts] == [False, False, False, True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 3
    rec = await ollama_peer.wait_for_end()
    assert rec.completed and rec.body["stream"] is True and rec.messages == USER

    whole = await ol.chat(model=OLLAMA_MODEL, messages=USER)
    assert whole.message.content == "Hello world" and whole.done
    assert (await ol.list()).models[0].model == OLLAMA_MODEL


async def test_ollama_tool_calls(ollama_peer: OllamaPeer, ol: ollama.AsyncClient) -> None:
    args = {"city": "Oslo", "days": 2}
    ollama_peer.script(Reply(chunks=[], tool_calls=[ScriptedToolCall("get_weather", args)]))
    parts = [p async for p in await ol.chat(model=OLLAMA_MODEL, messages=USER, stream=True)]
    calls = [tc for p in parts for tc in p.message.tool_calls or []]
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert dict(calls[0].function.arguments) == args
    assert parts[-1].done and parts[-1].done_reason == "stop"


async def test_ollama_aclose_mid_stream_is_seen_as_disconnect(
    ollama_peer: OllamaPeer, ol: ollama.AsyncClient
) -> None:
    ollama_peer.script(Reply(chunks=["a", "b", "c"], stall_after=(2, 30.0)))
    gen = await ol.chat(model=OLLAMA_MODEL, messages=USER, stream=True)
    assert isinstance(gen, AsyncGenerator)
    assert (await anext(gen)).message.content == "a"
    await ollama_peer.wait_for_chunks(2)
    closed_at = time.monotonic()
    await gen.aclose()
    disconnected_at = await ollama_peer.wait_for_disconnect(timeout=5)
    assert disconnected_at - closed_at < PROMPT_DISCONNECT
    rec = ollama_peer.requests[-1]
    assert rec.disconnected and not rec.completed and rec.chunks_sent == 2


async def test_ollama_cancelled_consumer_is_seen_as_disconnect(
    ollama_peer: OllamaPeer, ol: ollama.AsyncClient
) -> None:
    ollama_peer.script(Reply(stall_before=30.0))

    async def consume() -> str:
        gen = await ol.chat(model=OLLAMA_MODEL, messages=USER, stream=True)
        return "".join([p.message.content or "" async for p in gen])

    task = asyncio.create_task(consume())
    await ollama_peer.wait_for_requests(1)
    cancelled_at = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    disconnected_at = await ollama_peer.wait_for_disconnect(timeout=5)
    assert disconnected_at - cancelled_at < PROMPT_DISCONNECT
    assert ollama_peer.chunks_sent == 0 and not ollama_peer.requests[-1].completed


async def test_ollama_server_error(ollama_peer: OllamaPeer, ol: ollama.AsyncClient) -> None:
    ollama_peer.script(Reply(status=500, error_message="boom"), Reply(status=404))
    gen = await ol.chat(model=OLLAMA_MODEL, messages=USER, stream=True)
    with pytest.raises(ollama.ResponseError) as info:
        await anext(gen)
    assert info.value.status_code == 500 and info.value.error == "boom"
    with pytest.raises(ollama.ResponseError) as info:
        await ol.chat(model=OLLAMA_MODEL, messages=USER)
    assert info.value.status_code == 404
    assert [r.status for r in ollama_peer.requests] == [500, 404]
