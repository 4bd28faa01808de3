"""``Provider`` over the official openai SDK (AsyncOpenAI, the chat completions stream)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import AsyncGenerator
from typing import Any

import openai
from openai import AsyncStream
from openai._streaming import SSEBytesDecoder, SSEDecoder
from openai.types.chat import ChatCompletion

from hangar.shared.protocol import ANSWER_TOO_LONG, MAX_MESSAGE_BYTES, ChatMessage

from .base import (
    AFTER_DONE,
    BROKE_OFF,
    CUT_AT_LENGTH,
    ENDED_EARLY,
    FILTERED,
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
from .event_stream import ReplacingDecoder
from .message_json import MessageJson
from .retry import retry_wait, too_long

log = logging.getLogger("hangar.drone")


class _Client(openai.AsyncOpenAI):
    """The SDK's client, whose streams read bytes that are no UTF-8 as U+FFFD, as the Ollama
    SDK's do: its own failed the turn at the first such byte a service sent."""

    def _make_sse_decoder(self) -> SSEDecoder | SSEBytesDecoder:
        return ReplacingDecoder()


class OpenAIProvider:
    name = "openai"

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 2,
        timeout: float = 600.0,
    ) -> None:
        self.model = model
        self.max_retries = max_retries
        # The drone tries requests again itself (``retry``): the SDK's own waits would pass for
        # the model's silence.
        self.client = _Client(
            api_key=api_key or "unused", base_url=base_url, max_retries=0, timeout=timeout
        )
        self.messages = MessageJson(_message)

    async def chat(
        self, messages: list[ChatMessage], tools: list[ToolSpec], options: ChatOptions
    ) -> AsyncGenerator[ChatEvent, None]:
        signal = options.signal
        signal.throw_if_aborted()
        fields: dict[str, Any] = {
            "model": options.model,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            fields["tools"] = [t.function() for t in tools]
        body = self.messages.body(messages, fields)
        stream = await self._open(body, options)
        # An abort shuts the socket down in its callback: the FIN leaves before the loop runs on.
        upstream = UpstreamShutdown(signal)
        upstream.attach(stream.response)
        reading = _Reading()
        chunks = stream.__aiter__()
        try:
            while True:
                try:
                    if reading.finished:  # whole: only usage and [DONE] may follow, at once
                        async with asyncio.timeout(AFTER_DONE):
                            chunk = await anext(chunks)
                    else:
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if not reading.finished or signal.aborted:
                        raise
                    break  # the service keeps the stream open: closed here
                for event in reading.read(chunk):
                    yield event
        except Exception as error:
            # The shut-down socket may fail the read before the scope's cancellation: abort wins.
            signal.throw_if_aborted()
            if isinstance(error, openai.APIConnectionError) and not isinstance(
                error, openai.APITimeoutError
            ):
                raise ProviderError(BROKE_OFF) from error
            if isinstance(error, openai.APIError):
                raise ProviderError(_describe(error)) from error
            if isinstance(error, ValueError | RecursionError):  # a chunk not JSON, or too deep
                raise ProviderError(UNREADABLE) from error
            raise
        finally:
            upstream.detach()
            # A bare break would leave the HTTP stream open; closing it releases the connection.
            await stream.close()
        if not reading.finished and _done(stream):  # whole, though no reason came with it
            reading.finished.append("stop")
        if not reading.finished:  # no choice ended: the stream was cut short (or was no stream)
            signal.throw_if_aborted()  # an abort may end the stream as if it were whole
            raise ProviderError(ENDED_EARLY)
        if reading.usage is not None:
            yield reading.usage
        for reason in reading.finished:
            if reason in CUT_SHORT:  # never passed off as a whole answer; its calls do not run
                raise ProviderError(CUT_SHORT[reason])
        calls = reading.calls
        for index in sorted(calls):
            call = calls[index]
            yield ToolCallRequest(
                id=call["id"] or f"call_{index}", name=call["name"], arguments=call["arguments"]
            )

    async def _open(self, body: bytes, options: ChatOptions) -> AsyncStream[object]:
        """The response's stream once its headers came, after the tries ``retry`` allows; the
        caller's abort scope interrupts the request and the waits between tries."""
        for tried in itertools.count():
            try:
                # The body is the API's JSON, encoded here: posted as it is, without the SDK's
                # typed transform of ``chat.completions.create`` (which walks every value of
                # every message against the parameter types: ~0.3 s of the loop for 2,000
                # messages), and with the history's messages as they were encoded for the last
                # request. The SDK still sends it (as application/json) and parses the stream.
                # Each chunk comes as the JSON the service sent (``object``), not built into the
                # SDK's ``ChatCompletionChunk`` models: that costs ~90 us a chunk, nine tenths
                # of the SDK's work per streamed token (docs/performance.md, "Real token rates").
                return await self.client.post(
                    "/chat/completions",
                    content=body,
                    cast_to=ChatCompletion,
                    stream=True,
                    stream_cls=AsyncStream[object],
                )
            except openai.APIError as error:
                wait, said = retry_wait(error, self.max_retries - tried, tried), _describe(error)
                if wait is None:
                    later = too_long(error)  # a sentence of its own, after the service's words
                    raise ProviderError(_sentence(said) + later if later else said) from error
                turn = options.turn_id
                log.info("retry turn=%s: %s Trying again in %.1f s.", turn, _sentence(said), wait)
            options.hold(wait)  # the service's answer, not the model's silence
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.client.close()


UNREADABLE = "The model service sent a chunk that is not a chat completion chunk."
CALL = ("id", "name", "arguments")
MAX_NAME = 64
"""The longest name of a past call OpenAI takes back."""
CUT_SHORT = {"length": CUT_AT_LENGTH, "content_filter": FILTERED}
"""Finish reasons of an answer the service cut: the turn fails, what streamed is kept cut."""


class _Reading:
    """One stream's chunks as they come (the API's JSON), of its first choice only (the drone
    asks for one; a service may send others): text goes out at once; tool call pieces add up
    in ``calls`` (in the order they came: id, name, arguments so far), its ``finish_reason``
    in ``finished`` (an empty one is none), and the last usage reported (a service may report it
    on more than one chunk: it counts the whole request each time) in ``usage``."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, str]] = {}
        self.at: dict[int, int] = {}
        """The service's index of a call -> its key in ``calls`` (the order it came in)."""
        self.finished: list[str] = []
        self.usage: UsageReport | None = None

    def read(self, chunk: object) -> list[ChatEvent]:
        if not isinstance(chunk, dict):
            raise ProviderError(UNREADABLE)
        if chunk.get("object") == "error":  # vLLM's and others' error in the stream
            said = said_by_service(json.dumps(chunk))
            raise ProviderError(f"The model service reported an error: {said}")
        events: list[ChatEvent] = []
        try:
            usage = chunk.get("usage")
            if usage:
                prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
                self.usage = UsageReport.of(prompt, completion) or self.usage
            for choice in chunk.get("choices") or ():
                if choice.get("index") not in (0, None):  # another choice: never asked for
                    continue
                if choice.get("finish_reason"):
                    self.finished.append(str(choice["finish_reason"]))
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if isinstance(content, list):  # parts, as some compatible services send it
                    content = "".join(str(p.get("text") or "") for p in content)
                if content:
                    events.append(TextChunk(str(content)))
                pieces = delta.get("tool_calls") or ()
                for piece in pieces:
                    self._add(piece)
                if pieces or delta.get("reasoning_content") or delta.get("reasoning"):
                    events.append(HEARD)
        except (AttributeError, TypeError, ValueError) as error:
            raise ProviderError(UNREADABLE) from error
        return events

    def _add(self, piece: dict[str, Any]) -> None:
        """One piece of a call. A piece that brings another id and a name to a call that has
        both starts a new call, also at an index in use (some compatible services number each
        call 0). Without an ``index`` (others leave it out), so does another id alone, or a name
        to a call that has one. Calls keep the order their first pieces came in."""
        index, named = piece.get("index"), piece.get("id")
        function = piece.get("function") or {}
        name = function.get("name")
        key = len(self.calls) - 1 if index is None else self.at.get(int(index), -1)
        last = self.calls.get(key)
        other = bool(named) and last is not None and str(named) != last["id"]
        if index is None:
            other = other or bool(not named and name and last and last["name"])
        else:
            other = other and bool(last and last["id"] and last["name"] and name)
        if last is None or other:
            key = len(self.calls)
            last = self.calls[key] = dict.fromkeys(CALL, "")
            if index is not None:
                self.at[int(index)] = key
        if named:
            last["id"] = str(named)
        last["name"] += str(name or "")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str):  # an object, not its JSON
            arguments = json.dumps(arguments, ensure_ascii=False)
        last["arguments"] += arguments or ""
        if len(last["arguments"]) > MAX_MESSAGE_BYTES:  # it could never be kept
            raise ProviderError(ANSWER_TOO_LONG)


