"""Browser connections (``/ide``): each may see and abort only its owner's turns."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from hangar.shared.protocol import (
    DRONES,
    HELLO,
    IDE_NAMESPACE,
    SESSIONS,
    AbortWorkOrderRequest,
    OpenSession,
    SubmitWorkOrder,
)

from .connections import ConnectionNamespace
from .identity import (
    MAX_EVENT_BYTES,
    TOO_MANY_ABORTS,
    TOO_MANY_SUBMITS,
    RateLimit,
    browser_identity,
    one_payload,
    refusal,
)
from .relay import Relay
from .rooms import owner_room


class BrowserConnection:
    """One browser connection of a person (``owner``)."""

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
            return {"ok": False, "error": refusal(error)}
        if not self.submits.allow():
            return {"ok": False, "error": TOO_MANY_SUBMITS}
        return await self.relay.turns.submit(self.owner, self.sid, request)

    async def on_abort_work_order(self, *args: Any) -> tuple[bool, str]:
        try:
            request = AbortWorkOrderRequest.model_validate(one_payload(args, MAX_EVENT_BYTES))
        except (ValidationError, ValueError) as error:
            return False, refusal(error)
        if not self.aborts.allow():
            return False, TOO_MANY_ABORTS
        return await self.relay.turns.abort(self.owner, request)

    async def on_open_session(self, *args: Any) -> dict[str, Any]:
        try:
            request = OpenSession.model_validate(one_payload(args, MAX_EVENT_BYTES))
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        return await self.relay.rooms.open_session(self.owner, self.sid, request.session_id)

    async def on_list_sessions(self, *args: Any) -> dict[str, Any]:
        return {"ok": True, "sessions": await self.relay.rooms.session_views(self.owner)}

    async def on_list_drones(self, *args: Any) -> dict[str, Any]:
        return {"ok": True, "drones": await self.relay.directory.views()}


class IdeNamespace(ConnectionNamespace[BrowserConnection]):
    def __init__(self, relay: Relay) -> None:
        super().__init__(IDE_NAMESPACE)
        self.relay = relay

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        owner = browser_identity(environ, auth)
        self.connections[sid] = BrowserConnection(self.relay, sid, owner)
        self.relay.metrics.browsers.set(len(self.connections))
        await self.enter_room(sid, owner_room(owner))
        await self.emit(HELLO, {"browserId": owner[:12]}, to=sid)
        await self.emit(DRONES, await self.relay.directory.views(), to=sid)
        await self.emit(SESSIONS, await self.relay.rooms.session_views(owner), to=sid)

    async def disconnect(self, sid: str) -> None:
        self.connections.pop(sid, None)
        self.relay.metrics.browsers.set(len(self.connections))
