"""A turn's report: its progress, sent through the drone's connection, with text coalesced."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from hangar.shared.protocol import (
    WORK_ORDER_PROGRESS,
    ChatMessage,
    MessageAdded,
    TextDelta,
    ToolActivity,
    ToolCall,
)

TEXT_BATCH = 0.025
"""Text arriving within this many seconds of the last text sent goes out as one delta."""
TEXT_BATCH_CHARS = 65_536


class Sender(Protocol):
    """What a report needs of the drone's connection."""

    chunks_streamed: int

    async def send(self, event: str, data: Any, *, durable: bool) -> None: ...

    def spawn(self, work: Coroutine[Any, Any, None]) -> None: ...


class TurnReport:
    """``Report`` for one turn (see ``agent.Report``).

    Text is coalesced: a chunk after a quiet ``TEXT_BATCH`` goes out at once, chunks arriving
    faster than that go out together at most ``TEXT_BATCH`` later. A person sees no difference;
    the relay, the browsers and the drone's own connection (where an abort's ack queues behind
    what is already sent) handle several times fewer events from a fast model. Any other event of
    the turn, and its completion, first sends the text held back, so the order stays as produced.
    """

    def __init__(self, sender: Sender, turn_id: str) -> None:
        self.sender = sender
        self.turn_id = turn_id
        self._held: list[str] = []
        self._held_chars = 0
        self._held_depth = 0
        self._last_sent = -TEXT_BATCH
        self._timer: asyncio.TimerHandle | None = None

    async def text(self, text: str, depth: int) -> None:
        self.sender.chunks_streamed += 1
        if self._held and depth != self._held_depth:
            await self.flush()
        self._held.append(text)
        self._held_chars += len(text)
        self._held_depth = depth
        loop = asyncio.get_running_loop()
        wait = self._last_sent + TEXT_BATCH - loop.time()
        if wait <= 0 or self._held_chars >= TEXT_BATCH_CHARS:
            await self.flush()
        elif self._timer is None:
            self._timer = loop.call_later(wait, self._flush_later)

    async def message(self, message: ChatMessage) -> None:
        await self.flush()
        event = MessageAdded(turn_id=self.turn_id, message=message)
        await self.sender.send(WORK_ORDER_PROGRESS, event.wire(), durable=True)

    async def tool(self, call: ToolCall, state: str, depth: int, result: str | None = None) -> None:
        await self.flush()
        event = ToolActivity(
            turn_id=self.turn_id,
            call_id=call.id,
            name=call.name,
            state=state,
            arguments=call.arguments if state == "start" else None,
            result=result,
            depth=depth,
        )
        await self.sender.send(WORK_ORDER_PROGRESS, event.wire(), durable=False)

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
        event = TextDelta(turn_id=self.turn_id, text=text, depth=self._held_depth)
        # Queued for the socket before this returns (no await in between), so in order.
        await self.sender.send(WORK_ORDER_PROGRESS, event.wire(), durable=False)

    def _flush_later(self) -> None:
        self._timer = None
        self.sender.spawn(self.flush())
