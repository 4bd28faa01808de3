"""``Provider`` over the official ollama SDK (the stream of ``AsyncClient.chat``'s request)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator
from contextvars import ContextVar
from typing import Any, cast

import httpx

from hangar.shared.protocol import ChatMessage

from .base import (
    AFTER_DONE,
    BROKE_OFF,
    CUT_AT_LENGTH,
    ENDED_EARLY,
    HEARD,
    ChatEvent,
    ChatOptions,
    ProviderError,
    TextChunk,
    ToolCallRequest,
    ToolSpec,
    UpstreamShutdown,
    UsageReport,
    call_arguments,
    said_by_service,
)
from .message_json import MessageJson

# The SDK makes a client of ``OLLAMA_HOST`` as it is imported: a value it cannot read failed
# every command (even ``hangar --help``) with its traceback, before the drone's own check of
# that variable could say what is wrong with it in one line.
_host = os.environ.pop("OLLAMA_HOST", None)
try:
    import ollama
    from ollama import ChatResponse
finally:
    if _host is not None:
        os.environ["OLLAMA_HOST"] = _host

# The chat whose read is sending the request: the httpx response hook below runs inside that
# read, in the same task and context, and finds its chat here.
_UPSTREAM: ContextVar[UpstreamShutdown | None] = ContextVar("ollama_upstream", default=None)


async def _on_response(response: httpx.Response) -> None:
    """httpx response hook: runs once the headers arrived, before any of the body is read.

    An error's body is read here, not by the SDK: it reads any JSON body as an object (a JSON
    string or list failed as an unreadable line) with no bound on its depth."""
    upstream = _UPSTREAM.get()
    if upstream is None:
        return
    if response.is_error:
        body = bytearray()
        async for piece in response.aiter_bytes():
            body += piece
            if len(body) >= ERROR_BODY_READ:
                break
        said = said_by_service(body[:ERROR_BODY_READ].decode(errors="replace"))
        raise ProviderError(f"The Ollama server answered {response.status_code}: {said}")
    upstream.attach(response)


class OllamaProvider:
    name = "ollama"

    def __init__(self, model: str, *, host: str | None = None, timeout: float = 600.0) -> None:
        self.model = model
        # ollama has no timeout by default: a dead server would hold a work order forever.
        # The SDK hides the streamed httpx response; the hook hands it to the chat that sent it.
        self.client = ollama.AsyncClient(
            host=host,
            timeout=httpx.Timeout(timeout, connect=10.0),
            event_hooks={"response": [_on_response]},
        )
        self.messages = MessageJson(_message)

    async def chat(
        self, messages: list[ChatMessage], tools: list[ToolSpec], options: ChatOptions
    ) -> AsyncGenerator[ChatEvent, None]:
        signal = options.signal
        signal.throw_if_aborted()
        fields = {"model": options.model, "tools": [t.function() for t in tools], "stream": True}
        body = self.messages.body(_named(messages), fields)
        try:
            # The body ``AsyncClient.chat`` would send, encoded here with the history's messages
            # as they were encoded for the last request: ``chat`` validates and copies every
            # message into the SDK's models first (~8 ms of the loop for 2,000 messages). The
            # SDK still sends it, through the method ``chat`` ends in, and parses the stream.
            stream = await self.client._request(
                ChatResponse, "POST", "/api/chat", content=body, stream=True
            )
            stream = cast(AsyncGenerator[ChatResponse, None], stream)
        except (ollama.ResponseError, httpx.HTTPError) as error:
            raise ProviderError(_describe(error)) from error
        # An abort shuts the socket down in its callback: the FIN leaves before the loop runs on.
        upstream = UpstreamShutdown(signal)
        count = 0
        parts = 0
        done = cut = False
        try:
            while True:
                # The SDK sends the request on the first read; its response hook attaches it.
                token = _UPSTREAM.set(upstream)
                try:
                    if done:  # the answer is whole: its end is read, if it comes at once
                        try:
                            async with asyncio.timeout(AFTER_DONE):
                                await stream.__anext__()  # more after the done line: not heard
                        except TimeoutError:
                            break  # the server keeps the stream open: closed here
                        continue
                    part = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except (ValueError, TypeError, AttributeError, RecursionError) as error:
                    # A line the SDK could not read (not JSON, null, a message of another
                    # shape): what the server sent, not a failure of the drone.
                    signal.throw_if_aborted()
                    raise ProviderError(UNREADABLE) from error
                finally:
                    _UPSTREAM.reset(token)
                parts += 1
                done = done or bool(part.done)
                cut = cut or (bool(part.done) and part.done_reason == "length")
                counted = part.eval_count is not None and part.done
                if counted and (report := UsageReport.of(part.prompt_eval_count, part.eval_count)):
                    yield report
                message = part.message
                if message.content:
                    yield TextChunk(message.content)
                elif getattr(message, "thinking", None):  # ollama-python 0.5 and later
                    yield HEARD
                for call in message.tool_calls or []:
                    count += 1
                    yield ToolCallRequest(
                        id=f"call_{count}",
                        name=call.function.name,
                        arguments=json.dumps(dict(call.function.arguments)),
                    )
        except Exception as error:
            # The shut-down socket may fail the read before the scope's cancellation: abort wins.
            signal.throw_if_aborted()
            broke = isinstance(error, httpx.TransportError)
            if parts and broke and not isinstance(error, httpx.TimeoutException):
                raise ProviderError(BROKE_OFF) from error
            if isinstance(error, (ollama.ResponseError, httpx.HTTPError)):
                raise ProviderError(_describe(error)) from error
            raise
        finally:
            upstream.detach()
            # Closing the generator exits the SDK's ``async with stream``: the connection closes.
            await stream.aclose()
        if not done:  # no part said "done": the stream was cut short
            signal.throw_if_aborted()  # an abort may end the stream as if it were whole
            raise ProviderError(ENDED_EARLY)
        if cut:  # never passed off as a whole answer
            raise ProviderError(CUT_AT_LENGTH)

    async def close(self) -> None:
        await self.client._client.aclose()


def _named(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Ollama names the tool a result is from: a tool message without a name (the agent and the
    relay always give one) takes the name of the call it answers."""
    if all(m.role != "tool" or m.name for m in messages):
        return messages
    names = {call.id: call.name for m in messages for call in (m.tool_calls or [])}
    return [
        m.model_copy(update={"name": names.get(m.tool_call_id or "", "")})
        if m.role == "tool" and not m.name
        else m
        for m in messages
    ]


def _message(message: ChatMessage) -> dict[str, Any]:
    """One message as ``AsyncClient.chat`` sends it: its empty fields left out."""
    item: dict[str, Any] = {"role": message.role}
    if message.content:
        item["content"] = message.content
    if message.tool_calls:
        item["tool_calls"] = [
            {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in message.tool_calls
        ]
    if message.role == "tool" and message.name:
        item["tool_name"] = message.name
    return item


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as an Ollama server reads them back: the model's own object, else
    ``{}`` (also for arguments nested past any depth: the call's result said what was wrong)."""
    try:
        value = call_arguments(text or "{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


UNREADABLE = "The Ollama server sent a line that is not a chat response."
ERROR_BODY_READ = 65_536
"""Bytes of an error's body read at most (its words are in its first few hundred)."""


def _describe(error: Exception) -> str:
    # An error said in the stream (an HTTP error's body is read by ``_on_response``).
    if isinstance(error, ollama.ResponseError):
        return f"The Ollama server reported an error: {said_by_service(error.error)}"
    if isinstance(error, httpx.TimeoutException):
        return "The Ollama server timed out."
    return "The Ollama server could not be reached."
