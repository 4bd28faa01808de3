"""The provider protocol: a small surface the agent loop talks to; SDKs live behind it.

``chat`` yields events until the model's reply is complete. Every implementation honours
``options.signal``: checked before the request, raced against every read of the stream, the HTTP
stream closed on abort, and ``AbortError`` raised. No retry follows an abort.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.abort import AbortSignal
from shared.protocol import ChatMessage


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class ToolCallRequest:
    id: str
    name: str
    arguments: str
    """JSON object text, as the model produced it."""


ChatEvent = TextChunk | ToolCallRequest


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class ChatOptions:
    model: str
    signal: AbortSignal


class ProviderError(Exception):
    """The model service failed; the message is a sentence a person can read."""


class Provider(Protocol):
    name: str
    model: str

    def chat(
        self, messages: list[ChatMessage], tools: list[ToolSpec], options: ChatOptions
    ) -> AsyncIterator[ChatEvent]: ...

    async def close(self) -> None: ...
