"""A turn's report: its progress, sent through the drone's connection, with text coalesced."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, Protocol

from hangar.shared.protocol import (
    WORK_ORDER_PROGRESS,
    ChatMessage,
    MessageAdded,
    TextDelta,
    ToolActivity,
    ToolCall,
    cut,
)

TEXT_BATCH = 0.025
"""Text arriving within this many seconds of the last text sent goes out as one delta."""
TEXT_BATCH_CHARS = 65_536
"""Held text this long goes at once; and no delta carries more (a model's huge chunk, or a
worker's batch of a fast stream, goes as several: the protocol bounds a delta's text)."""
TEXT_EVENTS_PER_SECOND = 400
"""Text deltas a drone sends at most per second across its turns: with many turns streaming at
once, each turn's window widens beyond ``TEXT_BATCH``, so a drone that runs 50 streams sends
their text in fewer, larger deltas instead of flooding the relay and the browsers."""
RESEND_CHARS = 500_000
"""A turn's text sent again after a reconnect goes in pieces of at most this many characters."""


def text_window(turns: int) -> float:
    """How long a turn's text may be held back while ``turns`` turns run on the drone."""
    return max(TEXT_BATCH, turns / TEXT_EVENTS_PER_SECOND)


class Sender(Protocol):
    """What a report needs of the drone's connection."""

    chunks_streamed: int

    def text_window(self) -> float:
        """Seconds a turn's text may be held back (``text_window`` of the turns it runs)."""

    async def post(self, event: str, data: Any) -> None:
        """Send if connected (display only: dropped otherwise)."""

    def deliver(self, turn_id: str, event: str, data: Any) -> None:
        """Send in the turn's order until the relay confirms it."""

    def spawn(self, work: Coroutine[Any, Any, None]) -> None: ...


class TurnReport:
    """``Report`` for one turn (see ``agent.Report``).

    Text is coalesced: a chunk after a quiet ``TEXT_BATCH`` goes out at once, chunks arriving
    faster than that go out together at most ``TEXT_BATCH`` later (longer while the drone runs
    more than 10 turns: ``text_window``, 125 ms at 50 turns). A person sees no difference;
    the relay, the browsers and the drone's own connection (where an abort's ack queues behind
    what is already sent) handle several times fewer events from a fast model. Any other event of
    the turn, and its completion, first sends the text held back, so the order stays as produced.

    The turn's own text (depth 0) is kept, and each delta says where it starts (``at``), so after
    a reconnect the whole text can go again and the relay keeps only what it lacks. Finished
    messages are numbered and delivered until the relay confirms them.
    """

    def __init__(self, sender: Sender, turn_id: str) -> None:
        self.sender = sender
        self.turn_id = turn_id
        self._held: list[str] = []
        self._held_chars = 0
        self._held_depth = 0
        self._last_sent = -TEXT_BATCH
        self._timer: asyncio.TimerHandle | None = None
        self._said: list[str] = []
        """The turn's own text sent so far."""
        self._said_chars = 0
        self._messages = 0

    async def text(self, text: str, depth: int, chunks: int = 1) -> None:
        """``chunks``: how many of the model's chunks ``text`` is (a worker sends them joined)."""
        self.sender.chunks_streamed += chunks
        if self._held and depth != self._held_depth:
            await self.flush()
        self._held.append(text)
        self._held_chars += len(text)
        self._held_depth = depth
        loop = asyncio.get_running_loop()
        wait = self._last_sent + self.sender.text_window() - loop.time()
        if wait <= 0 or self._held_chars >= TEXT_BATCH_CHARS:
            await self.flush()
        elif self._timer is None:
            self._timer = loop.call_later(wait, self._flush_later)

    async def message(self, message: ChatMessage) -> None:
        await self.flush()
        event = MessageAdded(turn_id=self.turn_id, message=message, number=self._messages)
        self._messages += 1
        self.sender.deliver(self.turn_id, WORK_ORDER_PROGRESS, event.wire())

    async def tool(self, call: ToolCall, state: str, depth: int, result: str | None = None) -> None:
        await self.flush()
        event = ToolActivity(
            turn_id=self.turn_id,
            call_id=call.id,
            name=call.name,
            state=state,
            arguments=_shown(call.arguments) if state in ("start", "waiting") else None,
            result=result,
            depth=depth,
        )
        await self.sender.post(WORK_ORDER_PROGRESS, event.wire())

    async def flush(self) -> None:
        """Send the text held back, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        text = "".join(self._held)
        self._held.clear()
        self._held_chars = 0
        self._last_sent = asyncio.get_running_loop().time()
        events = []
        for start in range(0, len(text), TEXT_BATCH_CHARS):
            piece = text[start : start + TEXT_BATCH_CHARS]
            event = TextDelta(turn_id=self.turn_id, text=piece, depth=self._held_depth)
            if self._held_depth == 0:
                event.at = self._said_chars
                self._said.append(piece)
                self._said_chars += len(piece)
            events.append(event.wire())
        # Each is queued for the socket at once (python-socketio's queue never waits): in order.
        for wire in events:
            await self.sender.post(WORK_ORDER_PROGRESS, wire)

    def text_so_far(self) -> list[dict[str, Any]]:
        """The turn's own text sent so far, as deltas from its start (to send again)."""
        text = "".join(self._said)
        self._said = [text] if text else []
        return [
            TextDelta(turn_id=self.turn_id, text=text[at : at + RESEND_CHARS], at=at).wire()
            for at in range(0, len(text), RESEND_CHARS)
        ]

    def _flush_later(self) -> None:
        self._timer = None
        self.sender.spawn(self.flush())


SHOWN_ARGUMENTS_CHARS = 100_000
"""The most of a tool call's arguments its activity shows (a file's whole text, say)."""
SHOWN_VALUE_CHARS = 20_000
"""The most of one long value (a file's content) shown, when the arguments are too long."""


def _shown(arguments: str) -> str:
    """The arguments as shown: whole when they fit, else still a JSON object with every short
    value whole (a path, a command) and each long one cut, saying how much was left out."""
    if len(arguments) <= SHOWN_ARGUMENTS_CHARS:
        return arguments
    try:
        parsed = json.loads(arguments)
        if isinstance(parsed, dict):
            shortened = {key: _cut(value) for key, value in parsed.items()}
            shown = json.dumps(shortened, ensure_ascii=False)
            if len(shown) <= SHOWN_ARGUMENTS_CHARS:
                return shown
    except (ValueError, RecursionError):  # not JSON, or nested past what Python can walk
        pass
    return cut(arguments, SHOWN_ARGUMENTS_CHARS)


def _cut(value: object) -> object:
    return cut(value, SHOWN_VALUE_CHARS) if isinstance(value, str) else value
