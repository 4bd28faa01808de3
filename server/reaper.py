"""The reaper: endings the relay decides itself, so that no turn stays processing.

- the abort watchdog: a drone acknowledged an abort but sent no completion within
  ``abort_grace``; the turn ends aborted;
- orphans: a drone left while running turns and did not come back within ``drone_grace``;
  its turns end in error;
- the sweep: every second, turns no live drone runs (their relay died, this relay restarted)
  end once they have been missing for ``drone_grace``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

from hangar.shared.protocol import ABORTED

from .background import Later
from .directory import DroneDirectory
from .limits import QuietLog
from .store import Ending, TurnRecord, TurnStore

log = logging.getLogger("hangar.relay")

SWEEP_INTERVAL = 1.0
REJOIN_WINDOW = 5.0
"""Extra seconds drones get to find a relay that has just started (a drone tries again at
least every 3 s) before the turns they ran end as "The relay restarted."."""
failures = QuietLog(log)
DRONE_LOST = Ending("error", "The drone disconnected.", "drone_lost")
RELAY_RESTARTED = Ending("error", "The relay restarted.", "relay_restarted")


def lost(turn: TurnRecord | None, ending: Ending, asked_here: dict[str, str]) -> Ending:
    """How a turn whose drone is gone ends: as ``ending``, or aborted if someone had asked to
    abort it (the person's abort is honoured, not turned into an error)."""
    by = asked_here.get(turn.turn_id) if turn is not None else None
    by = by or (turn.abort_requested_by if turn is not None else None)
    if by is None:
        return ending
    return Ending("aborted", ABORTED, "unanswered", ended_by=by)


class Endings(Protocol):
    """What the reaper needs of the turn lifecycle."""

    async def end_turn(self, turn_id: str, ending: Ending) -> bool: ...

    @property
    def abort_asked_by(self) -> dict[str, str]:
        """Who asked, through this relay, to abort turns still processing."""

    def keep_live(self, processing: set[str]) -> None:
        """Forget live turns not in ``processing`` (another relay ended them)."""


class Reaper:
    def __init__(
        self,
        store: TurnStore,
        directory: DroneDirectory,
        later: Later,
        *,
        abort_grace: float,
        drone_grace: float,
    ) -> None:
        self.store = store
        self.directory = directory
        self.later = later
        self.abort_grace = abort_grace
        self.drone_grace = drone_grace
        self.endings: Endings | None = None
        self.started_at = time.time()
        self.timers: dict[str, asyncio.TimerHandle] = {}
        """Pending relay-side endings (abort watchdogs and orphaned turns), by turn id."""
        self.missing_since: dict[str, float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._tick: Callable[[], None] = lambda: None

    def start(self, endings: Endings, tick: Callable[[], None] = lambda: None) -> None:
        """Begin the sweep; ``tick`` runs with every sweep (the dispatcher's safety net)."""
        self.endings = endings
        self._tick = tick
        self._sweeper = asyncio.ensure_future(self._sweep_forever())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for handle in self.timers.values():
            handle.cancel()

    def watch_abort(self, turn_id: str) -> None:
        """End the turn aborted if its drone does not complete it within ``abort_grace``."""
        if turn_id not in self.timers:
            self.timers[turn_id] = self.later(
                self.abort_grace, partial(self._abort_watchdog, turn_id)
            )

    def watch_orphan(self, turn_id: str, drone_id: str) -> None:
        """End the turn in error if its drone is not back within ``drone_grace``."""
        ending = partial(self._orphan_timeout, turn_id, drone_id)
        self.timers[turn_id] = self.later(self.drone_grace, ending)

    def forget(self, turn_id: str) -> None:
        """The turn ended, or its drone came back: no relay-side ending is due."""
        if (handle := self.timers.pop(turn_id, None)) is not None:
            handle.cancel()
        self.missing_since.pop(turn_id, None)

    async def _abort_watchdog(self, turn_id: str) -> None:
        self.timers.pop(turn_id, None)
        assert self.endings is not None
        if await self.endings.end_turn(turn_id, Ending("aborted", ABORTED, "unanswered")):
            log.warning("abort watchdog ended turn=%s: no completion from the drone", turn_id)

    async def _orphan_timeout(self, turn_id: str, drone_id: str) -> None:
        self.timers.pop(turn_id, None)
        if await self.directory.present(drone_id):
            return  # the drone came back (maybe to another relay): it said what it still runs
        assert self.endings is not None
        turn = await self.store.get_turn(turn_id, messages=False)
        await self.endings.end_turn(turn_id, lost(turn, DRONE_LOST, self.endings.abort_asked_by))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            self._tick()
            try:
                await self.sweep()
            except Exception as error:  # the store or Redis is down: the next sweep tries again
                failures.warning("sweep failed (%s: %s)", type(error).__name__, str(error)[:200])

    async def sweep(self) -> None:
        """End turns no live drone runs any more (its relay died, say) after ``drone_grace``."""
        assert self.endings is not None
        turns = await self.store.processing_turns()
        self.endings.keep_live({turn.turn_id for turn in turns})
        now = time.monotonic()
        for turn in turns:
            if turn.turn_id in self.timers:
                continue
            if await self.directory.present(turn.drone_id):
                self.missing_since.pop(turn.turn_id, None)
                continue
            first = self.missing_since.setdefault(turn.turn_id, now)
            restarted = turn.created_at < self.started_at
            if now - first >= self.drone_grace + (REJOIN_WINDOW if restarted else 0.0):
                ending = RELAY_RESTARTED if restarted else DRONE_LOST
                await self.endings.end_turn(
                    turn.turn_id, lost(turn, ending, self.endings.abort_asked_by)
                )
