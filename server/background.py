"""Background work of a relay: tasks it starts and must cancel when it closes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .limits import QuietLog

log = logging.getLogger("hangar.relay")
failures = QuietLog(log)

Later = Callable[[float, Callable[[], Coroutine[Any, Any, None]]], asyncio.TimerHandle]


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._prune_at = 64
        """How many timers may be kept before those cancelled are dropped (twice those left)."""
        self._closed = False

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task kept until it is done (or the relay closes)."""
        if self._closed:
            work.close()  # the relay is closing: nothing new starts
            return
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Its store or Redis failed: the sweep and the next dispatch pick the work up again.
            failures.warning(
                "background work failed (%s: %s)", type(error).__name__, str(error)[:200]
            )

    def later(
        self, delay: float, work: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.TimerHandle:
        """Run ``work()`` as a task after ``delay`` seconds (cancel the handle to skip it)."""

        def start() -> None:
            self._timers.discard(handle)
            self.spawn(work())

        handle = asyncio.get_running_loop().call_later(delay, start)
        self._timers.add(handle)
        if len(self._timers) >= self._prune_at:  # a handle cancelled by its owner stays here
            self._timers = {timer for timer in self._timers if not timer.cancelled()}
            self._prune_at = max(64, 2 * len(self._timers))
        return handle

    async def close(self) -> None:
        """Cancel what is pending and wait (briefly) for what runs to unwind."""
        self._closed = True
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=0.5)
