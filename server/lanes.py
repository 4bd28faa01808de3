"""Per-turn ordering lanes for one drone connection.

python-socketio runs every event in its own task. Each turn gets a lane: its events run one after
another, in the order the drone sent them (progress, final messages, then completion), while
different turns' lanes go on side by side.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from hangar.shared.protocol import RETRY_LATER

from .limits import QuietLog

log = logging.getLogger("hangar.relay")

Job = Callable[[], Awaitable[dict[str, Any]]]
FAILED = {"ok": False, "error": RETRY_LATER, "retry": True}
"""The ack of an event the relay could not handle (its store or Redis failed): the drone keeps
what must not be lost and sends it again."""
failures = QuietLog(log)


class TurnLanes:
    def __init__(self, name: str) -> None:
        self.name = name
        self.lanes: dict[str, deque[tuple[Job, asyncio.Future[dict[str, Any]]]]] = {}
        self.drains: set[asyncio.Task[None]] = set()

    def run(self, turn_id: str, job: Job) -> asyncio.Future[dict[str, Any]]:
        """Run ``job`` after the turn's earlier events; the future's result is the ack."""
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        lane = self.lanes.get(turn_id)
        if lane is not None:
            lane.append((job, answer))
            return answer
        # One task drains a turn's lane while it has a backlog (measured: a task per event
        # cost the relay a fifth of its throughput).
        lane = self.lanes[turn_id] = deque([(job, answer)])
        drain = asyncio.ensure_future(self._drain(turn_id, lane))
        self.drains.add(drain)
        drain.add_done_callback(self.drains.discard)
        return answer

    async def settle(self) -> None:
        """Wait until every event received so far has been handled."""
        if self.drains:
            await asyncio.wait(list(self.drains))

    async def _drain(
        self, turn_id: str, lane: deque[tuple[Job, asyncio.Future[dict[str, Any]]]]
    ) -> None:
        try:
            while lane:
                job, answer = lane[0]
                try:
                    result = await job()
                except Exception as error:
                    failures.warning(
                        "drone event not handled drone=%s turn=%s (%s: %s); it comes again",
                        self.name,
                        turn_id,
                        type(error).__name__,
                        str(error)[:200],
                    )
                    result = dict(FAILED)
                lane.popleft()
                if not answer.done():
                    answer.set_result(result)
        finally:
            del self.lanes[turn_id]
