"""Background work of a relay: tasks it starts and must cancel when it closes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

Later = Callable[[float, Callable[[], Coroutine[Any, Any, None]]], asyncio.TimerHandle]


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task kept until it is done (or the relay closes)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def later(
        self, delay: float, work: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.TimerHandle:
        """Run ``work()`` as a task after ``delay`` seconds (cancel the handle to skip it)."""
        return asyncio.get_running_loop().call_later(delay, lambda: self.spawn(work()))

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
