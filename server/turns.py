"""The turn lifecycle: submit, abort, progress, complete, and ending each turn exactly once.

A submitted turn is stored ``queued`` and the dispatcher starts it on a drone with room (at
once, when one is free). Turns live in the store, whose conditional update makes the first
terminal write win; the live text and aborts in flight are in the relays' shared live state. A
relay keeps in memory only the turns run by drones connected to it (``live``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

import socketio

from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORT_WORK_ORDER,
    ABORTED,
    DRONE_OFFLINE,
    NO_ACTIVE_WORK_ORDER,
    TURN_ENDED,
    TURN_STARTED,
    UNKNOWN_TURN,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    AbortOrder,
    AbortWorkOrderRequest,
    ChatMessage,
    Completion,
    EndReason,
    MessageAdded,
    SubmitWorkOrder,
    TextDelta,
    ToolActivity,
    TurnEnded,
    TurnStatus,
    session_title,
)

from . import queue
from .accounts import User
from .directory import DRONE_CALL_TIMEOUT, DroneDirectory
from .dispatch import Dispatcher
from .live_state import DroneRoute, LiveState
from .metrics import RelayMetrics
from .reaper import Reaper
from .rooms import Rooms
from .store import Ending, SessionRecord, TurnRecord, TurnStore

log = logging.getLogger("hangar.relay")

TURN_ENDED_ALREADY = "The turn has already ended."
NO_LONGER_RUN = Ending("error", "The drone restarted and no longer runs this turn.", "drone_lost")
QUEUE_LIMIT = 20
"""Turns one person may have waiting at once."""


def queue_full(limit: int) -> str:
    return f"You have {limit} work orders waiting; cancel some or wait for them to start."


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass
class LiveTurn:
    """A processing turn run by a drone connected to this relay."""

    turn_id: str
    session_id: str
    owner: str
    drone_id: str


class TurnLifecycle:
    def __init__(
        self,
        store: TurnStore,
        live_state: LiveState,
        directory: DroneDirectory,
        rooms: Rooms,
        reaper: Reaper,
        dispatcher: Dispatcher,
        metrics: RelayMetrics,
        *,
        queue_limit: int = QUEUE_LIMIT,
    ) -> None:
        self.store = store
        self.live_state = live_state
        self.directory = directory
        self.rooms = rooms
        self.reaper = reaper
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.queue_limit = queue_limit
        self.live: dict[str, LiveTurn] = {}
        """Turns run by drones connected to this relay."""
        self.abort_asked_by: dict[str, str] = {}
        """Who asked (through this relay) to abort a turn still processing."""

    # ---- browsers

    async def submit(self, viewer: User, sid: str, request: SubmitWorkOrder) -> dict[str, Any]:
        owner = viewer.user_id
        if request.session_id is not None:
            session = await self.store.get_session(request.session_id)
            if session is None or session.owner != owner:
                return {"ok": False, "error": "Unknown session."}
        else:
            session = SessionRecord(new_id("s"), owner, session_title(request.prompt))
            await self.store.create_session(session)
        if await queue.queued_count(self.store, owner) >= self.queue_limit:
            return {"ok": False, "error": queue_full(self.queue_limit)}
        turn = TurnRecord(
            turn_id=new_id("t"),
            session_id=session.session_id,
            owner=owner,
            prompt=request.prompt,
            status="queued",
            wanted_drone=request.drone_id,
            messages=[ChatMessage(role="user", content=request.prompt)],
        )
        await self.store.create_turn(turn)
        await self.rooms.join_session(sid, session.session_id)
        await self.rooms.to_session(session.session_id, TURN_STARTED, turn.view().wire())
        await self.rooms.send_sessions(owner)
        if request.mode == "interrupt":
            for running in await self.store.processing_turns(session_id=session.session_id):
                await self.abort(viewer, AbortWorkOrderRequest(turn_id=running.turn_id))
        self.dispatcher.wake()
        return {"ok": True, "turnId": turn.turn_id, "sessionId": session.session_id}

    async def abort(self, viewer: User, request: AbortWorkOrderRequest) -> tuple[bool, str]:
        """Abort a queued turn at once, or tell the drone running it (the intent is kept)."""
        turn = await self._abort_target(viewer, request)
        if isinstance(turn, str):
            return False, turn
        if turn.status == "queued" and request.mode == "now":
            ending = Ending("aborted", ABORTED, "aborted", ended_by=viewer.name)
            if await self.end_turn(turn.turn_id, ending, from_statuses=("queued",)):
                log.info("abort turn=%s before it started", turn.turn_id)
                return True, ABORT_SIGNALED
            turn = await self.store.get_turn(turn.turn_id, messages=False) or turn  # it started
        if turn.status != "processing":
            return False, NO_ACTIVE_WORK_ORDER
        self.abort_asked_by[turn.turn_id] = viewer.name
        self.dispatcher.background.spawn(queue.request_abort(self.store, turn.turn_id, viewer.name))
        route = self.directory.here(turn.drone_id or "") or (
            await self.live_state.drone(turn.drone_id) if turn.drone_id else None
        )
        if route is None:
            return False, DRONE_OFFLINE
        return await self._tell_drone(turn.turn_id, route, request.mode)

    async def _abort_target(self, viewer: User, request: AbortWorkOrderRequest) -> TurnRecord | str:
        """The turn an abort is for, or why there is none. Someone else's turn is refused as
        an unknown one: a refusal tells nothing of others."""
        if request.turn_id is None:
            owner = None if viewer.admin and request.session_id else viewer.user_id
            mine = await self.store.processing_turns(owner=owner, session_id=request.session_id)
            if not mine:
                return NO_ACTIVE_WORK_ORDER
            return mine[-1]
        live = self.live.get(request.turn_id)
        if live is not None and self.directory.here(live.drone_id) is not None:
            # The turn's drone is connected here: no store round trip before the drone's answer.
            if not viewer.may_see(live.owner):
                return UNKNOWN_TURN
            return TurnRecord(
                live.turn_id, live.session_id, live.owner, "", "processing", drone_id=live.drone_id
            )
        turn = await self.store.get_turn(request.turn_id, messages=False)
        if turn is None or not viewer.may_see(turn.owner):
            return UNKNOWN_TURN
        return turn

    async def _tell_drone(self, turn_id: str, route: DroneRoute, mode: str) -> tuple[bool, str]:
        requested_at = time.monotonic()
        await self.live_state.abort_started(turn_id)
        order = AbortOrder(turn_id=turn_id, mode="after_step" if mode == "after_step" else "now")
        try:
            answer = await self.directory.call(ABORT_WORK_ORDER, order.wire(), route)
        except socketio.exceptions.TimeoutError:
            return False, "The drone did not answer the abort."
        except socketio.exceptions.SocketIOError:
            return False, DRONE_OFFLINE
        finally:
            # Marked just before the ack goes out: a completion waiting on it is sent after it.
            await self.live_state.abort_answered(turn_id)
        success, message = _abort_answer(answer)
        self.metrics.abort_latency.observe(time.monotonic() - requested_at)
        log.info(
            "abort turn=%s drone=%s answer=%s %r in %.1f ms",
            turn_id,
            route.drone_id,
            success,
            message,
            (time.monotonic() - requested_at) * 1000,
        )
        if success and mode == "now":
            self.reaper.watch_abort(turn_id)
        return success, message

    # ---- drones

    async def end_drone_turns(self, drone_id: str, ending: Ending) -> None:
        """End every turn the drone runs now, without waiting for it."""
        for turn in await self.store.processing_turns(drone_id=drone_id):
            await self.end_turn(turn.turn_id, ending)

    async def drone_joined(self, route: DroneRoute, running: list[str]) -> list[str]:
        """Register a drone and agree with it on what it runs (on every connect and reconnect).

        Returns the turns the drone must abort: ones it runs that ended meanwhile (the relay
        ended them while it was away or frozen) or whose abort was asked. A turn the store has
        on it that it no longer runs (it restarted) ends now, unless its order may still be on
        its way.
        """
        stored = {t.turn_id: t for t in await self.store.processing_turns(drone_id=route.drone_id)}
        to_abort = [t for t in running if t not in stored or stored[t].abort_requested_by]
        for turn_id in running:
            self.reaper.forget(turn_id)
        await self.directory.join(route)
        recent = time.time() - DRONE_CALL_TIMEOUT
        for turn in stored.values():
            if turn.turn_id not in running and (turn.started_at or 0) < recent:
                await self.end_turn(turn.turn_id, NO_LONGER_RUN)
        if to_abort:
            log.info("drone=%s is told to abort %d turns", route.drone_id, len(to_abort))
        self.dispatcher.wake()
        return to_abort

    async def abort_on_drone(self, route: DroneRoute, turn_ids: list[str]) -> None:
        """Tell a drone to abort turns (after a reconnect: its zombies, and kept aborts)."""
        for turn_id in turn_ids:
            with contextlib.suppress(socketio.exceptions.SocketIOError):
                await self.directory.call(
                    ABORT_WORK_ORDER, AbortOrder(turn_id=turn_id).wire(), route
                )

    async def drone_left(self, route: DroneRoute) -> None:
        """A drone's connection closed: its turns end unless it comes back in time."""
        if await self.directory.leave(route):
            for turn in await self.store.processing_turns(drone_id=route.drone_id):
                self.reaper.watch_orphan(turn.turn_id, route.drone_id)
        await self.directory.broadcast()

    async def progress(
        self, drone_id: str, event: TextDelta | MessageAdded | ToolActivity
    ) -> dict[str, Any]:
        live = await self._attach(drone_id, event.turn_id)
        if isinstance(live, str):
            return {"ok": False, "error": live}
        self.metrics.progress_events.inc()
        payload = event.wire()
        payload["sessionId"] = live.session_id
        if isinstance(event, TextDelta) and event.depth == 0:
            payload["seq"] = await self.live_state.append_text(event.turn_id, event.text)
        elif isinstance(event, MessageAdded):
            await self.store.append_messages(event.turn_id, [event.message])
        await self.rooms.to_session(live.session_id, WORK_ORDER_PROGRESS, payload)
        return {"ok": True}

    async def complete(self, drone_id: str, completion: Completion) -> dict[str, Any]:
        live = await self._attach(drone_id, completion.turn_id)
        if isinstance(live, str):
            log.info("completion ignored turn=%s: %s", completion.turn_id, live)
            return {"ok": False, "error": live}
        status = completion.status
        reason: EndReason = (
            completion.ending.reason if completion.ending is not None else _reason_of(status)
        )
        by = self.abort_asked_by.get(completion.turn_id) if reason == "aborted" else None
        usage = completion.ending.usage if completion.ending is not None else None
        ending = Ending(status, completion.message, reason, ended_by=by, usage=usage)
        await self.end_turn(completion.turn_id, ending)
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
        live = LiveTurn(turn_id, turn.session_id, turn.owner, drone_id)
        return self.live.setdefault(turn_id, live)

    # ---- ending turns

    async def end_turn(
        self,
        turn_id: str,
        ending: Ending,
        from_statuses: tuple[TurnStatus, ...] = ("queued", "processing"),
    ) -> bool:
        """End a turn once: the first terminal write wins, later ones are logged and ignored."""
        text, _ = await self.live_state.text(turn_id)
        ended = await self.store.end_turn(
            turn_id,
            replace(ending, text=text or ending.text),
            from_statuses,
        )
        if ended is None:
            log.info("late end ignored turn=%s status=%s", turn_id, ending.status)
            return False
        self.reaper.forget(turn_id)
        self.live.pop(turn_id, None)
        self.abort_asked_by.pop(turn_id, None)
        await self.live_state.forget_text(turn_id)
        # The abort ack and the completion are separate; the ack goes first.
        await self.live_state.wait_abort_answered(turn_id, DRONE_CALL_TIMEOUT)
        self.metrics.ended(ended.status, ending.reason, ending.usage)
        log.info(
            "turn ended turn=%s drone=%s status=%s reason=%s",
            turn_id,
            ended.drone_id,
            ended.status,
            ending.reason,
        )
        success = ended.status != "error"
        await self.rooms.to_session(
            ended.session_id, WORK_ORDER_COMPLETE, (turn_id, success, ending.result)
        )
        event = TurnEnded(
            turn_id=turn_id,
            session_id=ended.session_id,
            status=ended.status,
            reason=ending.reason,
            result=ending.result,
            ended_by=ended.ended_by,
            usage=ending.usage,
        )
        await self.rooms.to_session(ended.session_id, TURN_ENDED, event.wire())
        await self.rooms.send_sessions(ended.owner)
        await self.directory.broadcast()
        self.dispatcher.wake()  # a slot is free, or the session's next turn may start
        return True

    def keep_live(self, processing: set[str]) -> None:
        for turn_id in [t for t in self.live if t not in processing]:
            del self.live[turn_id]  # ended through another relay


def _reason_of(status: TurnStatus) -> EndReason:
    """Why a turn ended, for a drone that does not say."""
    if status == "finished":
        return "finished"
    return "aborted" if status == "aborted" else "drone_failed"


def _abort_answer(answer: Any) -> tuple[bool, str]:
    if (
        isinstance(answer, (list, tuple))
        and len(answer) == 2
        and isinstance(answer[0], bool)
        and isinstance(answer[1], str)
    ):
        return answer[0], answer[1]
    return False, "The drone gave an invalid answer to the abort."
