"""Browser connections (``/ide``): a person who logged in (or a script with their API token).
A member sees and aborts only their own turns; an admin, everyone's."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any, TypeVar

import socketio
from pydantic import BaseModel, ValidationError

from hangar.shared.protocol import (
    DRONES,
    HELLO,
    IDE_NAMESPACE,
    LOGGED_OUT,
    NOT_LOGGED_IN,
    AbortWorkOrderRequest,
    ListSessions,
    OpenSession,
    RenameSession,
    SessionRef,
    SubmitWorkOrder,
    ToolApproval,
    Wire,
)

from .access import Access, Credential
from .accounts import Revocation
from .connections import AGAIN, UNAVAILABLE, ConnectionNamespace, failures
from .drones import TOKEN_REVOKED
from .limits import (
    MAX_EVENT_BYTES,
    TOO_MANY_ABORTS,
    TOO_MANY_ANSWERS,
    TOO_MANY_SUBMITS,
    RateLimit,
    one_payload,
    refusal,
)
from .relay import Relay
from .rooms import owner_room

TOO_MANY_SESSION_CHANGES = "Too many renames and deletions at once; try again in a moment."

Request = TypeVar("Request", bound=BaseModel)


def payload(model: type[Request], args: tuple[Any, ...]) -> Request:
    """An event's one payload as ``model``, strictly: a value of the wrong JSON type (``"5"``
    for a number, ``"yes"`` for true) is refused, not converted."""
    return model.model_validate(one_payload(args, MAX_EVENT_BYTES), strict=True)


class BrowserConnection:
    """One browser connection of a person."""

    def __init__(self, relay: Relay, sid: str, credential: Credential) -> None:
        self.relay = relay
        self.sid = sid
        self.credential = credential
        self.user = credential.user
        self.owner = credential.user.user_id
        self.submits = RateLimit(burst=10, per_second=1)
        self.aborts = RateLimit(burst=20, per_second=5)
        self.answers = RateLimit(burst=20, per_second=5)
        self.session_changes = RateLimit(burst=30, per_second=10)
        """Renames and deletions (each a write, and a message to every browser of the owner)."""
        self.expiry: asyncio.TimerHandle | None = None
        """Logs the connection out when its login expires."""

    async def on_submit_work_order(self, *args: Any) -> dict[str, Any]:
        try:
            request = payload(SubmitWorkOrder, args)
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        if not self.submits.allow():
            return {"ok": False, "error": TOO_MANY_SUBMITS}
        if request.drone_id and await self.relay.accounts.drone_revoked(request.drone_id):
            return {"ok": False, "error": TOKEN_REVOKED}  # it would wait for ever
        return await self.relay.turns.submit(self.user, self.sid, request)

    async def on_abort_work_order(self, *args: Any) -> tuple[bool, str]:
        try:
            request = payload(AbortWorkOrderRequest, args)
        except (ValidationError, ValueError) as error:
            return False, refusal(error)
        if not self.aborts.allow():
            return False, TOO_MANY_ABORTS
        return await self.relay.turns.abort(self.user, request)

    async def on_approve_tool_call(self, *args: Any) -> dict[str, Any]:
        try:
            answer = payload(ToolApproval, args)
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        if not self.answers.allow():
            return {"ok": False, "error": TOO_MANY_ANSWERS}
        return await self.relay.turns.approve(self.user, answer)

    async def on_open_session(self, *args: Any) -> dict[str, Any]:
        try:
            request = payload(OpenSession, args)
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        return await self.relay.rooms.open_session(self.user, self.sid, request)

    async def on_list_sessions(self, *args: Any) -> dict[str, Any]:
        try:
            request = payload(ListSessions, args)
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        return await self.relay.rooms.session_page(self.user, request)

    async def on_rename_session(self, *args: Any) -> dict[str, Any]:
        try:
            request = payload(RenameSession, args)
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        if not self.session_changes.allow():
            return {"ok": False, "error": TOO_MANY_SESSION_CHANGES}
        return await self.relay.rooms.rename_session(self.user, request.session_id, request.title)

    async def on_delete_session(self, *args: Any) -> dict[str, Any]:
        try:
            request = payload(SessionRef, args)
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        if not self.session_changes.allow():
            return {"ok": False, "error": TOO_MANY_SESSION_CHANGES}
        return await self.relay.rooms.delete_session(self.user, request.session_id)

    async def on_list_drones(self, *args: Any) -> dict[str, Any]:
        try:
            payload(Wire, args)  # nothing to ask for: {} or no payload
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        return {"ok": True, "drones": await self.relay.directory.views()}


class IdeNamespace(ConnectionNamespace[BrowserConnection]):
    def __init__(self, relay: Relay, access: Access) -> None:
        super().__init__(IDE_NAMESPACE)
        self.relay = relay
        self.access = access

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        try:
            credential = await self.access.browser(environ, auth)
        except Exception as error:  # the store does not answer: the page tries again by itself
            failures.warning("login not checked (%s: %s)", type(error).__name__, error)
            raise socketio.exceptions.ConnectionRefusedError(UNAVAILABLE, AGAIN) from None
        if credential is None:
            raise socketio.exceptions.ConnectionRefusedError(NOT_LOGGED_IN)
        user = credential.user
        connection = self.connections[sid] = BrowserConnection(self.relay, sid, credential)
        if credential.expires_at is not None:
            left = max(0.0, credential.expires_at - time.time())
            connection.expiry = self.relay.background.later(left, partial(self._log_out, sid))
        self.relay.metrics.browsers.set(len(self.connections))
        await self.enter_room(sid, owner_room(user.user_id))
        demo = user.name == self.access.demo_user
        hello = {"user": {"name": user.name, "role": user.role}, "demo": demo}
        await self.emit(HELLO, hello, to=sid)
        try:
            await self.emit(DRONES, await self.relay.directory.views(), to=sid)
        except Exception as error:  # Redis or the store: the list comes with its next change
            failures.warning("drone list not sent (%s: %s)", type(error).__name__, error)

    async def revoked(self, revocation: Revocation) -> None:
        """Disconnect the connections a revoked login, token or person had."""
        for sid, connection in list(self.connections.items()):
            credential = connection.credential
            if (revocation.kind == credential.kind and revocation.revoked == credential.hashed) or (
                revocation.kind == "user" and revocation.revoked == credential.user.user_id
            ):
                await self._log_out(sid)

    async def _log_out(self, sid: str) -> None:
        """Tell the page its login ended, and drop its connection."""
        await self.emit(LOGGED_OUT, {"reason": NOT_LOGGED_IN}, to=sid)
        await self.disconnect_client(sid)

    async def disconnect_client(self, sid: str) -> None:
        await self.server.disconnect(sid, namespace=IDE_NAMESPACE)

    async def disconnect(self, sid: str) -> None:
        connection = self.connections.pop(sid, None)
        if connection is not None and connection.expiry is not None:
            connection.expiry.cancel()
        self.relay.metrics.browsers.set(len(self.connections))
