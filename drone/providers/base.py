"""The provider protocol: a small surface the agent loop talks to; SDKs live behind it.

``chat`` yields events until the model's reply is complete. Call it inside an abort scope
(``async with signal.scope()``, as the agent loop does): the scope interrupts a pending read the
moment the signal fires, so an abort never waits for the next chunk. Every implementation honours
``options.signal`` besides: checked before the request, the stream's socket shut down inside the
abort callback itself (``UpstreamShutdown``, so the upstream sees the FIN at once even from a busy
loop), the HTTP stream closed in ``finally``, and ``AbortError`` raised where a read fails because
of the abort. No retry follows an abort.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import socket
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hangar.shared.abort import AbortSignal
from hangar.shared.protocol import ChatMessage
from hangar.shared.wire import MOST_TOKENS, cut


def call_arguments(text: str) -> Any:
    """A call's arguments as JSON reads them (RFC 8259): Python's ``json`` also reads ``NaN``,
    ``Infinity`` and ``-Infinity``, which model services refuse in a history (an Ollama server
    does), so they are refused here too (``ValueError``, as for any text that is not JSON)."""
    return json.loads(text, parse_constant=_not_json)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class TextChunk:
    text: str


class WholeText:
    """A model's streamed text as whole characters. A service may split a character beyond
    U+FFFF between two chunks as the halves of its UTF-16 pair (JSON's ``"\\ud83d"``, then
    ``"\\ude00"``): a first half ending a chunk is held back and joined to the second that starts
    the next. Any half alone (also one held back when the text ends, ``end``) is U+FFFD."""

    def __init__(self) -> None:
        self.held = ""

    def add(self, text: str) -> str:
        """``text`` as whole characters, less a first half it ends with (held for the next)."""
        text, self.held = self.held + text, ""
        if text and "\ud800" <= text[-1] <= "\udbff":
            text, self.held = text[:-1], text[-1]
        if text.isascii():
            return text
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")

    def end(self) -> str:
        """What is held back, as the text ends there: U+FFFD, or nothing."""
        held, self.held = self.held, ""
        return "\ufffd" if held else ""


@dataclass(frozen=True)
class ToolCallRequest:
    id: str
    name: str
    arguments: str
    """JSON object text, as the model produced it."""


@dataclass(frozen=True)
class UsageReport:
    """Tokens the model service counted for this call (at the end of its stream)."""

    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, prompt: object, completion: object) -> UsageReport | None:
        """The service's counts (a missing one is 0), or None when one is no count: negative,
        fractional, not a number, or more than a turn's count holds. The call's usage is then
        estimated, as for a service that does not say."""
        counts: list[int] = []
        for value in (prompt, completion):
            count = 0 if value is None else value
            if isinstance(count, bool) or not isinstance(count, int):
                return None
            if not 0 <= count <= MOST_TOKENS:
                return None
            counts.append(count)
        return cls(*counts)


@dataclass(frozen=True)
class Heard:
    """The stream brought part of the answer that is not text to show: a piece of a tool call,
    or the model's reasoning. The model is not silent (a stall watch counts it)."""


HEARD = Heard()

ChatEvent = TextChunk | ToolCallRequest | UsageReport | Heard


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def function(self) -> dict[str, Any]:
        """The tool as both services take it: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _unwatched(seconds: float) -> None:
    """No stall watch to tell."""


@dataclass(frozen=True)
class ChatOptions:
    model: str
    signal: AbortSignal
    hold: Callable[[float], None] = _unwatched
    """Called as the provider starts a wait the model service asked for (``Retry-After``), with
    its length: the silence a stall watch counts starts after it."""
    turn_id: str = "-"
    """The work order's turn, for log lines."""


class ProviderError(Exception):
    """The model service failed; the message is a sentence a person can read."""


ENDED_EARLY = "The model service's stream ended before its answer did."
"""A stream that stopped without its last chunk: what came is not the model's whole answer."""
BROKE_OFF = "The connection to the model service broke in the middle of its answer."
CUT_AT_LENGTH = "The model's answer reached its length limit and was cut there."
FILTERED = "The model service withheld the rest of the answer (its content filter)."
EMPTY_ANSWER = "The model's answer was empty."
AFTER_DONE = 0.2
"""Seconds the end of a stream is waited for once its answer is whole (read, the connection
serves the next request); a service that keeps it open longer has it closed."""


