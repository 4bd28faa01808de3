"""The reaper: endings the relay decides itself, so that no turn stays processing.

- the abort watchdog: a drone acknowledged an abort but sent no completion within
  ``abort_grace``; the turn ends aborted;
- orphans: a drone left while running turns and did not come back within ``drone_grace``;
  its turns end in error;
- the sweep: every second, turns no live drone runs (their relay died, this relay restarted)
  end once they have been missing for ``drone_grace``, or ``SILENT_REJOIN`` after their relay
  died (with several relays its drones' entries in Redis last that relay's ``drone_grace``
  unrefreshed); ``REJOIN_WINDOW`` more after Redis was away or came back empty (the drones of a
  relay that died with it were refused meanwhile, and come back at their reconnect's pace).

The sweep's work is proportional to what changed, not to the turns running: it judges presence
once per drone, asks the store only for the processing turns of drones that are not present
(the store walks its index of processing turns for their drones, in the database), and hears
of turns other relays ended from the live state.
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
from .live_state import LiveState, LiveTurn
from .store import Database, Ending, TurnRecord, TurnStore

log = logging.getLogger("hangar.relay")

SWEEP_INTERVAL = 1.0
REJOIN_WINDOW = 5.0
SILENT_REJOIN = 1.0
"""Seconds a drone whose relay died (its entry outlived that relay's grace) has on top to be
back through another relay: it noticed as its entry aged, and reconnects within a second."""
"""Extra seconds drones get to find a relay that has just started (a drone tries again at
least every 3 s) before the turns they ran end as "The relay restarted."."""
failures = QuietLog(log)
DRONE_LOST = Ending("error", "The drone disconnected.", "drone_lost")
RELAY_RESTARTED = Ending("error", "The relay restarted.", "relay_restarted")
RUN_BY = "SELECT DISTINCT drone_id FROM turns WHERE status = 'processing'"
"""The drones the store has processing turns on (one walk of its index of processing turns)."""


async def turns_of_drones(db: Database, drones: list[str | None]) -> list[TurnRecord]:
    """The processing turns (without messages) of ``drones`` (None: turns with no drone),
    oldest first."""
    named = [drone for drone in drones if drone is not None]
    where = [f"drone_id IN ({', '.join('?' for _ in named)})"] if named else []
    where += ["drone_id IS NULL"] if None in drones else []
    if not where:
        return []
    rows = await db.fetch(
        f"SELECT * FROM turns WHERE status = 'processing' AND ({' OR '.join(where)})"
        " ORDER BY created_at",
        *named,
    )
    return [TurnRecord.of(row) for row in rows]


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

    @property
    def live(self) -> dict[str, LiveTurn]:
        """Turns run by drones connected to this relay."""


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
        self.live_state: LiveState = directory.live
        self.later = later
        self.abort_grace = abort_grace
        self.drone_grace = drone_grace
        self.endings: Endings | None = None
        self.started_at = time.time()
        self.outage_at = -REJOIN_WINDOW
        """When the live state last failed or came back empty (``time.monotonic()``)."""
        self.emptied_at = 0.0
        """When Redis was last found to have come back empty (``time.time()``)."""
        self.timers: dict[str, asyncio.TimerHandle] = {}
        """Pending relay-side endings (abort watchdogs and orphaned turns), by turn id."""
        self.delivering: set[str] = set()
        """Turns whose drone said it finished them while an abort watchdog waits for their end."""
        self.stopping = False
        """The relay stops: the drones it drops take their turns elsewhere, or here once it is
        back (another relay's sweep, or its own at its next start, ends those none takes)."""
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

    def watch_abort(self, turn_id: str, finished: bool = False) -> None:
        """End the turn aborted if its drone does not complete it within ``abort_grace``;
        ``finished``: the drone said it runs the turn no more (it is still sending what the turn
        said, its completion last): each message it sends gives it the grace again."""
        if turn_id not in self.timers:
            self._arm_abort_watchdog(turn_id)
            if finished:
                self.delivering.add(turn_id)

    def still_delivering(self, turn_id: str) -> None:
        """The drone of a turn it said it finished sent one of its messages: not lost."""
        if turn_id in self.delivering and (handle := self.timers.pop(turn_id, None)):
            handle.cancel()
            self._arm_abort_watchdog(turn_id)

    def _arm_abort_watchdog(self, turn_id: str) -> None:
        self.timers[turn_id] = self.later(self.abort_grace, partial(self._abort_watchdog, turn_id))

    def watch_orphan(self, turn_id: str, drone_id: str) -> None:
        """End the turn in error if its drone is not back within ``drone_grace``."""
        if self.stopping:
            return
        ending = partial(self._orphan_timeout, turn_id, drone_id)
        self.timers[turn_id] = self.later(self.drone_grace, ending)

    def forget(self, turn_id: str) -> None:
        """The turn ended, or its drone came back: no relay-side ending is due."""
        self.delivering.discard(turn_id)
        if (handle := self.timers.pop(turn_id, None)) is not None:
            handle.cancel()
        self.missing_since.pop(turn_id, None)

    async def _abort_watchdog(self, turn_id: str) -> None:
        self.timers.pop(turn_id, None)
        self.delivering.discard(turn_id)
        assert self.endings is not None
        # Named here too: the database's note of who asked may land after this ending (a lock).
        ending = Ending(
            "aborted", ABORTED, "unanswered", ended_by=self.endings.abort_asked_by.get(turn_id)
        )
        if await self.endings.end_turn(turn_id, ending):
            log.warning("abort watchdog ended turn=%s: no completion from the drone", turn_id)

    async def _orphan_timeout(self, turn_id: str, drone_id: str) -> None:
        self.timers.pop(turn_id, None)
        if await self.directory.present(drone_id):
            return  # the drone came back (maybe to another relay): it said what it still runs
        assert self.endings is not None
        turn = await self.store.get_turn(turn_id, messages=False)
        if turn is None or turn.status != "processing" or turn.drone_id != drone_id:
            return  # it went back in line (its order never reached the drone), or ended
        await self.endings.end_turn(turn_id, lost(turn, DRONE_LOST, self.endings.abort_asked_by))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            self._tick()
            try:
                await self.sweep()
            except Exception as error:  # the store or Redis is down: the next sweep tries again
                self.outage_at = time.monotonic()
                failures.warning("sweep failed (%s: %s)", type(error).__name__, str(error)[:200])

    async def _give_kept_text(self, turn_id: str) -> bool:
        """Store the text this relay kept of a turn another relay ended, where it has more."""
        kept = self.live_state.take_kept(turn_id)
        return bool(kept) and await self.store.fill_text(turn_id, kept)

    async def _check_live_turns(self, since: float) -> None:
        """Forget the live turns here that ended elsewhere while Redis could not say so (it
        failed, or came back empty): their drone, reporting on, is then told to stop."""
        assert self.endings is not None
        live = list(self.endings.live)
        for start in range(0, len(live), 500):
            chunk = live[start : start + 500]
            marks = ", ".join("?" for _ in chunk)
            rows = await self.store.fetch(
                f"SELECT turn_id FROM turns WHERE status <> 'processing' AND turn_id IN ({marks})",
                *chunk,
            )
            for row in rows:
                turn_id = row["turn_id"]
                if self.endings.live.pop(turn_id, None) is None:
                    continue
                # Its ending could not read the text from Redis: this relay has it.
                filled = await self._give_kept_text(turn_id)
                log.info(
                    "turn=%s ended elsewhere while Redis was away%s",
                    turn_id,
                    "; its text stored" if filled else "",
                )
        self.live_state.endings_checked(since)

    async def sweep(self) -> None:
        """End turns no live drone runs any more (its relay died, say) after ``drone_grace``."""
        assert self.endings is not None
        if self.stopping:
            return
        doubt = self.live_state.endings_in_doubt()
        if doubt is not None:  # first, from the store alone: also while Redis is down
            await self._check_live_turns(doubt)
        if await self.live_state.lost_everything():  # Redis restarted empty: what waits here
            self.outage_at, self.emptied_at = time.monotonic(), time.time()
            for turn_id, live in list(self.endings.live.items()):
                for call_id, call in list(live.waiting.items()):
                    await self.live_state.set_waiting(turn_id, call_id, call)
        ended = await self.live_state.ended_elsewhere()
        kept_here = self.live_state.kept_turns() if ended else set()
        for turn_id in ended:
            streamed_here = self.endings.live.pop(turn_id, None) is not None
            await self._give_kept_text(turn_id)
            if streamed_here or turn_id in kept_here:
                # What its drone streamed here after the ending was kept again: dropped now.
                await self.live_state.forget_turn(turn_id, tell_others=False)
        kept = self.live_state.kept_turns()
        if len(kept) > len(self.endings.live):  # streamed here, ended or moved elsewhere
            for turn_id in kept - set(self.endings.live):
                self.live_state.take_kept(turn_id)
        present = set(self.directory.local)
        present.update(route.drone_id for route in await self.live_state.drones())
        run_by = [row["drone_id"] for row in await self.store.fetch(RUN_BY)]
        gone = [drone for drone in run_by if drone not in present]
        turns = await turns_of_drones(self.store, gone) if gone else []
        # A drone whose relay died has been silent for as long as that relay's grace already.
        silent = await self.live_state.silent_drones() if turns else set()
        now = time.monotonic()
        missing = {turn.turn_id: self.missing_since.get(turn.turn_id, now) for turn in turns}
        self.missing_since = missing
        for turn in turns:
            if turn.turn_id in self.timers:
                continue
            restarted = turn.created_at < self.started_at
            waited = now - missing[turn.turn_id]
            grace = SILENT_REJOIN if turn.drone_id in silent else self.drone_grace
            rejoin = restarted or now - self.outage_at < REJOIN_WINDOW + grace
            if waited >= grace + (REJOIN_WINDOW if rejoin else 0.0):
                ending = RELAY_RESTARTED if restarted else DRONE_LOST
                await self.endings.end_turn(
                    turn.turn_id, lost(turn, ending, self.endings.abort_asked_by)
                )
