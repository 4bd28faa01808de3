"""The dispatcher: starts queued turns on drones with room, and tells browsers where the rest
stand in line.

Any relay dispatches any turn to any drone (through another relay when the drone is connected
there); the store's claim is atomic across relays, so each turn starts once and no drone gets
more than its slots. A relay dispatches when a turn is submitted or ends, when a drone comes,
and every second besides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from functools import partial
from typing import Any, Protocol

import socketio

from hangar.shared.protocol import (
    ABORTED,
    DRONE_BUSY,
    DRONE_STOPPING,
    HISTORY_MISS,
    RAN_ALREADY,
    TURN_QUEUED,
    TURN_STARTED,
    WORK_ORDER,
    ChatMessage,
    TurnQueued,
    WorkOrder,
)
from hangar.shared.wire import cut, whole_text

from . import queue, session_tools
from .background import Background
from .directory import DRONE_CALL_TIMEOUT, SENDS, DroneDirectory, DroneMoved
from .histories import Histories, could_be_too_large, too_large
from .limits import QuietLog
from .live_state import DroneRoute, LiveState
from .queue import Place
from .rooms import Rooms
from .store import Ending, TurnRecord, TurnStore

log = logging.getLogger("hangar.relay")

LEFT = "The drone left before it accepted the work order."
"""A drone whose connection closed while its order was on the way never ran it: back in line
(should it have taken it after all, it is told to abort it when it reconnects)."""
REFUSALS_BEFORE_ERROR = 3
"""A turn drones refused as busy, or left, this many times ends in error instead of waiting
again (a drone that is stopping does not count: it gets no more work, the others may take it)."""
REMEMBERED_STOPPING = 1000
UNACCEPTED_AFTER = 2 * SENDS * DRONE_CALL_TIMEOUT + 10
"""Seconds after its claim a turn no drone was seen to take has its order sent again: longer
than the sendings of the relay that claimed it take if it lives (a history the drone lacked
sent again included), and than relays' clocks differ. Then again every ``RESEND_EVERY``."""
RESEND_EVERY = 10.0
COOLING = 1.0
"""Seconds a drone that refused a turn as busy is given no other."""
ANNOUNCE_EVERY = 0.1
"""Queue places go out at most this often (a burst of submits or ends moves many at once)."""
REQUEUE_ATTEMPTS = 600
"""Seconds (one attempt a second) a turn whose work order could not be sent waits for the store
to take it back in line; past that the sweep of a restarted relay ends it."""
failures = QuietLog(log)
ANNOUNCE_RATE = 2000.0
"""Place changes sent per second at most: a long line refreshes less often than a short one."""


class Endings(Protocol):
    async def end_turn(self, turn_id: str, ending: Ending) -> bool: ...

    @property
    def abort_asked_by(self) -> dict[str, str]:
        """Who asked, through this relay, to abort turns still processing."""

    def started(self, turn: TurnRecord) -> None:
        """Its drone accepted the turn's work order."""


