"""socket.io's channel between relays, on Redis, built to ride out Redis.

python-socketio's own Redis manager opens a connection per concurrent publish (past redis-py's
pool limit every publish fails and each failure opens a new pool) and waits ever longer between
attempts to listen again (1 s, 2 s, 4 s… without a cap). Here, in the manager python-socketio
defines for pub/sub back ends (``_publish`` and ``_listen``):

- an event is delivered to this relay's own clients first (python-socketio does that), then
  queued for the others: one writer sends the queue in order, many messages per round trip, on
  one connection; the emitting code never waits on Redis;
- while Redis fails, messages for the other relays are dropped (at most ``OUTBOX_LIMIT`` wait),
  with one log line when it goes and one when it is back: what the other relays' browsers miss
  meanwhile, they get from the store when they next open a session;
- listening starts again within ``RETRY_MAX`` of Redis answering (at once when this relay is
  about to list its drones or send a drone an order through another relay: ``hearing``), and
  this relay's browsers are then told to ``resync`` (what the others sent meanwhile is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from socketio.async_pubsub_manager import AsyncPubSubManager

from hangar.shared.protocol import IDE_NAMESPACE, RESYNC

from .redis_state import CALL_TIMEOUT, FAILURES, once_more

log = logging.getLogger("hangar.relay")

BATCH = 500
"""Messages sent in one round trip at most."""
OUTBOX_LIMIT = 20_000
"""Messages waiting for Redis at most; older ones are dropped past it."""
RETRY_MAX = 1.0
"""Longest wait between attempts to reach Redis again."""
HEARING_WAIT = 0.5
"""Seconds a relay waits at most for its listener to listen again before it lists its drones
or sends an order through another relay (``hearing``)."""


class RedisChannel(AsyncPubSubManager):  # type: ignore[misc]
    name = "hangar-redis"

    def __init__(self, url: str, channel: str) -> None:
        super().__init__(channel=channel)
        self.url = url
        self._outbox: deque[str] = deque()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer: asyncio.Task[None] | None = None
        self._down_since: float | None = None
        self._dropped = 0
        self._heard = asyncio.Event()
        """Set while this relay listens to the others."""
        self._retry = asyncio.Event()
        """Set to end the listener's wait before its next attempt."""
        self._lost = False
        """The channel was lost once: browsers here are told to resync when it is back."""

    # ---- to the other relays

    async def _publish(self, data: Any) -> None:
        if len(self._outbox) >= OUTBOX_LIMIT:
            self._outbox.popleft()
            self._dropped += 1
        self._outbox.append(self.json.dumps(data))
        self._idle.clear()
        self._ready.set()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        client = aioredis.Redis.from_url(
            self.url,
            socket_timeout=CALL_TIMEOUT,
            socket_connect_timeout=CALL_TIMEOUT,
            retry=once_more(),
            retry_on_error=[RedisConnectionError],
        )
        pause = 0.05
        try:
            while True:
                await self._ready.wait()
                batch = [self._outbox.popleft() for _ in range(min(BATCH, len(self._outbox)))]
                if not self._outbox:
                    self._ready.clear()
                try:
                    async with client.pipeline(transaction=False) as pipe:
                        for message in batch:
                            pipe.publish(self.channel, message)
                        await pipe.execute()
                except FAILURES as exc:
                    self._dropped += len(batch)
                    self._went_down(exc)
                    if not self._outbox:
                        self._idle.set()
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, RETRY_MAX)
                    continue
                pause = 0.05
                self._came_back()
                if not self._outbox:
                    self._idle.set()
        finally:
            self._idle.set()
            await client.aclose()

    def _went_down(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "Redis unreachable (%s): events for the other relays are dropped until it is back",
                exc.__class__.__name__,
            )

    def _came_back(self) -> None:
        if self._down_since is not None:
            log.warning(
                "Redis reachable again after %.1f s; %d events for the other relays were dropped",
                time.monotonic() - self._down_since,
                self._dropped,
            )
            self._down_since = None
            self._dropped = 0

    async def hearing(self, within: float) -> bool:
        """Whether this relay listens to the other relays, once it has tried again at once to
        listen if it did not, waiting ``within`` at most. An order or an answer published to a
        relay that does not listen is lost: a drone is listed, and sent an order through
        another relay, only while both listen."""
        if not self._heard.is_set():
            self._retry.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard.wait(), within)
        return self._heard.is_set()

    async def flush(self) -> None:
        """Wait until what is queued for the other relays is sent (or dropped)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Stop sending to the other relays and listening to them."""
        for task in (self._writer, getattr(self, "thread", None)):  # ``thread``: the listener
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- from the other relays

    async def _listen(self) -> AsyncIterator[bytes]:
        """What the other relays publish; it tries again after every failure, never raising."""
        pause = 0.05
        while True:
            client = aioredis.Redis.from_url(
                self.url, socket_connect_timeout=CALL_TIMEOUT, retry=once_more()
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                if not self._heard.is_set():
                    self._heard.set()
                    log.info("listening to the other relays on Redis channel %s", self.channel)
                    if self._lost:
                        # What the other relays sent meanwhile is gone: this relay's browsers
                        # open their sessions again for a fresh snapshot.
                        await self.server.emit(
                            RESYNC, {}, namespace=IDE_NAMESPACE, ignore_queue=True
                        )
                pause = 0.05
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        yield message["data"]
            except Exception as exc:  # Redis away, or a URL it cannot use: tried again, slower
                if self._heard.is_set():
                    self._heard.clear()
                    self._lost = True
                    log.warning("lost the Redis channel (%s); listening again", type(exc).__name__)
            finally:
                with contextlib.suppress(*FAILURES):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                    await client.aclose()
            with contextlib.suppress(TimeoutError):  # or at once when asked (``hearing``)
                await asyncio.wait_for(self._retry.wait(), pause)
            self._retry.clear()
            pause = min(pause * 2, RETRY_MAX)
