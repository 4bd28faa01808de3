"""What a worker process sends its drone: progress, completions and log records, in order.

Text is batched: text arriving within ``TEXT_BATCH`` of the last frame waits for the next one,
so a burst of chunks becomes one event and the drone decodes one frame for many turns (text
after a quiet spell goes at the end of the loop's pass). Finished messages and log records go
at the end of the loop's pass too, or with the next event; any other event goes at once, with
everything held so far. Any event of a turn goes after the text held for it, so each turn's
order stays as produced. When the drone reads slower than the worker
writes, the pipe fills and the work orders wait (``drain``): streams slow down, nothing piles up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any

from hangar.shared.protocol import ChatMessage, Ending, ToolCall

from .pipes import frame
from .report import TEXT_BATCH

HIGH_WATER = 256 * 1024
"""Bytes written but not yet read by the drone above which work orders wait."""


class Outbox:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._events: list[list[Any]] = []
        self._texts: dict[str, list[Any]] = {}
        """Each turn's text event still open to more text: ["text", turn, depth, parts, chunks]."""
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False
        self._last_flush = -TEXT_BATCH

    @classmethod
    async def open(cls, fd: int) -> Outbox:
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(fd, "wb", buffering=0)
        transport, protocol = await loop.connect_write_pipe(lambda: _PipeProtocol(loop), pipe)
        transport.set_write_buffer_limits(high=HIGH_WATER)
        return cls(asyncio.StreamWriter(transport, protocol, None, loop))

    def text(self, turn_id: str, depth: int, text: str) -> None:
        held = self._texts.get(turn_id)
        if held is not None and held[2] == depth:
            held[3].append(text)
            held[4] += 1
        else:
            held = ["text", turn_id, depth, [text], 1]
            self._events.append(held)
            self._texts[turn_id] = held
        if self._timer is None and not self._soon:
            wait = self._last_flush + TEXT_BATCH - self._loop.time()
            if wait <= 0:  # after a quiet spell: at once (with what the same read brought)
                self._soon = True
                self._loop.call_soon(self.flush)
            else:
                self._timer = self._loop.call_later(wait, self.flush)

    def event(self, event: list[Any], turn_id: str | None = None, at_once: bool = True) -> None:
        """Send ``event`` now, after what the turn produced before it. At once, not at the end
        of the loop's pass: on a saturated worker a pass takes hundreds of milliseconds, and an
        aborted turn's completion should not wait for it.

        Not ``at_once`` (a finished message, a log record): with the next event sent at once,
        or at the end of the loop's pass. A turn's last message and its completion, produced
        together, then reach the drone in one frame, and go to the relay as one event."""
        if turn_id is not None:
            self._texts.pop(turn_id, None)
        self._events.append(event)
        if at_once:
            self.flush()
        elif not self._soon:
            self._soon = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._soon = False
        events, self._events = self._events, []
        self._texts.clear()
        if not events or self.writer.is_closing():
            return
        for event in events:
            if event[0] == "text":
                event[3] = "".join(event[3])
        self.writer.write(frame(events))
        self._last_flush = self._loop.time()

    async def drain(self) -> None:
        """Wait while the drone has much still to read (returns at once otherwise)."""
        if self.writer.transport.get_write_buffer_size() > HIGH_WATER:
            await self.writer.drain()

    async def close(self) -> None:
        """Send what is left, then close the pipe (once the drone has read it all)."""
        self.flush()
        self.writer.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await self.writer.wait_closed()  # raises if the drone is gone: nobody reads it then

    def ship_logs(self, level: int) -> None:
        """Send the worker's log records to the drone, which logs them with its own lines."""
        root = logging.getLogger()
        root.handlers = [_ShippedLogs(self)]
        root.setLevel(level)

    def post_log(self, record: list[Any]) -> None:
        if threading.get_ident() == self._thread:
            self.event(record, at_once=False)
        else:
            self._loop.call_soon_threadsafe(self.event, record)


class _PipeProtocol(asyncio.streams.FlowControlMixin):
    """Flow control for the pipe to the drone, and a way to wait until it is closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._closed: asyncio.Future[None] = loop.create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed


class _ShippedLogs(logging.Handler):
    def __init__(self, outbox: Outbox) -> None:
        super().__init__()
        self.outbox = outbox
        self.setFormatter(logging.Formatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            trace = None
            if record.exc_info is not None:
                assert self.formatter is not None
                trace = self.formatter.formatException(record.exc_info)
            message = record.getMessage()
            self.outbox.post_log(
                ["log", record.name, record.levelno, message, trace, record.created]
            )
        except Exception:
            self.handleError(record)


def relog(event: list[Any]) -> None:
    """In the drone: a worker's log record (``_ShippedLogs``), logged as if it were its own."""
    _, name, level, message, trace, created = event
    record = logging.makeLogRecord(
        {
            "name": name,
            "levelno": level,
            "levelname": logging.getLevelName(level),
            "msg": message,
            "exc_text": trace,
            "created": created,
            "msecs": (created - int(created)) * 1000,
        }
    )
    logging.getLogger(name).handle(record)


class PipeReport:
    """``agent.Report`` of one turn, to the drone through the outbox."""

    def __init__(self, outbox: Outbox, turn_id: str) -> None:
        self.outbox = outbox
        self.turn_id = turn_id

    async def text(self, text: str, depth: int) -> None:
        self.outbox.text(self.turn_id, depth, text)
        await self.outbox.drain()

    async def message(self, message: ChatMessage) -> None:
        self.outbox.event(["message", self.turn_id, message.wire()], self.turn_id, at_once=False)
        await self.outbox.drain()

    async def tool(self, call: ToolCall, state: str, depth: int, result: str | None = None) -> None:
        event = ["tool", self.turn_id, call.wire(), state, depth, result]
        self.outbox.event(event, self.turn_id)
        await self.outbox.drain()


class PipeOutlet:
    """``service.Outlet`` of a worker process."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def report_for(self, turn_id: str) -> PipeReport:
        return PipeReport(self.outbox, turn_id)

    async def complete(self, turn_id: str, success: bool, message: str, ending: Ending) -> None:
        self.outbox.event(["complete", turn_id, success, message, ending.wire()], turn_id)