class Dispatcher:
    def __init__(
        self,
        store: TurnStore,
        live_state: LiveState,
        directory: DroneDirectory,
        rooms: Rooms,
        background: Background,
    ) -> None:
        self.store = store
        self.live_state = live_state
        self.directory = directory
        self.rooms = rooms
        self.background = background
        self.histories = Histories(store)
        self.endings: Endings | None = None
        self._lock = asyncio.Lock()
        self._woken = False
        self._cooling: dict[str, float] = {}
        self._stopping: OrderedDict[str, None] = OrderedDict()
        """The instances of drones that said they are stopping, or whose token was revoked:
        given nothing until they are gone (one started again under its name is a new one)."""
        self._resending: dict[str, float] = {}
        """Turns whose order was sent again (``_resend_unaccepted``): when to try again."""
        self._refusals: Counter[str] = Counter()
        self._announced: dict[str, Place] = {}
        self._announce_pending = False
        self._announce_wanted = False

    def start(self, endings: Endings) -> None:
        self.endings = endings

    def wake(self) -> None:
        """Dispatch soon, in a task of its own (a turn ended, a drone came, time passed).

        Wakes that come while one waits are one: its claim serves them all.
        """
        if not self._woken:
            self._woken = True
            self.background.spawn(self.dispatch())

    async def dispatch(self) -> None:
        """Start every queued turn a drone can take now; their orders go out in the background."""
        async with self._lock:
            self._woken = False  # a wake from now on needs a claim after this one
            capacity = await self._capacity()
            claimed = await self.store.claim_queued(capacity) if capacity else []
            for turn in claimed:
                self.background.spawn(self._start(turn))
            if claimed:
                await self.directory.broadcast()
        self.announce()

    def stopping(self, instance: str) -> None:
        """A drone process (by its ``instance``) takes no more work until it is gone: it said
        it stops, or its token was revoked."""
        self._stopping[instance] = None
        while len(self._stopping) > REMEMBERED_STOPPING:
            self._stopping.popitem(last=False)

    async def _capacity(self) -> dict[str, int]:
        now = time.monotonic()
        return {
            route.drone_id: route.concurrency
            for route in await self.live_state.drones()
            if self._cooling.get(route.drone_id, 0.0) <= now
            and route.instance not in self._stopping
        }

    async def _note_accepted(self, drone_id: str, turn_id: str) -> None:
        try:
            await queue.accepted(self.store, drone_id, [turn_id])
        except Exception as error:  # then it is sent again once: its drone answers as before
            failures.warning("turn=%s not noted as taken (%s)", turn_id, error)

    async def _start(self, turn: TurnRecord, resent: bool = False) -> None:
        """Send a claimed turn's work order to its drone; put it back in line if refused busy,
        or if the store or Redis failed before the drone had it."""
        try:
            await self._hand_over(turn, resent)
        except Exception as error:
            if resent:  # its drone may have it from the first sending: the next look tries again
                failures.warning("work order not sent again turn=%s (%s)", turn.turn_id, error)
                return
            failures.warning(
                "work order not sent turn=%s (%s: %s); back in line",
                turn.turn_id,
                type(error).__name__,
                str(error)[:200],
            )
            await self._requeue_soon(turn.turn_id)

    async def _requeue_soon(self, turn_id: str, attempt: int = 0) -> None:
        """Put a claimed turn back in line (or end it aborted, if its abort was asked), trying
        again until the store answers (a turn is never left processing on a drone that does
        not have it)."""
        try:
            await self._aborted_instead(turn_id)
        except Exception:
            if attempt < REQUEUE_ATTEMPTS:
                self.background.later(COOLING, partial(self._requeue_soon, turn_id, attempt + 1))
            return
        self.background.later(COOLING, self.dispatch)

    def tick(self) -> None:
        """Every second (the reaper's sweep): dispatch, and send again what no drone took."""
        self.wake()
        self.background.spawn(self._resend_unaccepted())

    async def _resend_unaccepted(self) -> None:
        """Send again, to their drone if it is connected here, the orders of turns claimed
        long ago that no drone was seen to take: their relay died after the claim, before it
        sent them, say. A drone that has one answers as before, one that ran it says so."""
        try:
            rows = await self.store.fetch(queue.UNACCEPTED, time.time() - UNACCEPTED_AFTER)
        except Exception as error:  # the store is down: the next second tries again
            failures.warning("unaccepted turns not read (%s)", error)
            return
        now, turns = time.monotonic(), [TurnRecord.of(row) for row in rows]
        self._resending = {t.turn_id: self._resending.get(t.turn_id, 0.0) for t in turns}
        for turn in turns:
            here = turn.drone_id is not None and self.directory.here(turn.drone_id) is not None
            if here and self._resending[turn.turn_id] <= now:
                log.info("work order turn=%s sent again: no drone took it", turn.turn_id)
                self._resending[turn.turn_id] = now + RESEND_EVERY
                self.background.spawn(self._start(turn, resent=True))

    async def _hand_over(self, turn: TurnRecord, resent: bool = False) -> None:
        assert self.endings is not None and turn.drone_id is not None
        turn.messages = [ChatMessage(role="user", content=turn.prompt)]
        if not resent:
            await self.rooms.to_session(turn.session_id, TURN_STARTED, turn.view().wire())
        route = await self.directory.route(turn.drone_id)
        if route is None:
            if not resent:  # else the sweep ends it, its drone gone
                await self._back_in_line(turn, "The drone left before it got the work order.")
            return
        approved = await session_tools.approved_tools(self.store, turn.session_id)
        order = await self.histories.order(turn, route.drone_id, route.history_cache, approved)
        answer = await self._send(order, route, resent)
        if order.history_base is not None and drone_refusal(answer) == HISTORY_MISS:
            self.histories.forget(route.drone_id, turn.session_id)  # it restarted: all of it
            order = await self.histories.order(turn, route.drone_id, False, approved)
            answer = await self._send(order, route, resent)
        if isinstance(answer, dict) and answer.get("ok") is True:
            self._refusals.pop(turn.turn_id, None)
            self.histories.accepted(route.drone_id, order)
            self.endings.started(turn)
            self.background.spawn(self._note_accepted(route.drone_id, turn.turn_id))
            try:  # so that a person's abort finds it while the database does not answer
                await self.live_state.note_turn(
                    turn.turn_id, turn.owner, turn.session_id, route.drone_id
                )
            except Exception as error:
                failures.warning("turn=%s not noted in Redis (%s)", turn.turn_id, error)
            return
        reason = drone_refusal(answer)
        if reason == RAN_ALREADY:  # it had the first sending: its completion ends the turn
            log.info("work order turn=%s ran on its first sending", turn.turn_id)
            return
        if resent:  # nothing is undone of what the first sending may have started
            log.info("work order turn=%s not taken again: %s", turn.turn_id, reason)
            return
        if reason == DRONE_STOPPING:
            self.stopping(route.instance)
        if reason in (DRONE_BUSY, LEFT, DRONE_STOPPING):
            await self._back_in_line(turn, reason)
            return
        if not await self._aborted_instead(turn.turn_id, back=False):  # its abort was asked
            refusal = reason or "The drone refused the work order."
            await self.endings.end_turn(turn.turn_id, Ending("error", refusal, "drone_failed"))

    async def _send(self, order: WorkOrder, route: DroneRoute, resent: bool = False) -> Any:
        """The drone's answer to ``order`` (``resent``: sent before, as its later sendings are)."""
        order = order.model_copy(update={"resent": True}) if resent else order
        if could_be_too_large(order) and (refusal := await asyncio.to_thread(too_large, order)):
            log.info("work order turn=%s not sent: %s", order.turn_id, refusal)
            return {"ok": False, "error": refusal}  # the drone's connection would close
        log.info(
            "work order sent turn=%s drone=%s history=%d from %d",
            order.turn_id,
            route.drone_id,
            len(order.history),
            order.history_from,
        )
        for attempt in range(SENDS):
            try:
                return await self.directory.call(WORK_ORDER, order.wire(), route, follow=True)
            except socketio.exceptions.TimeoutError as error:
                # Lost on the way (the relays' channel was listening again only just after
                # Redis came back, or the drone's relay died or froze and the drone moved):
                # sent again to where the drone is now; a drone that had it answers as before,
                # one that ran it says so.
                moved = await self.directory.route(route.drone_id)
                if moved is None:
                    return {"ok": False, "error": LEFT}
                route = moved
                if attempt + 1 < SENDS:
                    why = "the drone moved" if isinstance(error, DroneMoved) else "no answer"
                    log.info("work order turn=%s: %s; sent again", order.turn_id, why)
                    order = order.model_copy(update={"resent": True})
            except socketio.exceptions.SocketIOError:
                return {"ok": False, "error": LEFT}
        return {"ok": False, "error": "The drone did not accept the work order in time."}

    async def _back_in_line(self, turn: TurnRecord, why: str) -> None:
        """Put a turn its drone did not take back in line; but a turn whose abort was asked
        ends aborted (its person was told "Abort signaled"), and one refused too often ends in
        error."""
        assert self.endings is not None and turn.drone_id is not None
        self._cooling[turn.drone_id] = time.monotonic() + COOLING
        self._refusals[turn.turn_id] += why != DRONE_STOPPING
        if self._refusals[turn.turn_id] >= REFUSALS_BEFORE_ERROR:
            del self._refusals[turn.turn_id]
            if not await self._aborted_instead(turn.turn_id, back=False):
                await self.endings.end_turn(turn.turn_id, Ending("error", why, "drone_failed"))
            return
        if await self._aborted_instead(turn.turn_id):
            del self._refusals[turn.turn_id]
            return
        log.info("work order back in line turn=%s drone=%s: %s", turn.turn_id, turn.drone_id, why)
        view = turn.view()
        view.status, view.drone_id, view.wanted_drone_id = "queued", None, turn.wanted_drone
        await self.rooms.to_session(turn.session_id, TURN_STARTED, view.wire())
        self.background.later(COOLING, self.dispatch)

    async def _aborted_instead(self, turn_id: str, back: bool = True) -> bool:
        """End aborted a claimed turn whose abort was asked (here, or through another relay, as
        the store says), or put it back in line (if ``back``). True if it is not to be started
        again: it ended aborted here, or had ended meanwhile."""
        assert self.endings is not None
        asked = self.endings.abort_asked_by.get(turn_id)
        if asked is None:
            if back and await queue.requeue(self.store, turn_id):  # not if an abort was asked
                return False
            stored = await self.store.get_turn(turn_id, messages=False)
            if stored is None or stored.status != "processing":
                return True
            asked = stored.abort_requested_by
            if asked is None:
                return False
        log.info("abort turn=%s before its drone took it: ended by the relay", turn_id)
        await self.endings.end_turn(turn_id, Ending("aborted", ABORTED, "aborted", ended_by=asked))
        return True

    # ---- where the others stand

    def announce(self) -> None:
        """Send queued turns' new places, at most every ``ANNOUNCE_EVERY``."""
        self._announce_wanted = True
        if not self._announce_pending:
            self._announce_pending = True
            self.background.later(ANNOUNCE_EVERY, self._announce)

    async def _announce(self) -> None:
        """Each relay tells its own browsers (a place moved by another relay's claim reaches
        them with this relay's next dispatch, within a second), so places never cross Redis."""
        self._announce_wanted = False
        try:
            await self._send_places()
        finally:
            self._announce_pending = False
            if self._announce_wanted:
                self.announce()

    async def _send_places(self) -> None:
        found = await queue.where_queued(self.store, self.live_state)
        watched = {p.session_id for p in found if self.rooms.watched_here(p.session_id)}
        current = {place.turn_id: place for place in found if place.session_id in watched}
        sent = 0
        for place in current.values():
            if self._announced.get(place.turn_id) != place:
                event = TurnQueued(
                    turn_id=place.turn_id,
                    session_id=place.session_id,
                    position=place.position,
                    drone_id=place.drone_id,
                )
                await self.rooms.to_session_here(place.session_id, TURN_QUEUED, event.wire())
                sent += 1
        self._announced = current
        await asyncio.sleep(max(0.0, sent / ANNOUNCE_RATE - ANNOUNCE_EVERY))

    async def place(self, turn_id: str) -> Place | None:
        """Where a queued turn stands now (for a snapshot)."""
        for found in await queue.where_queued(self.store, self.live_state):
            if found.turn_id == turn_id:
                return found
        return None


REFUSAL_CHARS = 4_000
"""The most of a drone's refusal kept as its turn's result (a drone's own results are as long)."""


def drone_refusal(answer: Any) -> str:
    """A drone's reason for not taking an order, as text a turn's result may hold: not a string
    (or nothing to read) is no reason, half a surrogate pair is U+FFFD, a long one is cut."""
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, str) or not error.strip():
        return ""
    return cut(whole_text(error), REFUSAL_CHARS)
