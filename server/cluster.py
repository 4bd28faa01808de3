"""What relays share: which drones are online where, what they run, the live text of running
turns, and aborts in flight. One relay keeps it in memory; several share it through Redis.

Turns themselves live in the database (the store); this is only the fast-changing part.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis

PRESENCE_TTL = 10.0
"""A drone entry not refreshed by its relay for this long is gone (its relay died)."""
HEARTBEAT = 2.0
ABORT_TTL = 60


@dataclass
class DroneRoute:
    """A connected drone: what it is, and where to reach it (its socket.io sid)."""

    drone_id: str
    sid: str
    name: str
    provider: str
    model: str
    concurrency: int


class Cluster(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def add_drone(self, route: DroneRoute, running: list[str]) -> None:
        """Register (or replace) a drone and the turns it runs."""

    async def remove_drone(self, drone_id: str, sid: str) -> None:
        """Forget a drone, unless it has reconnected meanwhile (another sid)."""

    async def drones(self) -> list[DroneRoute]: ...

    async def drone(self, drone_id: str) -> DroneRoute | None: ...

    async def running(self, drone_id: str) -> set[str]: ...

    async def add_running(self, drone_id: str, turn_id: str) -> None: ...

    async def remove_running(self, drone_id: str, turn_id: str) -> None: ...

    async def append_text(self, turn_id: str, text: str) -> int:
        """Add a text delta; returns its sequence number (1 for the turn's first)."""

    async def text(self, turn_id: str) -> tuple[str, int]:
        """The turn's text so far and how many deltas it holds."""

    async def forget_text(self, turn_id: str) -> None: ...

    async def abort_started(self, turn_id: str) -> None: ...

    async def abort_answered(self, turn_id: str) -> None: ...

    async def wait_abort_answered(self, turn_id: str, within: float) -> None:
        """Return once no abort of the turn is waiting for the drone's answer (bounded)."""


class LocalCluster:
    """One relay: everything in memory."""

    def __init__(self) -> None:
        self.routes: dict[str, DroneRoute] = {}
        self.runs: dict[str, set[str]] = {}
        self.texts: dict[str, list[str]] = {}
        self.aborts: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def add_drone(self, route: DroneRoute, running: list[str]) -> None:
        self.routes[route.drone_id] = route
        self.runs[route.drone_id] = set(running)

    async def remove_drone(self, drone_id: str, sid: str) -> None:
        route = self.routes.get(drone_id)
        if route is not None and route.sid == sid:
            del self.routes[drone_id]

    async def drones(self) -> list[DroneRoute]:
        return list(self.routes.values())

    async def drone(self, drone_id: str) -> DroneRoute | None:
        return self.routes.get(drone_id)

    async def running(self, drone_id: str) -> set[str]:
        return set(self.runs.get(drone_id, ()))

    async def add_running(self, drone_id: str, turn_id: str) -> None:
        self.runs.setdefault(drone_id, set()).add(turn_id)

    async def remove_running(self, drone_id: str, turn_id: str) -> None:
        self.runs.get(drone_id, set()).discard(turn_id)

    async def append_text(self, turn_id: str, text: str) -> int:
        pieces = self.texts.setdefault(turn_id, [])
        pieces.append(text)
        return len(pieces)

    async def text(self, turn_id: str) -> tuple[str, int]:
        pieces = self.texts.get(turn_id, [])
        return "".join(pieces), len(pieces)

    async def forget_text(self, turn_id: str) -> None:
        self.texts.pop(turn_id, None)

    async def abort_started(self, turn_id: str) -> None:
        self.aborts[turn_id] = asyncio.Event()

    async def abort_answered(self, turn_id: str) -> None:
        event = self.aborts.pop(turn_id, None)
        if event is not None:
            event.set()

    async def wait_abort_answered(self, turn_id: str, within: float) -> None:
        event = self.aborts.get(turn_id)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), within)


class RedisCluster:
    """Several relays: the shared part in Redis. Each relay refreshes its own drones' entries."""

    def __init__(self, url: str, prefix: str = "hangar") -> None:
        self.redis: aioredis.Redis = aioredis.Redis.from_url(url)
        self.prefix = prefix
        self.local: dict[str, DroneRoute] = {}
        self._heartbeat: asyncio.Task[None] | None = None

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def start(self) -> None:
        await self.redis.ping()
        self._heartbeat = asyncio.ensure_future(self._beat())

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for route in list(self.local.values()):
            await self.remove_drone(route.drone_id, route.sid)
        await self.redis.aclose()

    async def add_drone(self, route: DroneRoute, running: list[str]) -> None:
        self.local[route.drone_id] = route
        runs = self.key("running", route.drone_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key("drones"), route.drone_id, self._entry(route))
            pipe.delete(runs)
            if running:
                pipe.sadd(runs, *running)
            await pipe.execute()

    async def remove_drone(self, drone_id: str, sid: str) -> None:
        if (mine := self.local.get(drone_id)) is not None and mine.sid == sid:
            del self.local[drone_id]
        current = await self.drone(drone_id)
        if current is not None and current.sid == sid:
            await self.redis.hdel(self.key("drones"), drone_id)

    async def drones(self) -> list[DroneRoute]:
        entries = await self.redis.hgetall(self.key("drones"))
        return [route for text in entries.values() if (route := self._alive(text))]

    async def drone(self, drone_id: str) -> DroneRoute | None:
        text = await self.redis.hget(self.key("drones"), drone_id)
        return self._alive(text) if text else None

    async def running(self, drone_id: str) -> set[str]:
        members = await self.redis.smembers(self.key("running", drone_id))
        return {_text(m) for m in members}

    async def add_running(self, drone_id: str, turn_id: str) -> None:
        await self.redis.sadd(self.key("running", drone_id), turn_id)

    async def remove_running(self, drone_id: str, turn_id: str) -> None:
        await self.redis.srem(self.key("running", drone_id), turn_id)

    async def append_text(self, turn_id: str, text: str) -> int:
        seq: int = await self.redis.rpush(self.key("text", turn_id), text)
        return seq

    async def text(self, turn_id: str) -> tuple[str, int]:
        pieces = await self.redis.lrange(self.key("text", turn_id), 0, -1)
        return "".join(_text(p) for p in pieces), len(pieces)

    async def forget_text(self, turn_id: str) -> None:
        await self.redis.delete(self.key("text", turn_id))

    async def abort_started(self, turn_id: str) -> None:
        await self.redis.set(self.key("abort", turn_id), "pending", ex=ABORT_TTL)

    async def abort_answered(self, turn_id: str) -> None:
        await self.redis.delete(self.key("abort", turn_id))

    async def wait_abort_answered(self, turn_id: str, within: float) -> None:
        deadline = time.monotonic() + within
        while await self.redis.exists(self.key("abort", turn_id)):
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.002)  # polling a key another relay deletes; bounded above

    def _entry(self, route: DroneRoute) -> str:
        return json.dumps({**route.__dict__, "seen": time.time()})

    def _alive(self, text: Any) -> DroneRoute | None:
        fields = json.loads(text)
        if time.time() - float(fields.pop("seen", 0)) > PRESENCE_TTL:
            return None
        return DroneRoute(**fields)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            if self.local:
                await self.redis.hset(
                    self.key("drones"),
                    mapping={d: self._entry(r) for d, r in self.local.items()},
                )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
