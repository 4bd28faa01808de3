"""What a drone must never lose: each turn's finished messages and its completion.

Each turn's events go out in order, one at a time, and each is kept until the relay confirms it:
its ack says ``{ok: true}``, or refuses it for good (the turn ended meanwhile). An ack asking to
send again (``retry``: the relay's database is down, say), no ack within ``CONFIRM_TIMEOUT``, or
a dropped connection keep the event, which goes again after a pause (growing to ``RETRY_MAX``)
or as soon as the drone is connected again. A turn waiting for its relay never holds up
another's. The relay stores a message sent twice once (its ``number``) and a turn's first
ending only, so sending again is safe.

A turn's completion waiting behind its last messages (an aborted turn's partial answer, say)
takes them along: one event and one answer instead of one each (``Ending.messages``). A relay
that refuses such a bundle gets them one at a time, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Protocol

import socketio

from hangar.shared.protocol import MAX_BUNDLED, WORK_ORDER_COMPLETE, WORK_ORDER_PROGRESS

log = logging.getLogger("hangar.drone")

CONFIRM_TIMEOUT = 10.0
"""Seconds to wait for the relay's ack before sending again (longer than any bound of the
relay's own, so the two never wedge each other)."""
RETRY_FIRST = 0.2
RETRY_MAX = 3.0
BUNDLE_CHARS = 256 * 1024
"""Most characters of messages a completion takes along (far below the transport's limit)."""


class Link(Protocol):
    """The connection as deliveries need it."""

    connected: asyncio.Event

    async def call(self, event: str, data: Any, within: float = CONFIRM_TIMEOUT) -> Any: ...


class Deliveries:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.queues: dict[str, deque[tuple[str, Any]]] = {}
        """Each turn's events not yet confirmed, oldest first."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def put(self, turn_id: str, event: str, data: Any) -> None:
        """Deliver ``event`` after the turn's earlier ones; returns at once."""
        queue = self.queues.setdefault(turn_id, deque())
        queue.append((event, data))
        self._idle.clear()
        if turn_id not in self._tasks:
            self._tasks[turn_id] = asyncio.ensure_future(self._deliver(turn_id, queue))

    def turns(self) -> list[str]:
        """Turns with events still to confirm."""
        return list(self.queues)

    async def settle(self, within: float) -> bool:
        """Wait (at most ``within`` seconds) until every event is confirmed; False if some
        are left."""
        try:
            async with asyncio.timeout(within):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    async def _deliver(self, turn_id: str, queue: deque[tuple[str, Any]]) -> None:
        pause = RETRY_FIRST
        bundling = True
        try:
            while queue:
                await self.link.connected.wait()
                event, data = queue[0]
                taken = 1
                if bundling and (bundle := _bundle(queue)) is not None:
                    event, data, taken = bundle
                try:
                    answer = await self.link.call(event, data, CONFIRM_TIMEOUT)
                except (socketio.exceptions.SocketIOError, ConnectionError, TimeoutError):
                    answer = None
                if taken > 1 and _settled(answer) and not answer.get("ok"):
                    # Refused together: each goes on its own, for its own answer.
                    log.info("relay refused %s with messages turn=%s: %s", event, turn_id, answer)
                    bundling = False
                    continue
                if _settled(answer):
                    if not answer.get("ok"):
                        log.info("relay refused %s turn=%s: %s", event, turn_id, answer["error"])
                    for _ in range(taken):
                        queue.popleft()
                    pause = RETRY_FIRST
                    continue
                if answer is not None:
                    log.info("relay asks to send %s turn=%s again", event, turn_id)
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX)
        finally:
            del self.queues[turn_id]
            del self._tasks[turn_id]
            if not self.queues:
                self._idle.set()


def _bundle(queue: deque[tuple[str, Any]]) -> tuple[str, Any, int] | None:
    """The turn's completion with the finished messages queued before it, as one event (and
    how many queued events it stands for); None unless messages, then the completion, wait."""
    messages: list[dict[str, Any]] = []
    chars = 0
    for event, data in queue:
        if event == WORK_ORDER_COMPLETE and messages and len(data) == 4:
            turn_id, success, message, ending = data
            ending = {**ending, "messages": messages}
            return event, (turn_id, success, message, ending), len(messages) + 1
        if event != WORK_ORDER_PROGRESS or data.get("kind") != "message" or "number" not in data:
            return None
        content = data["message"].get("content") or ""
        calls = data["message"].get("toolCalls") or []
        chars += len(content) + sum(len(call.get("arguments") or "") for call in calls)
        if chars > BUNDLE_CHARS or len(messages) == MAX_BUNDLED:
            return None
        messages.append({"number": data["number"], "message": data["message"]})
    return None


def _settled(answer: Any) -> bool:
    """Confirmed, or refused for good (sending it again would not change the answer)."""
    if not isinstance(answer, dict):
        return False
    if answer.get("ok") is True:
        return True
    return not answer.get("retry") and isinstance(answer.get("error"), str)
