"""``Provider`` over the official openai SDK (AsyncOpenAI, the chat completions stream)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import openai
from openai import AsyncStream
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from hangar.shared.protocol import ChatMessage

from .base import (
    ChatEvent,
    ChatOptions,
    ProviderError,
    TextChunk,
    ToolCallRequest,
    ToolSpec,
    UpstreamShutdown,
    UsageReport,
)


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
        self.client = openai.AsyncOpenAI(
            api_key=api_key or "unused",
            base_url=base_url,
            max_retries=max_retries,
            timeout=timeout,
        )

    async def chat(
        self, messages: list[ChatMessage], tools: list[ToolSpec], options: ChatOptions
    ) -> AsyncGenerator[ChatEvent, None]:
        signal = options.signal
        signal.throw_if_aborted()
        body: dict[str, Any] = {
            "model": options.model,
            "messages": [_message(m) for m in messages],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = [t.function() for t in tools]
        try:
            # The caller's abort scope interrupts the request and its retries before the headers.
            # The body is already the API's JSON: posted as it is, without the SDK's typed
            # transform of ``chat.completions.create`` (which walks every value of every message
            # against the parameter types: ~0.3 s of the loop for 2,000 messages). The SDK still
            # sends it, retries, and parses the stream.
            stream = await self.client.post(
                "/chat/completions",
                body=body,
                cast_to=ChatCompletion,
                stream=True,
                stream_cls=AsyncStream[ChatCompletionChunk],
            )
        except openai.APIError as error:
            raise ProviderError(_describe(error)) from error
        # An abort shuts the socket down in its callback: the FIN leaves before the loop runs on.
        upstream = UpstreamShutdown(signal)
        upstream.attach(stream.response)
        calls: dict[int, dict[str, str]] = {}
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    yield UsageReport(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.content:
                        yield TextChunk(delta.content)
                    for piece in delta.tool_calls or []:
                        call = calls.setdefault(
                            piece.index, {"id": "", "name": "", "arguments": ""}
                        )
                        if piece.id:
                            call["id"] = piece.id
                        if piece.function and piece.function.name:
                            call["name"] += piece.function.name
                        if piece.function and piece.function.arguments:
                            call["arguments"] += piece.function.arguments
        except Exception as error:
            # The shut-down socket may fail the read before the scope's cancellation: abort wins.
            signal.throw_if_aborted()
            if isinstance(error, openai.APIError):
                raise ProviderError(_describe(error)) from error
            raise
        finally:
            upstream.detach()
            # A bare break would leave the HTTP stream open; closing it releases the connection.
            await stream.close()
        for index in sorted(calls):
            call = calls[index]
            yield ToolCallRequest(
                id=call["id"] or f"call_{index}", name=call["name"], arguments=call["arguments"]
            )

    async def close(self) -> None:
        await self.client.close()


def _message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _describe(error: openai.APIError) -> str:
    if isinstance(error, openai.APIStatusError):
        detail = error.message
        try:
            body = error.response.json()
            detail = body.get("error", {}).get("message") or detail
        except (ValueError, AttributeError, json.JSONDecodeError):
            pass
        return f"The model service answered {error.status_code}: {detail}"
    if isinstance(error, openai.APITimeoutError):
        return "The model service timed out."
    if isinstance(error, openai.APIConnectionError):
        return "The model service could not be reached."
    return f"The model service failed: {error}"
