"""What drones report on their turns: progress, finished messages, completions, and what they
run when they (re)connect.

A drone and the relay agree on what the drone runs at every connect: turns the relay ended
while the drone was away or frozen are aborted on the drone, and turns the drone no longer runs
end. A drone still streaming a turn that has ended is told to abort it. Text deltas say where
they start in the turn's text, so text sent again after a reconnect is kept once; finished
messages are numbered, so one sent again is stored once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import socketio

from hangar.shared.protocol import (
    ABORT_WORK_ORDER,
    ABORTED,
    UNKNOWN_TURN,
    WORK_ORDER_PROGRESS,
    AbortOrder,
    Completion,
    EndReason,
    MessageAdded,
    TextDelta,
    ToolActivity,
    TurnStatus,
)
from hangar.shared.wire import status_of

from . import queue, sub_agents
from .accounts import Revocation
from .closing import MessageRefused
from .directory import DRONE_CALL_TIMEOUT, SENDS
from .limits import QuietLog
from .live_state import DroneRoute, LiveTurn, LocalLiveState
from .snapshots import shown
from .store import Ending

if TYPE_CHECKING:
    from .turns import TurnLifecycle

log = logging.getLogger("hangar.relay")
text_failures = QuietLog(log)
refusals = QuietLog(log)

TURN_ENDED_ALREADY = "The turn has already ended."
NO_LONGER_RUN = Ending("error", "The drone restarted and no longer runs this turn.", "drone_lost")
PERSON_REMOVED = Ending("aborted", ABORTED, "removed")
MOST_WAITING = 4
"""Calls of a turn kept waiting for approval at once: a drone runs a step's calls one at a time,
so it has one; more would grow every snapshot of the session past what a client reads."""
TOO_MANY_WAITING = f"A turn has at most {MOST_WAITING} tool calls waiting for approval."


def shown_message(payload: dict[str, Any]) -> dict[str, Any]:
    """A ``message`` progress event as browsers get it: long strings cut, saying so."""
    return {**payload, "message": shown(payload["message"])}


class DroneReports:
    def __init__(self, turns: TurnLifecycle) -> None:
        self.turns = turns
        self.store = turns.store
        self.live_state = turns.live_state
        self.directory = turns.directory
        self.rooms = turns.rooms
        self.reaper = turns.reaper
        self.dispatcher = turns.dispatcher
        self.metrics = turns.metrics
        self.live = turns.live
        self.zombies: dict[str, None] = {}
        """Ended turns a drone was told to abort because it still streamed them (recent)."""

    async def person_removed(self, revocation: Revocation) -> None:
        """A removed person's turns end, queued and running alike (on every relay: the first
        ending wins); the drones here running them are told to abort."""
        if revocation.kind != "user":
            return
        turns = await self.store.fetch(
            "SELECT turn_id, drone_id FROM turns"
            " WHERE owner = ? AND status IN ('queued', 'processing')",
            revocation.revoked,
        )
        for turn in turns:
            await self.turns.end_turn(turn["turn_id"], PERSON_REMOVED)
            route = self.directory.here(turn["drone_id"] or "")
            if route is not None:
                self.dispatcher.background.spawn(self.abort_on_drone(route, [turn["turn_id"]]))
        if turns:
            log.info("turns of a removed person ended: %d", len(turns))

    async def end_drone_turns(self, drone_id: str, ending: Ending) -> None:
        """End every turn the drone runs now, without waiting for it."""
        for turn in await self.store.processing_turns(drone_id=drone_id):
            await self.turns.end_turn(turn.turn_id, ending)

    async def drone_joined(self, route: DroneRoute, running: list[str]) -> list[str]:
        """Register a drone and agree with it on what it runs (on every connect and reconnect).

        Returns the turns the drone must abort: ones it runs that ended meanwhile (the relay
        ended them while it was away or frozen) or whose abort was asked. A turn the store has
        on it that it no longer runs (it restarted) ends now, unless its order may still be on
        its way (neither accepted through this relay nor sent long enough ago).
        """
        stored = {t.turn_id: t for t in await self.store.processing_turns(drone_id=route.drone_id)}
        to_abort = [t for t in running if t not in stored or stored[t].abort_requested_by]
        for turn_id in running:
            if turn_id in stored:  # a turn the store has on another drone is none of its
                self.reaper.forget(turn_id)
        await queue.accepted(self.store, route.drone_id, [t for t in running if t in stored])
        await self.directory.join(route)
        now = time.time()
        for turn in stored.values():
            if turn.turn_id in running:
                continue
            started = turn.started_at or 0
            accepted = self.turns.accepted.get(turn.turn_id) == route.drone_id
            if accepted or started < now - SENDS * DRONE_CALL_TIMEOUT:
                await self.turns.end_turn(turn.turn_id, NO_LONGER_RUN)
            else:  # its order may still be on its way: see again once it cannot be
                check = partial(self._check_reported, turn.turn_id, route)
                # An order is sent twice at most when no answer comes (``SENDS``).
                wait = SENDS * DRONE_CALL_TIMEOUT + 1
                self.dispatcher.background.later(started + wait - now, check)
        if to_abort:
            log.info("drone=%s is told to abort %d turns", route.drone_id, len(to_abort))
        self.dispatcher.wake()
        return to_abort

    async def _check_reported(self, turn_id: str, route: DroneRoute) -> None:
        """End a turn the store has on a drone that, connected here all along since it came
        back, neither listed it, accepted it nor reported on it (it restarted and lost it)."""
        current = self.directory.here(route.drone_id)
        if turn_id in self.live or current is None or current.sid != route.sid:
            return  # it runs it, or it left again (then the usual endings apply)
        turn = await self.store.get_turn(turn_id, messages=False)
        if turn is not None and turn.status == "processing" and turn.drone_id == route.drone_id:
            await self.turns.end_turn(turn_id, NO_LONGER_RUN)

    async def abort_on_drone(self, route: DroneRoute, turn_ids: list[str]) -> None:
        """Tell a drone to abort turns (after a reconnect: its zombies, and kept aborts)."""
        for turn_id in turn_ids:
            with contextlib.suppress(socketio.exceptions.SocketIOError):
                await self.directory.call(
                    ABORT_WORK_ORDER, AbortOrder(turn_id=turn_id).wire(), route
                )

    async def drone_left(self, route: DroneRoute) -> None:
        """A drone's connection closed: its turns end unless it comes back in time."""
        for turn_id in [t for t, live in self.live.items() if live.drone_id == route.drone_id]:
            del self.live[turn_id]  # attached again when the drone reports on it
        if await self.directory.leave(route):
            for turn in await self.store.processing_turns(drone_id=route.drone_id):
                self.reaper.watch_orphan(turn.turn_id, route.drone_id)
        await self.directory.broadcast()

    async def progress(
        self, drone_id: str, event: TextDelta | MessageAdded | ToolActivity
    ) -> dict[str, Any]:
        live = await self._attach(drone_id, event.turn_id)
        if isinstance(live, str):
            if live == TURN_ENDED_ALREADY and isinstance(event, TextDelta) and event.depth == 0:
                await self._fill_ended(event)
            self._stop_zombie(drone_id, event.turn_id, live)
            return {"ok": False, "error": live}
        self.metrics.progress_events.inc()
        payload = event.wire()
        payload["sessionId"] = live.session_id
        if isinstance(event, TextDelta) and event.depth == 0:
            text = self._new_text(live, event)
            if not text:
                return {"ok": True}  # sent again after a reconnect: the relay has it
            payload["text"], payload["at"] = text, live.units
            live.units += utf16_length(text)
            try:
                payload["seq"] = await self.live_state.append_text(event.turn_id, text)
            except Exception as error:  # Redis failing: browsers still see it; the store keeps
                text_failures.warning(  # the messages' text
                    "live text not kept turn=%s (%s: %s)",
                    event.turn_id,
                    type(error).__name__,
                    str(error)[:200],
                )
        elif isinstance(event, MessageAdded):
            try:
                if not await self.store.add_message(event.turn_id, event.message, event.number):
                    self.live.pop(event.turn_id, None)
                    return {"ok": False, "error": TURN_ENDED_ALREADY}
            except MessageRefused as refusal:
                return refused(drone_id, event.turn_id, refusal)
            self.reaper.still_delivering(event.turn_id)
            payload = shown_message(payload)
        elif isinstance(event, ToolActivity):
            # A call waiting for a person is kept, so a page opened now shows it too.
            waiting = event.wire() if event.state == "waiting" else None
            if waiting is None:
                changed = live.waiting.pop(event.call_id, None) is not None
            else:
                changed = event.call_id not in live.waiting
                if changed and len(live.waiting) >= MOST_WAITING:
                    refusals.warning("too many calls waiting turn=%s", event.turn_id)
                    return {"ok": False, "error": TOO_MANY_WAITING}
                live.waiting[event.call_id] = waiting
            await self.live_state.set_waiting(event.turn_id, event.call_id, waiting)
            if changed:  # the session's line says how many calls wait for its person
                self.rooms.moved(live.session_id)
        kept = None if isinstance(event, MessageAdded) else sub_agents.kept_event(payload)
        if kept is not None and (number := await self._keep(event.turn_id, kept)):
            payload["subSeq"] = number
        await self.rooms.to_session(live.session_id, WORK_ORDER_PROGRESS, payload)
        return {"ok": True}

    async def _keep(self, turn_id: str, kept: dict[str, Any]) -> int | None:
        """Keep a sub-agent's event for snapshots, within the turn's bound: its number among
        the turn's kept events, or None."""
        size = sum(len(v) for v in kept.values() if isinstance(v, str))
        try:
            return await self.live_state.keep_sub_agent(
                turn_id, kept, size, sub_agents.MAX_KEPT_CHARS
            )
        except Exception as error:  # Redis failing: browsers open now still see it
            text_failures.warning(
                "sub-agent output not kept turn=%s (%s: %s)",
                turn_id,
                type(error).__name__,
                str(error)[:200],
            )
            return None

    @staticmethod
    def _new_text(live: LiveTurn, event: TextDelta) -> str:
        """The part of a text delta the relay lacks (all of it from a drone that sends no
        offset). A drone sends a turn's whole text again after a reconnect; a gap (the relay
        lost what its live state held) is bridged, not waited for."""
        text = event.text
        if event.at is None:
            live.said += len(text)
        elif event.at <= live.said:
            text = text[live.said - event.at :]
            live.said = max(live.said, event.at + len(event.text))
        else:
            live.said = event.at + len(text)
        return text

    async def _fill_ended(self, event: TextDelta) -> None:
        """Keep the text its drone sends again, as it reconnects, of a turn a relay ended while
        the drone was away without the text that had streamed (the relay kept it in memory, and
        restarted since the turn started; or Redis came back empty, and the drone's relay had
        died): what the ending lacked. A relay that streamed the turn, or a Redis that kept its
        text, had all the person saw: what the drone streamed after the ending is not kept."""
        local = isinstance(self.live_state, LocalLiveState)
        lost_at = self.reaper.started_at if local else self.reaper.emptied_at
        turn = await self.store.get_turn(event.turn_id)
        started = turn.started_at if turn is not None else None
        if turn is None or started is None or started >= lost_at:
            return
        if event.at and len(turn.text) != event.at:
            return  # a later piece of a text it sends again: after the piece that came first
        whole = turn.text + event.text if event.at else event.text
        if await self.store.fill_text(event.turn_id, whole):
            log.info("turn=%s: the text its drone sent again is stored", event.turn_id)

    def _stop_zombie(self, drone_id: str, turn_id: str, why: str) -> None:
        """A drone streaming a turn that has ended (the relay ended it while the drone was away
        or frozen) is told to abort it, once."""
        route = self.directory.here(drone_id)
        if why != TURN_ENDED_ALREADY or route is None or turn_id in self.zombies:
            return
        self.zombies[turn_id] = None
        while len(self.zombies) > 1000:
            del self.zombies[next(iter(self.zombies))]
        log.info("drone=%s still runs ended turn=%s: told to abort it", drone_id, turn_id)
        self.dispatcher.background.spawn(self.abort_on_drone(route, [turn_id]))

    async def complete(self, drone_id: str, completion: Completion) -> dict[str, Any]:
        live = await self._attach(drone_id, completion.turn_id)
        if isinstance(live, str):
            log.info("completion ignored turn=%s: %s", completion.turn_id, live)
            return {"ok": False, "error": live}
        status = completion.status
        reason: EndReason = (
            completion.ending.reason if completion.ending is not None else _reason_of(status)
        )
        if (status_of(reason) == "error") != (status == "error") or reason in RELAYS_OWN:
            log.info("turn=%s ended, not for %s as its drone said", completion.turn_id, reason)
            reason = _reason_of(status)  # success and reason disagree, or a relay's reason
        status = status_of(reason)  # an answer that reads "aborted" is no abort
        by = self.turns.abort_asked_by.get(completion.turn_id) if reason == "aborted" else None
        if reason == "aborted" and by is None:  # asked through another relay
            with contextlib.suppress(Exception):  # Redis failing: the database's note, if any
                by = await self.live_state.abort_asker(completion.turn_id)
        usage = completion.ending.usage if completion.ending is not None else None
        bundled = completion.ending.messages if completion.ending is not None else None
        # The turn's last messages came with it: stored with the ending, and shown first.
        messages = tuple((item.number, item.message) for item in bundled or ())
        ending = Ending(
            status, completion.message, reason, ended_by=by, usage=usage, messages=messages
        )
        try:
            await self.turns.end_turn(completion.turn_id, ending)
        except MessageRefused as refusal:  # the drone sends them again one at a time
            return refused(drone_id, completion.turn_id, refusal)
        return {"ok": True}

    async def _attach(self, drone_id: str, turn_id: str) -> LiveTurn | str:
        """The live turn the drone may report on, or why it may not."""
        live = self.live.get(turn_id)
        if live is not None:
            return live if live.drone_id == drone_id else UNKNOWN_TURN
        turn = await self.store.get_turn(turn_id, messages=False)
        if turn is None or turn.drone_id != drone_id:
            return UNKNOWN_TURN
        if turn.status != "processing":
            return TURN_ENDED_ALREADY
        if turn_id in self.live:
            return self.live[turn_id]
        text, _ = await self.live_state.text(turn_id)
        live = LiveTurn(turn_id, turn.session_id, turn.owner, drone_id)
        live.said, live.units = len(text), utf16_length(text)
        return self.live.setdefault(turn_id, live)


RELAYS_OWN: tuple[EndReason, ...] = ("unanswered", "removed", "relay_restarted")
"""Why only a relay ends a turn (docs/protocol.md): a drone that says so is not believed."""


def refused(drone_id: str, turn_id: str, refusal: MessageRefused) -> dict[str, Any]:
    """The answer to a drone's message that would break its turn's conversation: refused for
    good, nothing stored (the drone's bug, not the relay's: one line, and the turn goes on)."""
    refusals.warning("message refused drone=%s turn=%s: %s", drone_id, turn_id, refusal)
    return {"ok": False, "error": str(refusal)}


def utf16_length(text: str) -> int:
    """The length JavaScript gives ``text`` (characters past U+FFFF count twice)."""
    return len(text.encode("utf-16-le")) // 2


def _reason_of(status: TurnStatus) -> EndReason:
    """Why a turn ended, for a drone that does not say."""
    if status == "finished":
        return "finished"
    return "aborted" if status == "aborted" else "drone_failed"
