"""The turn lifecycle: submit, abort, progress, complete, and ending each turn exactly once.

Turns live in the store, whose conditional update makes the first terminal write win; the live
text and aborts in flight are in the relays' shared live state. A relay keeps in memory only the
turns run by drones connected to it (``live``).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import socketio

from hangar.shared.protocol import (
    ABORT_WORK_ORDER,
    DRONE_OFFLINE,
    NO_ACTIVE_WORK_ORDER,
    TURN_STARTED,
    UNKNOWN_TURN,
    WORK_ORDER,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    AbortWorkOrderRequest,
    ChatMessage,
    Completion,
    MessageAdded,
    SubmitWorkOrder,
    TextDelta,
    ToolActivity,
    TurnStatus,
    WorkOrder,
    session_title,
)

from .accounts import User
from .directory import DRONE_CALL_TIMEOUT, DroneDirectory
from .live_state import DroneRoute, LiveState
from .metrics import RelayMetrics
from .reaper import Reaper
from .rooms import Rooms
from .store import SessionBusyError, SessionRecord, TurnRecord, TurnStore, session_history

log = logging.getLogger("hangar.relay")

TURN_ENDED = "The turn has already ended."
SESSION_BUSY = "This session already has a turn in progress."


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
        metrics: RelayMetrics,
    ) -> None:
        self.store = store
        self.live_state = live_state
        self.directory = directory
        self.rooms = rooms
        self.reaper = reaper
        self.metrics = metrics
        self.live: dict[str, LiveTurn] = {}
        """Turns run by drones connected to this relay."""

    # ---- browsers

    async def submit(self, owner: str, sid: str, request: SubmitWorkOrder) -> dict[str, Any]:
        if request.session_id is not None:
            session = await self.store.get_session(request.session_id)
            if session is None or session.owner != owner:
                return {"ok": False, "error": "Unknown session."}
        else:
            session = SessionRecord(new_id("s"), owner, session_title(request.prompt))
            await self.store.create_session(session)
        history = await session_history(self.store, session.session_id)
        turn_id = new_id("t")
        drone, refusal = await self.directory.pick(request.drone_id)
        if drone is not None:
            # Reserve the slot now, so concurrent submits spread over the drones.
            await self.live_state.add_running(drone.drone_id, turn_id)
        turn = TurnRecord(
            turn_id=turn_id,
            session_id=session.session_id,
            owner=owner,
            prompt=request.prompt,
            drone_id=drone.drone_id if drone else None,
            messages=[ChatMessage(role="user", content=request.prompt)],
        )
        try:
            await self.store.create_turn(turn)
        except BaseException as error:
            if drone is not None:
                await self.live_state.remove_running(drone.drone_id, turn_id)
            if isinstance(error, SessionBusyError):
                return {"ok": False, "error": SESSION_BUSY}
            raise
        await self.rooms.join_session(sid, session.session_id)
        await self.rooms.to_session(session.session_id, TURN_STARTED, turn.view().wire())
        await self.rooms.send_sessions(owner)
        accepted = {"ok": True, "turnId": turn_id, "sessionId": session.session_id}
        if drone is None:
            await self.end_turn(turn_id, "error", refusal)
            return accepted
        await self.directory.broadcast()
        await self._send_order(turn, drone, history)
        return accepted

    async def _send_order(
        self, turn: TurnRecord, drone: DroneRoute, history: list[ChatMessage]
    ) -> None:
        order = WorkOrder(
            turn_id=turn.turn_id, session_id=turn.session_id, prompt=turn.prompt, history=history
        )
        log.info("work order sent turn=%s drone=%s", turn.turn_id, drone.drone_id)
        try:
            answer = await self.directory.call(WORK_ORDER, order.wire(), drone)
        except socketio.exceptions.TimeoutError:
            answer = {"ok": False, "error": "The drone did not accept the work order in time."}
        except socketio.exceptions.SocketIOError:
            answer = {"ok": False, "error": "The drone disconnected."}
        if not (isinstance(answer, dict) and answer.get("ok") is True):
            reason = answer.get("error") if isinstance(answer, dict) else None
            await self.end_turn(
                turn.turn_id, "error", str(reason or "The drone refused the work order.")
            )

    async def abort(self, viewer: User, request: AbortWorkOrderRequest) -> tuple[bool, str]:
        turn_id = request.turn_id
        if turn_id is None:
            owner = None if viewer.admin and request.session_id else viewer.user_id
            mine = await self.store.processing_turns(owner=owner, session_id=request.session_id)
            if not mine:
                return False, NO_ACTIVE_WORK_ORDER
            turn_id = mine[-1].turn_id
        route, refusal = await self._abort_route(viewer, turn_id)
        if route is None:
            return False, refusal
        requested_at = time.monotonic()
        await self.live_state.abort_started(turn_id)
        try:
            answer = await self.directory.call(ABORT_WORK_ORDER, {"turnId": turn_id}, route)
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
        if success:
            self.reaper.watch_abort(turn_id)
        return success, message

    async def _abort_route(self, viewer: User, turn_id: str) -> tuple[DroneRoute | None, str]:
        """Where to send an abort of ``turn_id``, or why there is nowhere to send it.

        Someone else's turn is refused as an unknown one: a refusal tells nothing of others.
        """
        live = self.live.get(turn_id)
        local = self.directory.here(live.drone_id) if live else None
        if live is not None and local is not None:
            # The turn's drone is connected here: answer from memory, no store round trip.
            return (local, "") if viewer.may_see(live.owner) else (None, UNKNOWN_TURN)
        turn = await self.store.get_turn(turn_id, messages=False)
        if turn is None or not viewer.may_see(turn.owner):
            return None, UNKNOWN_TURN
        if turn.status != "processing":
            return None, NO_ACTIVE_WORK_ORDER
        route = await self.live_state.drone(turn.drone_id) if turn.drone_id else None
        return (route, "") if route is not None else (None, DRONE_OFFLINE)

    # ---- drones

    async def drone_joined(self, route: DroneRoute, claimed: list[str]) -> None:
        """Register a drone; the turns it still runs (after a reconnect) stay its own."""
        running = []
        for turn_id in claimed:
            turn = await self.store.get_turn(turn_id, messages=False)
            if turn and turn.status == "processing" and turn.drone_id == route.drone_id:
                running.append(turn_id)
                self.reaper.forget(turn_id)
        await self.directory.join(route, running)

    async def end_drone_turns(self, drone_id: str, status: TurnStatus, message: str) -> None:
        """End every turn the drone runs now, without waiting for it."""
        for turn_id in await self.live_state.running(drone_id):
            await self.end_turn(turn_id, status, message)

    async def drone_left(self, route: DroneRoute) -> None:
        """A drone's connection closed: its turns end unless it comes back in time."""
        if await self.directory.leave(route):
            for turn_id in await self.live_state.running(route.drone_id):
                self.reaper.watch_orphan(turn_id, route.drone_id)
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
        await self.end_turn(completion.turn_id, completion.status, completion.message)
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
            return TURN_ENDED
        live = LiveTurn(turn_id, turn.session_id, turn.owner, drone_id)
        return self.live.setdefault(turn_id, live)

    # ---- ending turns

    async def end_turn(self, turn_id: str, status: TurnStatus, message: str) -> bool:
        """End a turn once: the first terminal write wins, later ones are logged and ignored."""
        text, _ = await self.live_state.text(turn_id)
        if not await self.store.end_turn(turn_id, status, message, text):
            log.info("late end ignored turn=%s status=%s", turn_id, status)
            return False
        self.reaper.forget(turn_id)
        turn: LiveTurn | TurnRecord | None = self.live.pop(turn_id, None)
        if turn is None:
            turn = await self.store.get_turn(turn_id, messages=False)
        assert turn is not None
        if turn.drone_id:
            await self.live_state.remove_running(turn.drone_id, turn_id)
        await self.live_state.forget_text(turn_id)
        # The abort ack and the completion are separate; the ack goes first.
        await self.live_state.wait_abort_answered(turn_id, DRONE_CALL_TIMEOUT)
        self.metrics.work_orders.labels(status).inc()
        log.info("turn ended turn=%s drone=%s status=%s", turn_id, turn.drone_id, status)
        success = status != "error"
        await self.rooms.to_session(
            turn.session_id, WORK_ORDER_COMPLETE, (turn_id, success, message)
        )
        await self.rooms.send_sessions(turn.owner)
        await self.directory.broadcast()
        return True

    def keep_live(self, processing: set[str]) -> None:
        for turn_id in [t for t in self.live if t not in processing]:
            del self.live[turn_id]  # ended through another relay


def _abort_answer(answer: Any) -> tuple[bool, str]:
    if (
        isinstance(answer, (list, tuple))
        and len(answer) == 2
        and isinstance(answer[0], bool)
        and isinstance(answer[1], str)
    ):
        return answer[0], answer[1]
    return False, "The drone gave an invalid answer to the abort."