class Provider(Protocol):
    name: str
    model: str

    def chat(
        self, messages: list[ChatMessage], tools: list[ToolSpec], options: ChatOptions
    ) -> AsyncGenerator[ChatEvent, None]: ...

    async def close(self) -> None: ...


class StreamedResponse(Protocol):
    """What ``UpstreamShutdown`` needs of a streamed response (httpx's and httpx2's alike)."""

    @property
    def extensions(self) -> Mapping[str, Any]: ...

    @property
    def http_version(self) -> str: ...

    @property
    def is_closed(self) -> bool: ...


class _TransportSocket(Protocol):
    """A transport's socket: asyncio's ``TransportSocket`` or uvloop's ``PseudoSocket``."""

    def dup(self) -> socket.socket: ...

    def getsockname(self) -> Any: ...

    def getpeername(self) -> Any: ...


class UpstreamShutdown:
    """Shuts down the TCP socket of a chat's streamed response the moment its signal fires.

    Cancelling the pending read and closing the stream (each provider's ``finally``) take several
    event-loop iterations on a busy drone before the FIN leaves; ``shutdown(SHUT_RDWR)`` in the
    abort callback sends it at once, so the upstream stops generating even while the loop is busy.
    The async unwinding still follows and cleans up. Best effort: without a socket, or if it
    fails, that unwinding is the close. Only an abort shuts down: a response that was
    closed normally (its connection maybe back in the pool, serving another stream) is never
    touched, and ``detach`` unsubscribes once the chat is over.
    """

    def __init__(self, signal: AbortSignal) -> None:
        self._signal = signal
        self._response: StreamedResponse | None = None
        self._socket: _TransportSocket | None = None
        self._names: tuple[Any, Any] | None = None
        self._remove: Callable[[], None] | None = None

    def attach(self, response: StreamedResponse) -> None:
        """Watch ``response`` (replacing any earlier one, e.g. a redirect's)."""
        self.detach()
        if not response.http_version.startswith("HTTP/1"):
            return  # HTTP/2 multiplexes other streams on the socket: leave it to the close
        # httpcore (and httpcore2) expose the connection's stream; its anyio stream, the socket.
        stream = response.extensions.get("network_stream")
        sock: _TransportSocket | None = stream and stream.get_extra_info("socket")
        if sock is None:
            return
        try:
            names = (sock.getsockname(), sock.getpeername())
        except OSError:
            return
        self._response, self._socket, self._names = response, sock, names
        self._remove = self._signal.add_callback(self._shutdown)  # runs now if already aborted

    def detach(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()
        self._response = self._socket = self._names = None

    def _shutdown(self) -> None:
        response, sock = self._response, self._socket
        if response is None or sock is None or response.is_closed:
            return
        # uvloop's transport sockets refuse shutdown(); a duplicate descriptor's shutdown is the
        # connection's all the same. The names tell whether the descriptor still is this
        # connection's: once its transport closed, the number may belong to another socket.
        # A callback must not raise: whatever fails here, the async unwinding still closes.
        with contextlib.suppress(OSError, TypeError, ValueError), sock.dup() as same:
            if (same.getsockname(), same.getpeername()) == self._names:
                same.shutdown(socket.SHUT_RDWR)


SAID_CHARS = 500
"""The most of a model service's own explanation of an error a turn's ending quotes."""
NO_REASON = "(no reason given)"


def said_by_service(body: str) -> str:
    """What a model service's error says, for a person, on one line: the message of a JSON
    error (``{"error": {"message": …}}``, ``{"error": "…"}``, ``{"message": …}`` or a JSON
    string), else its text without markup (an HTML error page's words); never a control
    character (it goes into logs too), at most ``SAID_CHARS`` characters."""
    text = body
    with contextlib.suppress(ValueError, RecursionError):  # not JSON, or nested past any depth
        found = json.loads(body)
        if isinstance(found, dict):
            found = found.get("error", found.get("message", found))
            if isinstance(found, dict):
                found = found.get("message", found)
        if isinstance(found, str):
            text = found
    if "<" in text and ">" in text:
        text = re.sub(r"(?is)<(script|style)\b.*?</\1\s*>|<[^>]*>", " ", text)
        text = html.unescape(text)
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return cut(text, SAID_CHARS) or NO_REASON
