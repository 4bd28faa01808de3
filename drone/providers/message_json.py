"""A conversation's messages as JSON, encoded once: each model request of a long session carries
its whole history, but only what follows the messages it sent last time is encoded again.

The messages before a turn's prompt are the same objects from one order of a session to the
next in a worker (``drone/histories.py``), and from one model call of a turn to the next (the
agent appends to its list); a message is never changed once it is made. Encoding 2,000 messages
(0.5 MB) took a worker's loop ~2.5 ms per request through the openai SDK, ~8 ms through the
ollama SDK (docs/performance.md, "Submit → first token with a long history").
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hangar.shared.protocol import ChatMessage

CONVERSATIONS = 64
MAX_BYTES = 16_000_000
"""Encoded bytes kept in all; the least recently sent conversations are forgotten first."""


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON, as the openai SDK and httpx encode a request body. (A
    message's text is valid Unicode: ``ChatMessage`` refuses a lone surrogate.)"""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass
class _Sent:
    messages: list[ChatMessage]
    ends: list[int]
    """Where each message's JSON ends in ``data``."""
    data: bytes
    """The messages' JSON objects, comma-separated."""


class MessageJson:
    """The JSON arrays of recent conversations' messages, by the identity of their messages."""

    def __init__(
        self,
        encode: Callable[[ChatMessage], Any],
        conversations: int = CONVERSATIONS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.encode = encode
        """One message as the API's JSON value."""
        self.conversations = conversations
        self.max_bytes = max_bytes
        self._sent: OrderedDict[int, _Sent] = OrderedDict()
        """id of a conversation's first message -> what it sent last (which holds that message,
        so no other object can have its id meanwhile)."""
        self._bytes = 0

    def body(self, messages: Sequence[ChatMessage], fields: dict[str, Any]) -> bytes:
        """A request's JSON: ``fields`` and ``"messages"``, the array of ``encode(message)``."""
        return b'{"messages":' + self.array(messages) + b"," + dumps(fields)[1:]

    def array(self, messages: Sequence[ChatMessage]) -> bytes:
        """``messages`` as a JSON array of ``encode(message)``."""
        if not messages:
            return b"[]"
        sent = self._sent.pop(id(messages[0]), None) or _Sent([], [], b"")
        self._bytes -= len(sent.data)
        same, limit = 0, min(len(sent.messages), len(messages))
        while same < limit and sent.messages[same] is messages[same]:
            same += 1
        ends = sent.ends[:same]
        end = ends[-1] if ends else 0
        parts = [sent.data[:end]] if ends else []
        for message in messages[same:]:
            piece = dumps(self.encode(message))
            end += len(piece) + (1 if ends else 0)
            ends.append(end)
            parts.append(piece)
        data = b",".join(parts)
        self._keep(id(messages[0]), _Sent(list(messages), ends, data))
        return b"[" + data + b"]"

    def _keep(self, key: int, sent: _Sent) -> None:
        if len(sent.data) > self.max_bytes:
            return  # kept, it would push every other conversation out, then itself
        self._sent[key] = sent
        self._bytes += len(sent.data)
        while self._sent and (len(self._sent) > self.conversations or self._bytes > self.max_bytes):
            _, dropped = self._sent.popitem(last=False)
            self._bytes -= len(dropped.data)
