"""``LiveState`` in Redis, for several relays. Each relay refreshes its own drones' entries.

Redis may stall or restart empty: every call is bounded (``CALL_TIMEOUT``); what is only
bookkeeping (aborts in flight) fails quietly; the heartbeat keeps going through errors and
writes this relay's drones back as soon as Redis answers again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from .drone_entries import CLAIM, HEARTBEAT, PRESENCE_FLOOR, alive, entry, route_of
from .live_state import ENDED_READ, DroneRoute, LiveText

log = logging.getLogger("hangar.relay")

ABORT_TTL = 60
ABORT_BY_TTL = 3600  # seconds who asked to abort a turn is kept, for its ending
KEPT_FOR = 30 * 24 * 3600
"""Seconds a turn's live text, waiting calls and sub-agent output are kept at most (to its end)."""
ENDED_KEPT = 10_000
"""Endings the relays' stream of ended turns keeps (about: Redis trims it in whole blocks)."""
CALL_TIMEOUT = 2.0
"""Seconds a Redis call may take before it fails (a stalled Redis must not stall the relay)."""
POOL_SIZE = 32
FAILURES = (aioredis.RedisError, OSError, TimeoutError)


def once_more() -> Retry:
    """How every Redis call is tried again: once, at once, on a fresh connection, when its
    connection failed (Redis closed it as it restarted, say; with redis-py's defaults the first
    call after a restart failed). A timeout is not tried again: a call fails within
    ``CALL_TIMEOUT``."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


class KeptText:
    """A turn's text as this relay streamed it, and its length in UTF-8 bytes (as Redis counts);
    and the sub-agent events it kept, as JSON, with their characters."""

    __slots__ = ("size", "sub_chars", "subs", "text")

    def __init__(self) -> None:
        self.text = LiveText()
        self.size = 0
        self.subs: list[str] = []
        self.sub_chars = 0


class RedisLiveState:
    def __init__(self, url: str, prefix: str, presence: float = PRESENCE_FLOOR) -> None:
        # Calls beyond the pool's connections wait for one (redis-py's default pool fails them).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_SIZE,
            timeout=CALL_TIMEOUT,
            socket_timeout=CALL_TIMEOUT,
            socket_connect_timeout=CALL_TIMEOUT,
            retry=once_more(),
            retry_on_error=[RedisConnectionError],
        )
        self.redis: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self._claim = self.redis.register_script(CLAIM)
        """Sent by its hash (loaded at start, and again by redis-py if Redis lost it)."""
        self.prefix = prefix
        self.instance, self._marked = secrets.token_hex(8), False  # for ``lost_everything``
        self.presence = max(presence, PRESENCE_FLOOR)
        """Seconds an entry of this relay's lasts unrefreshed (its ``drone_grace``): a drone whose
        relay died is gone for every relay within it."""
        self.local: dict[str, DroneRoute] = {}
        self.kept: dict[str, KeptText] = {}
        """This relay's copy of the text of each turn it streams."""
        self._heartbeat: asyncio.Task[None] | None = None
        self._ended_from = "0-0"
        """The last entry of the stream of ended turns this relay has read."""
        self.hears_relays: Callable[[], Awaitable[bool]] | None = None
        """Whether this relay listens to the others (``RedisChannel.hearing``): its drones are
        listed only then, or an order sent to one through another relay would be lost."""
        self._reachable = True
        self._endings_doubted = False
        self._trusted_from = 0.0
        """Drone entries are judged by their age from here at most: after Redis failed (it
        stalled, or restarted empty) the relays need a heartbeat to write theirs again. Not from
        this relay's start: started again, it took dead drones' entries for live ones."""

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def start(self) -> None:
        await self.redis.ping()
        await self.redis.evalsha(await self.redis.script_load("return 1"), 0)  # scripts run?
        last: Any = await self.redis.xrevrange(self.key("ended"), count=1)
        self._ended_from = _text(last[0][0]) if last else "0-0"
        self._heartbeat = asyncio.ensure_future(self._beat())

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        for route in list(self.local.values()):
            await self.remove_drone(route.drone_id, route.sid)
        await self.redis.aclose()

    async def claim_drone(self, route: DroneRoute) -> DroneRoute | None:
        now, trusted = time.time(), self._trusted_from
        args = (route.drone_id, self._entry(route), route.instance, now, trusted, PRESENCE_FLOOR)
        try:
            held = await self._claim(keys=[self.key("drones")], args=args)
        except FAILURES:
            self._unreachable()
            raise
        return route_of(held) if held else None  # judged alive by Redis

    async def add_drone(self, route: DroneRoute) -> None:
        self.local[route.drone_id] = route
        try:
            await self.redis.hset(self.key("drones"), route.drone_id, self._entry(route))
        except FAILURES:
            self._unreachable()  # the heartbeat writes it once Redis answers

    async def remove_drone(self, drone_id: str, sid: str) -> None:
        if (mine := self.local.get(drone_id)) is not None and mine.sid == sid:
            del self.local[drone_id]
        try:
            current = await self.drone(drone_id)
            if current is not None and current.sid == sid:
                await self.redis.hdel(self.key("drones"), drone_id)
        except FAILURES:
            self._unreachable()  # its entry expires by itself

    async def _entries(self) -> dict[Any, Any]:
        """Every drone entry, by drone id (raises, noting it, when Redis does not answer)."""
        try:
            entries: dict[Any, Any] = await self.redis.hgetall(self.key("drones"))
        except FAILURES:
            self._unreachable()
            raise
        return entries

    async def drones(self) -> list[DroneRoute]:
        entries = await self._entries()
        trusted = self._trusted_from
        return [route for text in entries.values() if (route := alive(text, trusted))]

    async def drone_settled(self, drone_id: str, within: float) -> DroneRoute | None:
        deadline = time.monotonic() + within
        while True:
            try:
                route = await self.drone(drone_id)
            except FAILURES:
                route = None
            settled = time.time() - self._trusted_from > PRESENCE_FLOOR
            if route is not None or settled or time.monotonic() >= deadline:
                return route
            await asyncio.sleep(HEARTBEAT / 10)  # its relay writes it back within a heartbeat

    def endings_in_doubt(self) -> float | None:
        return self._trusted_from if self._endings_doubted else None

    def endings_checked(self, since: float) -> None:
        if self._reachable and self._trusted_from == since:  # no failure since the check began
            self._endings_doubted = False

    def kept_turns(self) -> set[str]:
        return set(self.kept)

    async def silent_drones(self) -> set[str]:
        entries = await self._entries()
        trusted = self._trusted_from
        return {_text(d) for d, text in entries.items() if alive(text, trusted) is None}

    async def drone(self, drone_id: str) -> DroneRoute | None:
        try:
            text = await self.redis.hget(self.key("drones"), drone_id)
        except FAILURES:
            self._unreachable()
            raise
        return alive(text, self._trusted_from) if text else None

    async def append_text(self, turn_id: str, text: str) -> int:
        """One string and a count per turn (not a list entry per delta), changed together; and
        a copy here, which writes the text back if Redis lost it (it came back empty)."""
        kept = self._kept(turn_id)
        encoded = text.encode()
        kept.text.append(text)
        kept.size += len(encoded)
        body, count = self.key("livetext", turn_id), self.key("livecount", turn_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.append(body, encoded)
            pipe.incr(count)
            pipe.expire(body, KEPT_FOR)
            pipe.expire(count, KEPT_FOR)
            length, seq, _, _ = await pipe.execute()
        if int(length) < kept.size:  # Redis lost what it held: it gets this relay's copy
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(body, kept.text.value().encode(), ex=KEPT_FOR)
                pipe.set(count, kept.text.count, ex=KEPT_FOR)
                await pipe.execute()
            log.warning("live text of turn=%s written back to Redis", turn_id)
            return kept.text.count
        if int(length) > kept.size:  # another relay streamed the turn before (a failover)
            whole, _ = await self.text(turn_id)
            kept.text, kept.size = LiveText(), len(whole.encode())
            kept.text.append(whole)
        kept.text.count = int(seq)
        return int(seq)

    def _kept(self, turn_id: str) -> KeptText:
        kept = self.kept.get(turn_id)
        if kept is None:
            kept = self.kept[turn_id] = KeptText()
        return kept

    async def text(self, turn_id: str) -> tuple[str, int]:
        kept = self.kept.get(turn_id)
        try:
            body, count = await self.redis.mget(
                self.key("livetext", turn_id), self.key("livecount", turn_id)
            )
        except FAILURES:
            if kept is None:
                raise
            return kept.text.value(), kept.text.count
        stored = body.encode() if isinstance(body, str) else (body or b"")
        if kept is not None and kept.size > len(stored):
            return kept.text.value(), kept.text.count
        return stored.decode(), int(count or 0)

    async def note_turn(self, turn_id: str, owner: str, session_id: str, drone_id: str) -> None:
        key = self.key("turn", turn_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"owner": owner, "session": session_id, "drone": drone_id})
            pipe.expire(key, KEPT_FOR)
            await pipe.execute()

    async def noted_turn(self, turn_id: str) -> tuple[str, str, str] | None:
        found: dict[Any, Any] = await self.redis.hgetall(self.key("turn", turn_id))
        fields = {_text(k): _text(v) for k, v in found.items()}
        if not {"owner", "session", "drone"} <= fields.keys():
            return None
        return fields["owner"], fields["session"], fields["drone"]

    def take_kept(self, turn_id: str) -> str:
        kept = self.kept.pop(turn_id, None)
        return kept.text.value() if kept is not None else ""

    async def forget_turn(self, turn_id: str, tell_others: bool = True) -> None:
        self.kept.pop(turn_id, None)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(
                self.key("livetext", turn_id),
                self.key("livecount", turn_id),
                self.key("waiting", turn_id),
                self.key("subagents", turn_id),
                self.key("subchars", turn_id),
                self.key("turn", turn_id),
                self.key("abortby", turn_id),
            )
            if tell_others:
                ended = self.key("ended")
                pipe.xadd(ended, {"turn": turn_id}, maxlen=ENDED_KEPT, approximate=True)
            await pipe.execute()

    async def ended_elsewhere(self) -> list[str]:
        found: Any = await self.redis.xread({self.key("ended"): self._ended_from}, count=ENDED_READ)
        turns: list[str] = []
        for _, entries in found or ():
            for entry_id, fields in entries:
                self._ended_from = _text(entry_id)
                turns.append(_text(fields.get(b"turn") or fields.get("turn") or b""))
        return turns

    async def lost_everything(self) -> bool:
        """A key of this relay's own, made on the first call: missing later, Redis lost it."""
        key = self.key("relay", self.instance)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, 1, nx=True)
            pipe.expire(key, 60)
            made, _ = await pipe.execute()
        first, self._marked = not self._marked, True
        return bool(made) and not first

    async def set_waiting(self, turn_id: str, call_id: str, call: dict[str, Any] | None) -> None:
        key = self.key("waiting", turn_id)
        if call is None:
            await self.redis.hdel(key, call_id)
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, call_id, json.dumps(call))
            pipe.expire(key, KEPT_FOR)
            await pipe.execute()

    async def waiting(self, turn_id: str) -> list[dict[str, Any]]:
        calls = await self.redis.hvals(self.key("waiting", turn_id))
        return [json.loads(call) for call in calls]

    async def keep_sub_agent(
        self, turn_id: str, event: dict[str, Any], size: int, limit: int
    ) -> int | None:
        """The turn's kept characters are counted in Redis too: one bound for every relay its
        drone reports through, also after a reconnect. This relay's copy is written back to a
        Redis that lost it, as the turn's text is."""
        key, chars = self.key("subagents", turn_id), self.key("subchars", turn_id)
        kept = self._kept(turn_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incrby(chars, size)
            pipe.expire(chars, KEPT_FOR)
            total, _ = await pipe.execute()
        kept.sub_chars = max(kept.sub_chars + size, int(total))
        if kept.sub_chars > limit:
            return None
        encoded = json.dumps(event)
        kept.subs.append(encoded)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(key, encoded)
            pipe.expire(key, KEPT_FOR)
            length, _ = await pipe.execute()
        if int(length) < len(kept.subs):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.rpush(key, *kept.subs)
                pipe.expire(key, KEPT_FOR)
                pipe.set(chars, kept.sub_chars, ex=KEPT_FOR)
                await pipe.execute()
            log.warning("sub-agent output of turn=%s written back to Redis", turn_id)
            return len(kept.subs)
        if int(length) > len(kept.subs):  # another relay kept some before (a failover)
            kept.subs = [_text(event) for event in await self.redis.lrange(key, 0, -1)]
        return int(length)

    async def sub_agent_events(self, turn_id: str) -> list[dict[str, Any]]:
        events = await self.redis.lrange(self.key("subagents", turn_id), 0, -1)
        return [json.loads(event) for event in events]

    async def abort_started(self, turn_id: str, by: str) -> None:
        with contextlib.suppress(*FAILURES):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self.key("abort", turn_id), "pending", ex=ABORT_TTL)
                pipe.set(self.key("abortby", turn_id), by, ex=ABORT_BY_TTL)
                await pipe.execute()

    async def abort_asker(self, turn_id: str) -> str | None:
        by = await self.redis.get(self.key("abortby", turn_id))
        return _text(by) if by else None

    async def abort_answered(self, turn_id: str) -> None:
        with contextlib.suppress(*FAILURES):
            await self.redis.delete(self.key("abort", turn_id))

    async def wait_abort_answered(self, turn_id: str, within: float) -> None:
        deadline = time.monotonic() + within
        with contextlib.suppress(*FAILURES):
            while await self.redis.exists(self.key("abort", turn_id)):
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.002)  # polling a key another relay deletes; bounded above

    async def _beat(self) -> None:
        """Refresh this relay's drones' entries (and write them back after Redis lost them)."""
        while True:
            await asyncio.sleep(HEARTBEAT)
            if not self.local or (self.hears_relays and not await self.hears_relays()):
                continue
            try:
                await self.redis.hset(
                    self.key("drones"),
                    mapping={d: self._entry(r) for d, r in self.local.items()},
                )
            except FAILURES:
                self._unreachable()
                continue
            if not self._reachable:
                self._reachable = True
                log.warning("Redis answers again: this relay's drones are listed again")

    def _entry(self, route: DroneRoute) -> str:
        return entry(route, self.presence)

    def _unreachable(self) -> None:
        self._trusted_from = time.time()
        self._endings_doubted = True
        if self._reachable:
            self._reachable = False
            log.warning("Redis does not answer; trying again every %g s", HEARTBEAT)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
