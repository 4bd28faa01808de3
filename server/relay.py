"""The relay's core: turns work orders into turns, routes them to drones and ends each exactly once.

Connection objects (``CodeSession``, ``DroneSession``) validate payloads and call in here; this
module owns the live state (who runs what) and is the only place a turn is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import socketio

from shared.protocol import (
    ABORT_WORK_ORDER,
    ABORTED,
    DRONE_NAMESPACE,
    DRONE_OFFLINE,
    DRONES,
    IDE_NAMESPACE,
    NO_ACTIVE_WORK_ORDER,
    NOT_YOUR_TURN,
    SESSIONS,
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
)

from .store import SessionRecord, TurnRecord, TurnStore, session_history

if TYPE_CHECKING:
    from .sessions import DroneSession

log = logging.getLogger("hangar.relay")

DRONE_CALL_TIMEOUT = 10.0


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def session_room(session_id: str) -> str:
    return f"session:{session_id}"


def owner_room(owner: str) -> str:
    return f"owner:{owner}"


@dataclass
class LiveTurn:
    """What the relay keeps in memory while a turn is processing."""

    turn_id: str
    session_id: str
    owner: str
    drone_id: str | None
    text: list[str] = field(default_factory=list)
    abort_acknowledged: bool = False
    abort_in_flight: asyncio.Event | None = None
    watchdog: asyncio.TimerHandle | None = None
    orphaned: asyncio.TimerHandle | None = None


class Relay:
    def __init__(
        self,
        store: TurnStore,
        sio: socketio.AsyncServer,
        *,
        drone_token: str,
        abort_grace: float = 10.0,
        drone_grace: float = 3.0,
    ) -> None:
        self.store = store
        self.sio = sio
        self.drone_token = drone_token
        self.abort_grace = abort_grace
        self.drone_grace = drone_grace
        self.drones: dict[str, DroneSession] = {}
        self.live: dict[str, LiveTurn] = {}
        self.session_turns: dict[str, str] = {}
        """session id -> its processing turn id (one turn at a time per session)."""
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- browsers

    async def submit(self, owner: str, sid: str, request: SubmitWorkOrder) -> dict[str, Any]:
        if request.session_id is not None:
            session = await self.store.get_session(request.session_id)
            if session is None or session.owner != owner:
                return {"ok": False, "error": "Unknown session."}
        else:
            session = SessionRecord(new_id("s"), owner, _title(request.prompt))
            await self.store.create_session(session)
            await self._send_sessions(owner)
        if session.session_id in self.session_turns:
            return {"ok": False, "error": "This session already has a turn in progress."}
        turn_id = new_id("t")
        self.session_turns[session.session_id] = turn_id
        try:
            history = await session_history(self.store, session.session_id)
            drone, refusal = self._pick_drone(request.drone_id)
            turn = TurnRecord(
                turn_id=turn_id,
                session_id=session.session_id,
                owner=owner,
                prompt=request.prompt,
                drone_id=drone.drone_id if drone else None,
                messages=[ChatMessage(role="user", content=request.prompt)],
            )
            await self.store.create_turn(turn)
        except BaseException:
            self.session_turns.pop(session.session_id, None)
            raise
        live = LiveTurn(turn_id, session.session_id, owner, turn.drone_id)
        self.live[turn_id] = live
        await self.sio.enter_room(sid, session_room(session.session_id), namespace=IDE_NAMESPACE)
        await self._to_session(live.session_id, TURN_STARTED, turn.view().wire())
        accepted = {"ok": True, "turnId": turn_id, "sessionId": session.session_id}
        if drone is None:
            await self.end_turn(turn_id, "error", refusal)
            return accepted
        drone.running.add(turn_id)
        await self.broadcast_drones()
        order = WorkOrder(
            turn_id=turn_id, session_id=session.session_id, prompt=request.prompt, history=history
        )
        log.info("work order sent turn=%s drone=%s", turn_id, drone.drone_id)
        try:
            answer = await self.sio.call(
                WORK_ORDER,
                order.wire(),
                to=drone.sid,
                namespace=DRONE_NAMESPACE,
                timeout=DRONE_CALL_TIMEOUT,
            )
        except (TimeoutError, socketio.exceptions.TimeoutError):
            answer = {"ok": False, "error": "The drone did not accept the work order in time."}
        except socketio.exceptions.SocketIOError:
            answer = {"ok": False, "error": "The drone disconnected."}
        if not (isinstance(answer, dict) and answer.get("ok") is True):
            reason = answer.get("error") if isinstance(answer, dict) else None
            await self.end_turn(
                turn_id, "error", str(reason or "The drone refused the work order.")
            )
        return accepted

    async def abort(self, owner: str, request: AbortWorkOrderRequest) -> tuple[bool, str]:
        turn_id = request.turn_id or self._default_turn(owner, request.session_id)
        if turn_id is None:
            return False, NO_ACTIVE_WORK_ORDER
        live = self.live.get(turn_id)
        if live is None:
            turn = await self.store.get_turn(turn_id)
            if turn is None:
                return False, UNKNOWN_TURN
            if turn.owner != owner:
                return False, NOT_YOUR_TURN
            return False, NO_ACTIVE_WORK_ORDER
        if live.owner != owner:
            return False, NOT_YOUR_TURN
        drone = self.drones.get(live.drone_id) if live.drone_id else None
        if drone is None:
            return False, DRONE_OFFLINE
        requested_at = time.monotonic()
        in_flight = live.abort_in_flight = asyncio.Event()
        try:
            answer = await self.sio.call(
                ABORT_WORK_ORDER,
                {"turnId": turn_id},
                to=drone.sid,
                namespace=DRONE_NAMESPACE,
                timeout=DRONE_CALL_TIMEOUT,
            )
        except (TimeoutError, socketio.exceptions.TimeoutError):
            return False, "The drone did not answer the abort."
        except socketio.exceptions.SocketIOError:
            return False, DRONE_OFFLINE
        finally:
            # Set just before the ack goes out; a completion waiting on it is sent after the ack.
            in_flight.set()
        success, message = _abort_answer(answer)
        log.info(
            "abort turn=%s drone=%s answer=%s %r in %.1f ms",
            turn_id,
            drone.drone_id,
            success,
            message,
            (time.monotonic() - requested_at) * 1000,
        )
        if success and turn_id in self.live and not live.abort_acknowledged:
            live.abort_acknowledged = True
            live.watchdog = self._after(self.abort_grace, partial(self._abort_watchdog, turn_id))
        return success, message

    async def open_session(self, owner: str, sid: str, session_id: str) -> dict[str, Any]:
        session = await self.store.get_session(session_id)
        if session is None or session.owner != owner:
            return {"ok": False, "error": "Unknown session."}
        await self.sio.enter_room(sid, session_room(session_id), namespace=IDE_NAMESPACE)
        turns = []
        for turn in await self.store.list_turns(session_id):
            live = self.live.get(turn.turn_id)
            if live is not None and turn.status == "processing":
                turn.text = "".join(live.text)
            turns.append(turn.view().wire())
        view = session.view(self.session_turns.get(session_id)).wire()
        return {"ok": True, "session": view, "turns": turns}

    async def session_views(self, owner: str) -> list[dict[str, Any]]:
        return [
            s.view(self.session_turns.get(s.session_id)).wire()
            for s in await self.store.list_sessions(owner)
        ]

    def drone_views(self) -> list[dict[str, Any]]:
        return [drone.view().wire() for drone in self.drones.values()]

    async def broadcast_drones(self) -> None:
        await self.sio.emit(DRONES, self.drone_views(), namespace=IDE_NAMESPACE)

    # ---- drones

    def drone_joined(self, drone: DroneSession) -> None:
        """Register a drone; turns it still runs (after a reconnect) are attached to it again."""
        previous = self.drones.get(drone.drone_id)
        self.drones[drone.drone_id] = drone
        if previous is not None and previous is not drone:
            previous.replaced = True
        for turn_id in list(drone.running):
            live = self.live.get(turn_id)
            if live is None or live.drone_id != drone.drone_id:
                drone.running.discard(turn_id)
                continue
            if live.orphaned is not None:
                live.orphaned.cancel()
                live.orphaned = None
        log.info("drone online drone=%s running=%d", drone.drone_id, len(drone.running))

    async def drone_left(self, drone: DroneSession) -> None:
        if self.drones.get(drone.drone_id) is drone:
            del self.drones[drone.drone_id]
        log.info("drone offline drone=%s", drone.drone_id)
        if drone.replaced:
            return
        for turn_id in list(drone.running):
            live = self.live.get(turn_id)
            if live is None:
                continue
            if self.drone_grace <= 0:
                await self.end_turn(turn_id, "error", "The drone disconnected.")
            else:
                live.orphaned = self._after(
                    self.drone_grace, partial(self._orphan_timeout, turn_id)
                )
        await self.broadcast_drones()

    def owns(self, drone: DroneSession, turn_id: str) -> str | None:
        """None if ``drone`` may report on ``turn_id``, else the reason it may not."""
        live = self.live.get(turn_id)
        if live is None:
            return UNKNOWN_TURN
        if live.drone_id != drone.drone_id:
            return NOT_YOUR_TURN
        return None

    async def progress(self, event: TextDelta | MessageAdded | ToolActivity) -> None:
        live = self.live.get(event.turn_id)
        if live is None:
            return
        if isinstance(event, TextDelta) and event.depth == 0:
            live.text.append(event.text)
        elif isinstance(event, MessageAdded):
            await self.store.append_messages(event.turn_id, [event.message])
        payload = event.wire()
        payload["sessionId"] = live.session_id
        await self._to_session(live.session_id, WORK_ORDER_PROGRESS, payload)

    async def complete(self, completion: Completion) -> None:
        await self.end_turn(completion.turn_id, completion.status, completion.message)

    # ---- ending turns

    async def end_turn(self, turn_id: str, status: TurnStatus, message: str) -> bool:
        """End a turn once: the first terminal write wins, later ones are logged and ignored."""
        live = self.live.get(turn_id)
        text = "".join(live.text) if live else ""
        won = await self.store.end_turn(turn_id, status, message, text)
        if not won:
            log.info("late end ignored turn=%s status=%s", turn_id, status)
            return False
        if live is not None:
            self._forget(live)
            if live.abort_in_flight is not None:
                # The abort ack and the completion are separate; the ack goes first.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(live.abort_in_flight.wait(), DRONE_CALL_TIMEOUT)
            session_id = live.session_id
        else:
            turn = await self.store.get_turn(turn_id)
            session_id = turn.session_id if turn else ""
        log.info("turn ended turn=%s status=%s", turn_id, status)
        success = status != "error"
        await self._to_session(session_id, WORK_ORDER_COMPLETE, (turn_id, success, message))
        if live is not None:
            await self._send_sessions(live.owner)
            await self.broadcast_drones()
        return True

    def _forget(self, live: LiveTurn) -> None:
        self.live.pop(live.turn_id, None)
        if self.session_turns.get(live.session_id) == live.turn_id:
            del self.session_turns[live.session_id]
        for handle in (live.watchdog, live.orphaned):
            if handle is not None:
                handle.cancel()
        drone = self.drones.get(live.drone_id) if live.drone_id else None
        if drone is not None:
            drone.running.discard(live.turn_id)

    async def _abort_watchdog(self, turn_id: str) -> None:
        if await self.end_turn(turn_id, "aborted", ABORTED):
            log.warning("abort watchdog ended turn=%s: no completion from the drone", turn_id)

    async def _orphan_timeout(self, turn_id: str) -> None:
        await self.end_turn(turn_id, "error", "The drone disconnected.")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for live in list(self.live.values()):
            for handle in (live.watchdog, live.orphaned):
                if handle is not None:
                    handle.cancel()

    # ---- internals

    def _pick_drone(self, drone_id: str | None) -> tuple[DroneSession | None, str]:
        if drone_id is not None:
            drone = self.drones.get(drone_id)
            if drone is None:
                return None, f"The drone {drone_id} is offline."
            if drone.busy:
                return None, f"The drone {drone.name} is busy."
            return drone, ""
        if not self.drones:
            return None, "No drone is online."
        idle = [d for d in self.drones.values() if not d.busy]
        if not idle:
            return None, "Every drone is busy."
        return min(idle, key=lambda d: len(d.running) / d.concurrency), ""

    def _default_turn(self, owner: str, session_id: str | None) -> str | None:
        if session_id is not None:
            return self.session_turns.get(session_id)
        mine = [t for t in self.live.values() if t.owner == owner]
        return mine[-1].turn_id if mine else None

    async def _to_session(self, session_id: str, event: str, data: Any) -> None:
        await self.sio.emit(event, data, room=session_room(session_id), namespace=IDE_NAMESPACE)

    async def _send_sessions(self, owner: str) -> None:
        await self.sio.emit(
            SESSIONS,
            await self.session_views(owner),
            room=owner_room(owner),
            namespace=IDE_NAMESPACE,
        )

    def _after(
        self, delay: float, ending: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.TimerHandle:
        """Run ``ending()`` as a task after ``delay`` seconds (cancel the handle to skip it)."""

        def start() -> None:
            task = asyncio.ensure_future(ending())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return asyncio.get_running_loop().call_later(delay, start)


def _abort_answer(answer: Any) -> tuple[bool, str]:
    if (
        isinstance(answer, (list, tuple))
        and len(answer) == 2
        and isinstance(answer[0], bool)
        and isinstance(answer[1], str)
    ):
        return answer[0], answer[1]
    return False, "The drone gave an invalid answer to the abort."


def _title(prompt: str) -> str:
    line = prompt.strip().splitlines()[0] if prompt.strip() else "New session"
    return line[:60] + ("…" if len(line) > 60 else "")
