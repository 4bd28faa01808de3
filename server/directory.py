"""The drone directory: which drones are online (here and on other relays), how to call one and
wait for its answer, and the drone list browsers see (with how many turns each runs, from the
store)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import OrderedDict
from typing import Any

import socketio

from hangar.shared.protocol import DRONE_NAMESPACE, DRONES, IDE_NAMESPACE, DroneView

from . import queue
from .background import Later
from .channel import HEARING_WAIT, RedisChannel
from .live_state import DroneRoute, LiveState
from .metrics import RelayMetrics
from .store import Database

log = logging.getLogger("hangar.relay")

DRONE_CALL_TIMEOUT = 10.0
SENDS = 2
"""Times a work order goes to its drone when no answer comes (within ``DRONE_CALL_TIMEOUT``)."""
MOVE_CHECK = 1.0
"""Seconds between looks at where a drone is while a work order's answer is awaited through
another relay: a drone that left that relay (it died or froze) gets the order where it is now,
not after ``DRONE_CALL_TIMEOUT``."""
DRONES_COALESCE = 0.25
LEFT_REMEMBERED = 1000


class DroneMoved(socketio.exceptions.TimeoutError):  # type: ignore[misc]
    """The drone connected again elsewhere while its answer was awaited: what was sent went to a
    connection that is gone, and no answer will come."""


class DroneDirectory:
    """Drones are keyed by id; the route of each says where its connection is."""

    def __init__(
        self,
        sio: socketio.AsyncServer,
        live: LiveState,
        store: Database,
        metrics: RelayMetrics,
        later: Later,
    ) -> None:
        self.sio = sio
        self.live = live
        self.store = store
        self.metrics = metrics
        self.later = later
        self.local: dict[str, DroneRoute] = {}
        """Drones connected to this relay."""
        self._waiting: dict[str, set[asyncio.Future[tuple[Any, ...]]]] = {}
        """Answers awaited from drones connected here, by connection (sid)."""
        self._left: OrderedDict[str, None] = OrderedDict()
        """Connections here that closed (recent): a call to one fails at once."""
        self._drones_pending = False

    async def claim(self, route: DroneRoute) -> DroneRoute | None:
        """The connection of another instance that holds the drone's id, here or at another
        relay, or None: then the id is ``route``'s until it joins (or its claim lapses)."""
        here = self.local.get(route.drone_id)
        if here is not None:
            return None if hmac.compare_digest(here.instance, route.instance) else here
        return await self.live.claim_drone(route)

    async def join(self, route: DroneRoute) -> None:
        """Register a drone connected here (replacing an earlier connection of it)."""
        self.local[route.drone_id] = route
        self.metrics.drones.set(len(self.local))
        await self.live.add_drone(route)
        log.info("drone online drone=%s", route.drone_id)
        await self.broadcast()

    async def leave(self, route: DroneRoute) -> bool:
        """Forget a drone's connection; False if a newer connection of the drone replaced it."""
        current = self.local.get(route.drone_id)
        replaced = current is not None and current.sid != route.sid
        if current is not None and not replaced:
            del self.local[route.drone_id]
        self._left[route.sid] = None
        while len(self._left) > LEFT_REMEMBERED:
            self._left.popitem(last=False)
        for answer in self._waiting.pop(route.sid, ()):
            if not answer.done():  # it will never come: say so now, not at the timeout
                answer.set_exception(socketio.exceptions.DisconnectedError())
        self.metrics.drones.set(len(self.local))
        await self.live.remove_drone(route.drone_id, route.sid)
        log.info("drone offline drone=%s", route.drone_id)
        return not replaced

    def here(self, drone_id: str) -> DroneRoute | None:
        """The drone's route if it is connected to this relay."""
        return self.local.get(drone_id)

    async def route(self, drone_id: str) -> DroneRoute | None:
        """The drone's route wherever it is connected."""
        return self.local.get(drone_id) or await self.live.drone(drone_id)

    async def present(self, drone_id: str | None) -> bool:
        """Whether the drone is connected (to any relay). A connected drone runs the turns the
        store says it does: they were reconciled when it (re)connected."""
        if drone_id is None:
            return False
        return drone_id in self.local or await self.live.drone(drone_id) is not None

    async def call(
        self,
        event: str,
        data: Any,
        route: DroneRoute,
        within: float = DRONE_CALL_TIMEOUT,
        *,
        follow: bool = False,
    ) -> Any:
        """Send ``event`` to a drone and return its answer, like ``AsyncServer.call``, but with
        no task per call, and straight to the socket when the drone is connected here.

        Raises ``socketio.exceptions.TimeoutError`` after ``within`` seconds, and
        ``DisconnectedError`` as soon as a drone connected here leaves without answering. With
        ``follow``, a drone connected to another relay that connects again anywhere (``route``
        is then out of date) raises ``DroneMoved`` within ``MOVE_CHECK``.
        """
        if route.sid in self._left:  # it closed since the route was read
            raise socketio.exceptions.DisconnectedError()
        answered: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        local = self.local.get(route.drone_id)
        here = local is not None and local.sid == route.sid
        if here:
            self._waiting.setdefault(route.sid, set()).add(answered)
        try:
            return await self._call(event, data, route, within, answered, here=here, follow=follow)
        finally:
            if here and (waiting := self._waiting.get(route.sid)) is not None:
                waiting.discard(answered)
                if not waiting:
                    del self._waiting[route.sid]

    async def _call(
        self,
        event: str,
        data: Any,
        route: DroneRoute,
        within: float,
        answered: asyncio.Future[tuple[Any, ...]],
        *,
        here: bool,
        follow: bool,
    ) -> Any:
        def on_answer(*args: Any) -> None:
            if not answered.done():
                answered.set_result(args)

        deadline = asyncio.get_running_loop().time() + within
        if not here and isinstance(channel := self.sio.manager, RedisChannel):
            await channel.hearing(min(within, HEARING_WAIT))  # or the answer would be lost
        await self.sio.emit(
            event,
            data,
            to=route.sid,
            namespace=DRONE_NAMESPACE,
            callback=on_answer,
            # Through the relays' message queue only when another relay holds the drone.
            ignore_queue=here,
        )
        try:
            async with asyncio.timeout_at(deadline):  # the wait to listen is within it
                if here or not follow:
                    args = await answered
                else:
                    args = await self._answer_unless_moved(answered, route)
        except TimeoutError:
            raise socketio.exceptions.TimeoutError() from None
        return args[0] if len(args) == 1 else (args or None)

    async def _answer_unless_moved(
        self, answered: asyncio.Future[tuple[Any, ...]], route: DroneRoute
    ) -> tuple[Any, ...]:
        while True:
            await asyncio.wait((answered,), timeout=MOVE_CHECK)
            if answered.done():
                return answered.result()
            try:
                now = await self.route(route.drone_id)
            except Exception:  # Redis cannot say now: wait on
                continue
            # Not connected anywhere (yet) is no news: its relay may only be slow.
            if now is not None and now.sid != route.sid:
                raise DroneMoved()

    async def views(self) -> list[dict[str, Any]]:
        views = []
        counts = await queue.running_counts(self.store)
        for route in await self.live.drones():
            running = counts.get(route.drone_id, 0)
            view = DroneView(
                **route.model_dump(exclude={"sid", "instance"}),
                running=running,
                busy=running >= route.concurrency,
            )
            views.append(view.wire())
        return views

    async def broadcast(self) -> None:
        """Tell every browser the drone list changed, at most once per ``DRONES_COALESCE``.

        Turns start and end in bursts; one list after the burst is what a person needs.
        """
        if self._drones_pending:
            return
        self._drones_pending = True
        self.later(DRONES_COALESCE, self._send)

    async def _send(self) -> None:
        self._drones_pending = False
        await self.sio.emit(DRONES, await self.views(), namespace=IDE_NAMESPACE)