def _message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": _name(call.name), "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _name(name: str) -> str:
    """A past call's name as the service takes it back (``^[a-zA-Z0-9_-]{1,64}$``; it refuses
    the whole history otherwise): what the model wrote, each other character as ``_``. Such a
    call named no tool, and its result told the model so in the name it wrote."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:MAX_NAME] or "unnamed"


def _arguments(text: str) -> str:
    """A call's arguments as the service gets them back: the model's own text when it is a JSON
    object, else ``{}`` (services that read past calls refuse a history with arguments they
    cannot read; the call's result told the model what was wrong with them)."""
    try:
        value = call_arguments(text)
    except (ValueError, RecursionError):
        return "{}"
    return text if isinstance(value, dict) else "{}"


def _done(stream: AsyncStream[object]) -> bool:
    """Whether the stream ended with its ``[DONE]`` (which the SDK reads without a word)."""
    decoder = stream._decoder
    return isinstance(decoder, ReplacingDecoder) and decoder.done


def _sentence(text: str) -> str:
    """``text`` ending as a sentence does, before another is added to it."""
    return text if text.endswith((".", "!", "?")) else text + "."


def _describe(error: openai.APIError) -> str:
    if isinstance(error, openai.APIStatusError):
        try:
            body = error.response.text
        except Exception:  # a body that could not be read
            body = ""
        return f"The model service answered {error.status_code}: {said_by_service(body)}"
    if isinstance(error, openai.APITimeoutError):
        return "The model service timed out."
    if isinstance(error, openai.APIConnectionError):
        return "The model service could not be reached."
    # An error the service sent in its stream: the SDK's message, or its own words for one
    # that is a string ("An error occurred during streaming").
    sent: object = error.body
    said = json.dumps(sent) if isinstance(sent, dict | str) and sent else str(error)
    return f"The model service reported an error: {said_by_service(said)}"
