"""One object per connection: ``CodeSession`` for a browser, ``DroneSession`` for a drone.

Each handler is named after its event (``on_abort_work_order`` handles ``abortWorkOrder``),
validates its payload and answers a malformed one with an error ack, changing nothing.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from typing import Any

import socketio
from pydantic import ValidationError

from shared.protocol import (
    DRONE_NAMESPACE,
    DRONES,
    HELLO,
    IDE_NAMESPACE,
    PROGRESS,
    SESSIONS,
    AbortWorkOrderRequest,
    Completion,
    DroneHello,
    MessageAdded,
    OpenSession,
    SubmitWorkOrder,
    TextDelta,
    ToolActivity,
    describe,
)

from .cluster import DroneRoute
from .relay import Relay, owner_room

log = logging.getLogger("hangar.sessions")

IDENTITY_COOKIE = "hangar_identity"
MAX_EVENT_BYTES = 1_000_000
"""Largest browser event payload answered normally; bigger ones get an error ack."""
TOO_MANY_SUBMITS = "Too many work orders at once; try again in a few seconds."
TOO_MANY_ABORTS = "Too many aborts at once; try again in a moment."
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{32,128}$")


@functools.lru_cache(maxsize=64)  # event names come from clients: keep it bounded
def snake(event: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", event).lower()


def browser_identity(environ: dict[str, Any], auth: Any) -> str:
    """The owner id of a browser connection.

    A secret token (socket.io ``auth.token``, else the identity cookie the page set) names the
    person; a connection with neither gets a fresh identity of its own.
    """
    token = auth.get("token") if isinstance(auth, dict) else None
    if not (isinstance(token, str) and _TOKEN.match(token)):
        cookie = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        morsel = cookie.get(IDENTITY_COOKIE)
        token = morsel.value if morsel and _TOKEN.match(morsel.value) else None
    if token is None:
        token = secrets.token_urlsafe(32)
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class PayloadError(ValueError):
    """A payload refused before validation; the message is the whole refusal."""


def one_payload(args: tuple[Any, ...], limit: int | None = None) -> Any:
    """The single payload of an event: none means ``{}``; more than one is malformed."""
    if not args:
        return {}
    if len(args) > 1:
        raise PayloadError("Invalid payload (expected one payload object).")
    if limit is not None:
        size = len(json.dumps(args[0], separators=(",", ":"), ensure_ascii=False).encode())
        if size > limit:
            raise PayloadError(
                f"The payload is too large ({size} bytes; the limit is {limit} bytes)."
            )
    return args[0]


class RateLimit:
    """A token bucket: ``burst`` events at once, refilled at ``per_second``."""

    def __init__(self, burst: float, per_second: float) -> None:
        self.burst = burst
        self.per_second = per_second
        self.tokens = burst
        self.at = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_second)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class CodeSession:
    """A browser connection: it may see and abort only its owner's turns."""

    def __init__(self, relay: Relay, sid: str, owner: str) -> None:
        self.relay = relay
        self.sid = sid
        self.owner = owner
        self.submits = RateLimit(burst=10, per_second=1)
        self.aborts = RateLimit(burst=20, per_second=5)

    async def on_submit_work_order(self, *args: Any) -> dict[str, Any]:
        try:
            request = SubmitWorkOrder.model_validate(one_payload(args, MAX_EVENT_BYTES))
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": _refusal(error)}
        if not self.submits.allow():
            return {"ok": False, "error": TOO_MANY_SUBMITS}
        return await self.relay.submit(self.owner, self.sid, request)

    async def on_abort_work_order(self, *args: Any) -> tuple[bool, str]:
        try:
            request = AbortWorkOrderRequest.model_validate(one_payload(args, MAX_EVENT_BYTES))
        except (ValidationError, ValueError) as error:
            return False, _refusal(error)
        if not self.aborts.allow():
            return False, TOO_MANY_ABORTS
        return await self.relay.abort(self.owner, request)

    async def on_open_session(self, *args: Any) -> dict[str, Any]:
        try:
            request = OpenSession.model_validate(one_payload(args, MAX_EVENT_BYTES))
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": _refusal(error)}
        return await self.relay.open_session(self.owner, self.sid, request.session_id)

    async def on_list_sessions(self, *args: Any) -> dict[str, Any]:
        return {"ok": True, "sessions": await self.relay.session_views(self.owner)}

    async def on_list_drones(self, *args: Any) -> dict[str, Any]:
        return {"ok": True, "drones": await self.relay.drone_views()}


Job = Callable[[], Awaitable[dict[str, Any]]]


