"""What the relay's and the drones' own websocket loops share (``server/websocket.py``,
``drone/engine.py``): a silence timer in place of a ``wait_for`` per frame, and a writer that
sends what was queued together in one ``write()``."""

from __future__ import annotations

import asyncio
from typing import Any

READ_RUN = 32
"""Frames a connection's reader hands on before it lets the rest of its process run."""


class Silence:
    """Cancels ``task`` once nothing was heard for ``limit`` seconds (``heard`` says something
    was); ``fired`` tells that cancellation from any other."""

    def __init__(self, task: asyncio.Task[Any], limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = task
        self._limit = limit
        self.last = self._loop.time()
        self.fired = False
        self._timer = self._loop.call_at(self.last + limit, self._check)

    def heard(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        due = self.last + self._limit
        if self._loop.time() >= due:
            self.fired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        self._timer.cancel()


class Corked:
    """``with Corked(frames):`` what aiohttp's frame writer ``frames`` writes meanwhile is kept,
    and written to the socket at once when the block ends (a ``write()`` per frame was the
    largest single cost of a relay sending many frames together)."""

    def __init__(self, frames: Any) -> None:
        self.frames = frames
        self.transport = frames.transport
        self.parts: list[bytes] = []

    def __enter__(self) -> None:
        self.frames.transport = self

    def __exit__(self, *exc: object) -> None:
        self.frames.transport = self.transport
        if self.parts and not self.transport.is_closing():
            self.transport.write(b"".join(self.parts))

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)
