"""The relay's core: turns work orders into turns, routes them to drones and ends each exactly once.

Connection objects (``CodeSession``, ``DroneSession``) validate payloads and call in here. Turns
live in the store, whose conditional update makes the first terminal write win; what several
relays must share besides (drone presence, live text, aborts in flight) is in the ``Cluster``.
A relay keeps in memory only what concerns the drones connected to it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
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
    DroneView,
    MessageAdded,
    SubmitWorkOrder,
    TextDelta,
    ToolActivity,
    TurnStatus,
    WorkOrder,
)

from .cluster import Cluster, DroneRoute
from .metrics import RelayMetrics
from .store import SessionBusyError, SessionRecord, TurnRecord, TurnStore, session_history

if TYPE_CHECKING:
    from .sessions import DroneSession

log = logging.getLogger("hangar.relay")

DRONE_CALL_TIMEOUT = 10.0
SWEEP_INTERVAL = 1.0
DRONES_COALESCE = 0.25
TURN_ENDED = "The turn has already ended."
SESSION_BUSY = "This session already has a turn in progress."


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def session_room(session_id: str) -> str:
    return f"session:{session_id}"


def owner_room(owner: str) -> str:
    return f"owner:{owner}"


@dataclass
class LiveTurn:
    """A processing turn run by a drone connected to this relay."""

    turn_id: str
    session_id: str
    owner: str
    drone_id: str


class Relay:
    def __init__(
        self,
        store: TurnStore,
        sio: socketio.AsyncServer,
        cluster: Cluster,
        *,
        drone_token: str,
        abort_grace: float = 10.0,
        drone_grace: float = 3.0,
    ) -> None:
        self.store = store
        self.sio = sio
        self.cluster = cluster
        self.drone_token = drone_token
        self.abort_grace = abort_grace
        self.drone_grace = drone_grace
        self.drones: dict[str, DroneSession] = {}
        """Drones connected to this relay."""
        self.live: dict[str, LiveTurn] = {}
        """Turns run by drones connected to this relay."""
        self.timers: dict[str, asyncio.TimerHandle] = {}
        """Pending relay-side endings: abort watchdogs and orphaned turns, by turn id."""
        self.missing_since: dict[str, float] = {}
        self.metrics = RelayMetrics()
        self.started_at = time.time()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._drones_pending = False

    async def start(self) -> None:
        await self.cluster.start()
        self._sweeper = asyncio.ensure_future(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for handle in self.timers.values():
            handle.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.cluster.close()

    # ---- browsers

    async def submit(self, owner: str, sid: str, request: SubmitWorkOrder) -> dict[str, Any]:
        if request.session_id is not None:
            session = await self.store.get_session(request.session_id)
            if session is None or session.owner != owner:
                return {"ok": False, "error": "Unknown session."}
        else:
            session = SessionRecord(new_id("s"), owner, _title(request.prompt))
            await self.store.create_session(session)
        history = await session_history(self.store, session.session_id)
        turn_id = new_id("t")
        drone, refusal = await self._pick_drone(request.drone_id)
        if drone is not None:
            # Reserve the slot now, so concurrent submits spread over the drones.
            await self.cluster.add_running(drone.drone_id, turn_id)
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
                await self.cluster.remove_running(drone.drone_id, turn_id)
            if isinstance(error, SessionBusyError):
                return {"ok": False, "error": SESSION_BUSY}
            raise
        await self.sio.enter_room(sid, session_room(session.session_id), namespace=IDE_NAMESPACE)
        await self._to_session(session.session_id, TURN_STARTED, turn.view().wire())
        await self._send_sessions(owner)
        accepted = {"ok": True, "turnId": turn_id, "sessionId": session.session_id}
        if drone is None:
            await self.end_turn(turn_id, "error", refusal)
            return accepted
        await self.broadcast_drones()
        order = WorkOrder(
            turn_id=turn_id, session_id=session.session_id, prompt=request.prompt, history=history
        )
        log.info("work order sent turn=%s drone=%s", turn_id, drone.drone_id)
        try:
            answer = await self._call_drone(WORK_ORDER, order.wire(), drone)
        except socketio.exceptions.TimeoutError:
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
        turn_id = request.turn_id
        if turn_id is None:
            mine = await self.store.processing_turns(owner=owner, session_id=request.session_id)
            if not mine:
                return False, NO_ACTIVE_WORK_ORDER
            turn_id = mine[-1].turn_id
        route, refusal = await self._abort_route(owner, turn_id)
        if route is None:
            return False, refusal
        requested_at = time.monotonic()
        await self.cluster.abort_started(turn_id)
        try:
            answer = await self._call_drone(ABORT_WORK_ORDER, {"turnId": turn_id}, route)
        except socketio.exceptions.TimeoutError:
            return False, "The drone did not answer the abort."
        except socketio.exceptions.SocketIOError:
            return False, DRONE_OFFLINE
        finally:
            # Marked just before the ack goes out: a completion waiting on it is sent after it.
            await self.cluster.abort_answered(turn_id)
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
        if success and turn_id not in self.timers:
            self.timers[turn_id] = self._after(
                self.abort_grace, partial(self._abort_watchdog, turn_id)
            )
        return success, message

    async def _abort_route(self, owner: str, turn_id: str) -> tuple[DroneRoute | None, str]:
        """Where to send an abort of ``turn_id``, or why there is nowhere to send it."""
        live = self.live.get(turn_id)
        local = self.drones.get(live.drone_id) if live else None
        if live is not None and local is not None:
            # The turn's drone is connected here: answer from memory, no store round trip.
            return (local.route, "") if live.owner == owner else (None, NOT_YOUR_TURN)
        turn = await self.store.get_turn(turn_id, messages=False)
        if turn is None:
            return None, UNKNOWN_TURN
        if turn.owner != owner:
            return None, NOT_YOUR_TURN
        if turn.status != "processing":
            return None, NO_ACTIVE_WORK_ORDER
        route = await self.cluster.drone(turn.drone_id) if turn.drone_id else None
        return (route, "") if route is not None else (None, DRONE_OFFLINE)

    async def open_session(self, owner: str, sid: str, session_id: str) -> dict[str, Any]:
        session = await self.store.get_session(session_id)
        if session is None or session.owner != owner:
            return {"ok": False, "error": "Unknown session."}
        await self.sio.enter_room(sid, session_room(session_id), namespace=IDE_NAMESPACE)
        turns = await self.store.list_turns(session_id)
        processing = None
        for turn in turns:
            if turn.status == "processing":
                processing = turn.turn_id
                turn.text, turn.text_seq = await self.cluster.text(turn.turn_id)
        return {
            "ok": True,
            "session": session.view(processing).wire(),
            "turns": [turn.view().wire() for turn in turns],
        }

    async def session_views(self, owner: str) -> list[dict[str, Any]]:
        processing = {t.session_id: t.turn_id for t in await self.store.processing_turns(owner)}
        return [
            s.view(processing.get(s.session_id)).wire()
            for s in await self.store.list_sessions(owner)
        ]

    async def drone_views(self) -> list[dict[str, Any]]:
        views = []
        for route in await self.cluster.drones():
            running = await self.cluster.running(route.drone_id)
            views.append(_view(route, running).wire())
        return views

    async def broadcast_drones(self) -> None:
        """Tell every browser the drone list changed, at most once per ``DRONES_COALESCE``.

        Turns start and end in bursts; one list after the burst is what a person needs.
        """
        if self._drones_pending:
            return
        self._drones_pending = True
        self._after(DRONES_COALESCE, self._send_drones)

    async def _send_drones(self) -> None:
        self._drones_pending = False
        await self.sio.emit(DRONES, await self.drone_views(), namespace=IDE_NAMESPACE)

    # ---- drones

    async def drone_joined(self, drone: DroneSession, claimed: list[str]) -> None:
        """Register a drone; the turns it still runs (after a reconnect) stay its own."""
        running = []
        for turn_id in claimed:
            turn = await self.store.get_turn(turn_id, messages=False)
            if turn and turn.status == "processing" and turn.drone_id == drone.drone_id:
                running.append(turn_id)
                if (handle := self.timers.pop(turn_id, None)) is not None:
                    handle.cancel()
        previous = self.drones.get(drone.drone_id)
        if previous is not None and previous is not drone:
            previous.replaced = True
        self.drones[drone.drone_id] = drone
        self.metrics.drones.set(len(self.drones))
        await self.cluster.add_drone(drone.route, running)
        log.info("drone online drone=%s running=%d", drone.drone_id, len(running))
        await self.broadcast_drones()

    async def drone_left(self, drone: DroneSession) -> None:
        if self.drones.get(drone.drone_id) is drone:
            del self.drones[drone.drone_id]
        self.metrics.drones.set(len(self.drones))
        await self.cluster.remove_drone(drone.drone_id, drone.sid)
        log.info("drone offline drone=%s", drone.drone_id)
        if not drone.replaced:
            for turn_id in await self.cluster.running(drone.drone_id):
                ending = partial(self._orphan_timeout, turn_id, drone.drone_id)
                self.timers[turn_id] = self._after(self.drone_grace, ending)
        await self.broadcast_drones()

    async def progress(
        self, drone: DroneSession, event: TextDelta | MessageAdded | ToolActivity
    ) -> dict[str, Any]:
        live = await self._attach(drone, event.turn_id)
        if isinstance(live, str):
            return {"ok": False, "error": live}
        self.metrics.progress_events.inc()
        payload = event.wire()
        payload["sessionId"] = live.session_id
        if isinstance(event, TextDelta) and event.depth == 0:
            payload["seq"] = await self.cluster.append_text(event.turn_id, event.text)
        elif isinstance(event, MessageAdded):
            await self.store.append_messages(event.turn_id, [event.message])
        await self._to_session(live.session_id, WORK_ORDER_PROGRESS, payload)
        return {"ok": True}

    async def complete(self, drone: DroneSession, completion: Completion) -> dict[str, Any]:
        live = await self._attach(drone, completion.turn_id)
        if isinstance(live, str):
            log.info("completion ignored turn=%s: %s", completion.turn_id, live)
            return {"ok": False, "error": live}
        await self.end_turn(completion.turn_id, completion.status, completion.message)
        return {"ok": True}

    # ---- ending turns

    async def end_turn(self, turn_id: str, status: TurnStatus, message: str) -> bool:
        """End a turn once: the first terminal write wins, later ones are logged and ignored."""
        text, _ = await self.cluster.text(turn_id)
        if not await self.store.end_turn(turn_id, status, message, text):
            log.info("late end ignored turn=%s status=%s", turn_id, status)
            return False
        if (handle := self.timers.pop(turn_id, None)) is not None:
            handle.cancel()
        self.missing_since.pop(turn_id, None)
        turn: LiveTurn | TurnRecord | None = self.live.pop(turn_id, None)
        if turn is None:
            turn = await self.store.get_turn(turn_id, messages=False)
        assert turn is not None
        if turn.drone_id:
            await self.cluster.remove_running(turn.drone_id, turn_id)
        await self.cluster.forget_text(turn_id)
        # The abort ack and the completion are separate; the ack goes first.
        await self.cluster.wait_abort_answered(turn_id, DRONE_CALL_TIMEOUT)
        self.metrics.work_orders.labels(status).inc()
        log.info("turn ended turn=%s drone=%s status=%s", turn_id, turn.drone_id, status)
        success = status != "error"
        await self._to_session(turn.session_id, WORK_ORDER_COMPLETE, (turn_id, success, message))
        await self._send_sessions(turn.owner)
        await self.broadcast_drones()
        return True

    async def _abort_watchdog(self, turn_id: str) -> None:
        self.timers.pop(turn_id, None)
        if await self.end_turn(turn_id, "aborted", ABORTED):
            log.warning("abort watchdog ended turn=%s: no completion from the drone", turn_id)

    async def _orphan_timeout(self, turn_id: str, drone_id: str) -> None:
        self.timers.pop(turn_id, None)
        if await self._still_running(turn_id, drone_id):
            return  # the drone came back (maybe to another relay) and still runs it
        await self.end_turn(turn_id, "error", "The drone disconnected.")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep failed")

    async def sweep(self) -> None:
        """End turns no live drone runs any more (its relay died, say) after ``drone_grace``."""
        turns = await self.store.processing_turns()
        processing = {turn.turn_id for turn in turns}
        for turn_id in [t for t in self.live if t not in processing]:
            del self.live[turn_id]  # ended through another relay
        now = time.monotonic()
        for turn in turns:
            if turn.turn_id in self.timers:
                continue
            if await self._still_running(turn.turn_id, turn.drone_id):
                self.missing_since.pop(turn.turn_id, None)
                continue
            first = self.missing_since.setdefault(turn.turn_id, now)
            if now - first >= self.drone_grace:
                restarted = turn.created_at < self.started_at
                reason = "The relay restarted." if restarted else "The drone disconnected."
                await self.end_turn(turn.turn_id, "error", reason)

    # ---- internals

    async def _still_running(self, turn_id: str, drone_id: str | None) -> bool:
        """Whether a connected drone (on any relay) runs the turn."""
        if drone_id is None or await self.cluster.drone(drone_id) is None:
            return False
        return turn_id in await self.cluster.running(drone_id)

    async def _attach(self, drone: DroneSession, turn_id: str) -> LiveTurn | str:
        """The live turn ``drone`` may report on, or why it may not."""
        live = self.live.get(turn_id)
        if live is not None:
            return live if live.drone_id == drone.drone_id else NOT_YOUR_TURN
        turn = await self.store.get_turn(turn_id, messages=False)
        if turn is None:
            return UNKNOWN_TURN
        if turn.drone_id != drone.drone_id:
            return NOT_YOUR_TURN
        if turn.status != "processing":
            return TURN_ENDED
        live = LiveTurn(turn_id, turn.session_id, turn.owner, drone.drone_id)
        return self.live.setdefault(turn_id, live)

    async def _pick_drone(self, drone_id: str | None) -> tuple[DroneRoute | None, str]:
        if drone_id is not None:
            route = await self.cluster.drone(drone_id)
            if route is None:
                return None, f"The drone {drone_id} is offline."
            if len(await self.cluster.running(drone_id)) >= route.concurrency:
                return None, f"The drone {route.name} is busy."
            return route, ""
        routes = await self.cluster.drones()
        if not routes:
            return None, "No drone is online."
        best: tuple[float, DroneRoute] | None = None
        for route in routes:
            load = len(await self.cluster.running(route.drone_id)) / route.concurrency
            if load < 1 and (best is None or load < best[0]):
                best = (load, route)
        if best is None:
            return None, "Every drone is busy."
        return best[1], ""

    async def _call_drone(self, event: str, data: Any, route: DroneRoute) -> Any:
        """Send ``event`` to a drone and return its answer, like ``AsyncServer.call``, but with
        no task per call, and straight to the socket when the drone is connected here.

        Raises ``socketio.exceptions.TimeoutError`` after ``DRONE_CALL_TIMEOUT``.
        """
        answered: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()

        def on_answer(*args: Any) -> None:
            if not answered.done():
                answered.set_result(args)

        local = self.drones.get(route.drone_id)
        await self.sio.emit(
            event,
            data,
            to=route.sid,
            namespace=DRONE_NAMESPACE,
            callback=on_answer,
            # Through the cluster's message queue only when another relay holds the drone.
            ignore_queue=local is not None and local.sid == route.sid,
        )
        try:
            async with asyncio.timeout(DRONE_CALL_TIMEOUT):
                args = await answered
        except TimeoutError:
            raise socketio.exceptions.TimeoutError() from None
        return args[0] if len(args) == 1 else (args or None)

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


def _view(route: DroneRoute, running: set[str]) -> DroneView:
    return DroneView(
        drone_id=route.drone_id,
        name=route.name,
        provider=route.provider,
        model=route.model,
        concurrency=route.concurrency,
        running=len(running),
        busy=len(running) >= route.concurrency,
    )


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