class DroneSession:
    """A drone connection. Each turn's events are handled in the order sent (see ``lanes``)."""

    def __init__(self, relay: Relay, sid: str, hello: DroneHello) -> None:
        self.relay = relay
        self.sid = sid
        self.drone_id = hello.drone_id
        self.route = DroneRoute(
            drone_id=hello.drone_id,
            sid=sid,
            name=hello.name,
            provider=hello.provider,
            model=hello.model,
            concurrency=hello.concurrency,
        )
        self.replaced = False
        # python-socketio runs every event in its own task. Each turn gets a lane: its events run
        # one after another, in the order the drone sent them (progress, final messages, then
        # completion), while different turns' lanes go on side by side.
        self.lanes: dict[str, deque[tuple[Job, asyncio.Future[dict[str, Any]]]]] = {}
        self.drains: set[asyncio.Task[None]] = set()

    async def on_work_order_progress(self, *args: Any) -> dict[str, Any]:
        try:
            event: TextDelta | MessageAdded | ToolActivity = PROGRESS.validate_python(
                one_payload(args)
            )
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": _refusal(error)}
        return await self._in_order(event.turn_id, lambda: self.relay.progress(self, event))

    async def on_work_order_complete(self, *args: Any) -> dict[str, Any]:
        if len(args) != 3:
            return {"ok": False, "error": "Invalid payload (expected turnId, success, message)."}
        try:
            completion = Completion(turn_id=args[0], success=args[1], message=args[2])
        except ValidationError as error:
            return {"ok": False, "error": _refusal(error)}
        return await self._in_order(
            completion.turn_id, lambda: self.relay.complete(self, completion)
        )

    def _in_order(self, turn_id: str, job: Job) -> asyncio.Future[dict[str, Any]]:
        """Run ``job`` after the turn's earlier events; the future's result is the ack."""
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        lane = self.lanes.get(turn_id)
        if lane is not None:
            lane.append((job, answer))
            return answer
        # One task drains a turn's lane while it has a backlog (measured: a task per event
        # cost the relay a fifth of its throughput).
        lane = self.lanes[turn_id] = deque([(job, answer)])
        drain = asyncio.ensure_future(self._drain(turn_id, lane))
        self.drains.add(drain)
        drain.add_done_callback(self.drains.discard)
        return answer

    async def _drain(
        self, turn_id: str, lane: deque[tuple[Job, asyncio.Future[dict[str, Any]]]]
    ) -> None:
        try:
            while lane:
                job, answer = lane[0]
                try:
                    result = await job()
                except Exception:
                    log.exception("drone event failed drone=%s", self.drone_id)
                    result = {"ok": False, "error": "The relay could not handle that event."}
                lane.popleft()
                if not answer.done():
                    answer.set_result(result)
        finally:
            del self.lanes[turn_id]

    async def close(self) -> None:
        """Finish what the drone sent before it left, then let the relay end its turns."""
        if self.drains:
            await asyncio.wait(list(self.drains))
        await self.relay.drone_left(self)


def _refusal(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return describe(error)
    if isinstance(error, PayloadError):
        return str(error)
    return f"Invalid payload ({error})."


Handler = Callable[..., Any]


class _Namespace(socketio.AsyncNamespace):  # type: ignore[misc]
    """Routes each event to the method of the connection's session object named after it."""

    def __init__(self, namespace: str, relay: Relay) -> None:
        super().__init__(namespace)
        self.relay = relay
        self.sessions: dict[str, Any] = {}

    async def trigger_event(self, event: str, *args: Any) -> Any:
        if event == "connect":
            sid, environ, auth = (*args, None)[:3]
            return await self.connect(sid, environ, auth)
        if event == "disconnect":
            await self.disconnect(args[0])
            return None
        sid, payload = args[0], args[1:]
        session = self.sessions.get(sid)
        handler: Handler | None = getattr(session, "on_" + snake(event), None)
        if handler is None:
            return {"ok": False, "error": f"Unknown event {event!r}."}
        try:
            result = handler(*payload)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        except Exception:
            log.exception("event %s failed", event)
            return {"ok": False, "error": "The relay could not handle that event."}

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        raise NotImplementedError

    async def disconnect(self, sid: str) -> None:
        raise NotImplementedError


class IdeNamespace(_Namespace):
    def __init__(self, relay: Relay) -> None:
        super().__init__(IDE_NAMESPACE, relay)

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        owner = browser_identity(environ, auth)
        self.sessions[sid] = CodeSession(self.relay, sid, owner)
        self.relay.metrics.browsers.set(len(self.sessions))
        await self.enter_room(sid, owner_room(owner))
        await self.emit(HELLO, {"browserId": owner[:12]}, to=sid)
        await self.emit(DRONES, await self.relay.drone_views(), to=sid)
        await self.emit(SESSIONS, await self.relay.session_views(owner), to=sid)

    async def disconnect(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.relay.metrics.browsers.set(len(self.sessions))


class DroneNamespace(_Namespace):
    def __init__(self, relay: Relay) -> None:
        super().__init__(DRONE_NAMESPACE, relay)

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        if not isinstance(auth, dict) or not isinstance(auth.get("token"), str):
            raise socketio.exceptions.ConnectionRefusedError("A drone token is required.")
        if not hmac.compare_digest(auth["token"].encode(), self.relay.drone_token.encode()):
            raise socketio.exceptions.ConnectionRefusedError("Invalid drone token.")
        try:
            hello = DroneHello.model_validate(auth)
        except ValidationError as error:
            raise socketio.exceptions.ConnectionRefusedError(describe(error)) from None
        drone = DroneSession(self.relay, sid, hello)
        self.sessions[sid] = drone
        await self.relay.drone_joined(drone, hello.running)

    async def disconnect(self, sid: str) -> None:
        drone = self.sessions.pop(sid, None)
        if isinstance(drone, DroneSession):
            await drone.close()
