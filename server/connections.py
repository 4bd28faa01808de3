"""Socket.io namespaces whose events go to one object per connection.

Each handler is named after its event (``on_abort_work_order`` handles ``abortWorkOrder``),
validates its payload and answers a malformed one with an error ack, changing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import socketio

from hangar.shared.protocol import ABORT_WORK_ORDER

from .limits import QuietLog

log = logging.getLogger("hangar.relay")
failures = QuietLog(log)
UNAVAILABLE = (
    "The relay cannot do that just now (its database or Redis does not answer); "
    "try again in a moment."
)
AGAIN = {"again": True}
"""The data of a refusal that is not for good (``UNAVAILABLE``): the client connects again."""

C = TypeVar("C")
Handler = Callable[..., Any]


EVENT_NAME = re.compile(r"[a-z][A-Za-z]*")
"""The protocol's event names (``listSessions``): not ``list_sessions``, which maps alike."""


@functools.lru_cache(maxsize=64)  # event names come from clients: keep it bounded
def snake(event: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", event).lower()


class ConnectionNamespace(socketio.AsyncNamespace, Generic[C]):  # type: ignore[misc]
    """Routes each event to the method of the connection's object named after it."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.connections: dict[str, C] = {}
        self._aborting = 0
        """Aborts asked on this namespace and not answered yet."""
        self._aborts_answered = asyncio.Event()
        self._aborts_answered.set()

    async def aborts_answered(self, within: float) -> None:
        """Return once every abort asked here is answered, or after ``within`` seconds: a
        stopping relay answers them before it closes the connections."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._aborts_answered.wait(), within)

    async def trigger_event(self, event: str, *args: Any) -> Any:
        if event == "connect":
            sid, environ, auth = (*args, None)[:3]
            return await self.connect(sid, environ, auth)
        if event == "disconnect":
            await self.disconnect(args[0])
            return None
        sid, payload = args[0], args[1:]
        connection = self.connections.get(sid)
        handler: Handler | None = (
            getattr(connection, "on_" + snake(event), None) if EVENT_NAME.fullmatch(event) else None
        )
        if handler is None:
            return {"ok": False, "error": f"Unknown event {event!r}."}
        aborting = event == ABORT_WORK_ORDER
        if aborting:
            self._aborting += 1
            self._aborts_answered.clear()
        try:
            result = handler(*payload)
            if asyncio.iscoroutine(result):
                result = await result
            return result  # its ack is queued before a stopping relay's close
        except Exception as error:
            # Input was checked before the handler ran: this is the relay's own trouble (its
            # database or Redis is down, say), one line per stretch of it, not a traceback.
            failures.warning("event %s failed (%s: %s)", event, type(error).__name__, error)
            if event == ABORT_WORK_ORDER:
                return False, UNAVAILABLE
            return {"ok": False, "error": UNAVAILABLE}
        finally:
            if aborting:
                self._aborting -= 1
                if not self._aborting:
                    self._aborts_answered.set()

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        raise NotImplementedError

    async def disconnect(self, sid: str) -> None:
        raise NotImplementedError
