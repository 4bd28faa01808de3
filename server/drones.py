"""Drone connections (``/drone``): authenticated at connect; each turn's events handled in the
order the drone sent them.

A drone proves itself with its own token (``hangar drone-token create NAME``), whose name is the
drone's id, or with the relay's shared ``--drone-token``. Either way a connection claiming the
id of a connected drone must present that drone's instance secret (its reconnect), so no one
takes over a drone's route and running work.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from typing import Any

import socketio
from pydantic import ValidationError

from hangar.shared.protocol import (
    ALREADY_CONNECTED,
    DISMISSED,
    DRONE_NAMESPACE,
    PROGRESS,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    Completion,
    DroneHello,
    MessageAdded,
    TextDelta,
    ToolActivity,
    describe,
    drone_name_of,
)
from hangar.shared.wire import Ending as DronesEnding
from hangar.shared.wire import cut

from . import queue
from .accounts import Revocation
from .connections import AGAIN, UNAVAILABLE, ConnectionNamespace, failures
from .lanes import TurnLanes
from .limits import one_payload, refusal
from .live_state import DroneRoute
from .relay import Relay
from .store import Ending

TOKEN_REQUIRED = "A drone token is required."
INVALID_TOKEN = "Invalid drone token."
TOKEN_REVOKED = "The drone's token was revoked."
OWN_TOKEN = "The drone {} has a token of its own; connect with that token."
UNREADABLE_ENDING = "The drone reported this turn's end in a form the relay cannot take:"
WRONG_ARGUMENTS = "Invalid payload (expected turnId, success, message and an ending)."


class DroneConnection:
    def __init__(self, relay: Relay, route: DroneRoute) -> None:
        self.relay = relay
        self.route = route
        self.lanes = TurnLanes(route.drone_id)

    def event(self, data: list[Any]) -> asyncio.Future[dict[str, Any]] | dict[str, Any] | None:
        """Put a report in its turn's lane, in the order the drone sent it; the answer is its
        ack (the drone asks for one for what it must not lose). None: not a report."""
        if data[0] == WORK_ORDER_PROGRESS:
            return self.progress(*data[1:])
        if data[0] == WORK_ORDER_COMPLETE:
            return self.complete(*data[1:])
        return None

    def progress(self, *args: Any) -> asyncio.Future[dict[str, Any]] | dict[str, Any]:
        try:
            event: TextDelta | MessageAdded | ToolActivity = PROGRESS.validate_python(
                one_payload(args)
            )
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        drone_id = self.route.drone_id
        return self.lanes.run(event.turn_id, lambda: self.relay.reports.progress(drone_id, event))

    def complete(self, *args: Any) -> asyncio.Future[dict[str, Any]] | dict[str, Any]:
        if len(args) not in (3, 4):
            return self._unreadable(args, WRONG_ARGUMENTS)
        try:
            completion = Completion(
                turn_id=args[0],
                success=args[1],
                message=args[2],
                ending=args[3] if len(args) == 4 else None,
            )
        except ValidationError as error:
            return self._unreadable(args, refusal(error))
        drone_id = self.route.drone_id
        return self.lanes.run(
            completion.turn_id, lambda: self.relay.reports.complete(drone_id, completion)
        )

    def _unreadable(
        self, args: tuple[Any, ...], why: str
    ) -> asyncio.Future[dict[str, Any]] | dict[str, Any]:
        """An ending the relay cannot take (a message too long, a count too large) is refused
        for good, and a turn the drone runs ends in error instead, with the reason: a drone does
        not send it again, and the turn must not stay processing. One whose bundled messages
        alone are at fault is only refused: the drone sends them again one at a time."""
        ending = args[3] if len(args) == 4 else None
        turn_id = args[0] if args else None
        if isinstance(turn_id, dict):  # all in one object: its turn still ends
            turn_id = turn_id.get("turnId")
        if isinstance(ending, dict) and "messages" in ending:
            alone = {key: value for key, value in ending.items() if key != "messages"}
            with contextlib.suppress(ValidationError):
                Completion(turn_id=args[0], success=args[1], message=args[2], ending=alone)
                return {"ok": False, "error": why}
        try:
            instead = Completion(
                turn_id=turn_id,
                success=False,
                message=cut(f"{UNREADABLE_ENDING} {why}", 2000),
                ending=DronesEnding(reason="drone_failed"),
            )
        except ValidationError:
            return {"ok": False, "error": why}  # not even a turn: nothing to end
        drone_id = self.route.drone_id

        async def end() -> dict[str, Any]:
            await self.relay.reports.complete(drone_id, instead)
            return {"ok": False, "error": why}

        return self.lanes.run(instead.turn_id, end)

    async def close(self) -> None:
        """Finish what the drone sent before it left, then let the relay end its turns."""
        await self.lanes.settle()
        await self.relay.reports.drone_left(self.route)


class DroneNamespace(ConnectionNamespace[DroneConnection]):
    def __init__(self, relay: Relay) -> None:
        super().__init__(DRONE_NAMESPACE)
        self.relay = relay
        self._joining: dict[str, tuple[asyncio.Lock, int]] = {}
        """A lock for each drone id being let in here, with how many connects hold or wait
        for it."""

    def inline(
        self, sid: str, data: list[Any]
    ) -> asyncio.Future[dict[str, Any]] | dict[str, Any] | None:
        """A drone's reports, taken as they arrive (``RelayServer.handle_inline``)."""
        connection = self.connections.get(sid)
        return None if connection is None else connection.event(data)

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        try:
            await self._let_in(sid, auth)
        except socketio.exceptions.ConnectionRefusedError:
            raise
        except Exception as error:  # the store or Redis does not answer: the drone comes again
            connection = self.connections.pop(sid, None)
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.close()
            failures.warning(
                "drone not let in (%s: %s); it tries again", type(error).__name__, error
            )
            raise socketio.exceptions.ConnectionRefusedError(UNAVAILABLE, AGAIN) from None

    async def _let_in(self, sid: str, auth: Any) -> None:
        if not isinstance(auth, dict) or not isinstance(auth.get("token"), str):
            raise socketio.exceptions.ConnectionRefusedError(TOKEN_REQUIRED)
        token: str = auth["token"]
        owned = drone_name_of(token)
        if owned is not None:
            if await self.relay.accounts.drone_of(token) != owned:
                raise socketio.exceptions.ConnectionRefusedError(INVALID_TOKEN)
        elif not self.relay.drone_token or not hmac.compare_digest(
            token.encode(errors="surrogatepass"), self.relay.drone_token.encode()
        ):
            raise socketio.exceptions.ConnectionRefusedError(INVALID_TOKEN)
        try:
            hello = DroneHello.model_validate(auth)
        except ValidationError as error:
            raise socketio.exceptions.ConnectionRefusedError(describe(error)) from None
        if owned is not None and hello.drone_id != owned:
            raise socketio.exceptions.ConnectionRefusedError(
                f"This token is the drone {owned}'s; connect as {owned}."
            )
        # Nor by the name it is shown under (the shipped drone's id is its name and a suffix),
        # which no drone takes from another that has a token of its own.
        for claimed in dict.fromkeys((hello.drone_id, hello.name)):
            if owned is not None and claimed.lower() == owned.lower():
                continue
            if await self.relay.accounts.has_drone_token(claimed):
                raise socketio.exceptions.ConnectionRefusedError(OWN_TOKEN.format(claimed))
        instance = hashlib.sha256(hello.instance.encode()).hexdigest()
        # One drone's connects here are let in one at a time: checked together, each would
        # find none connected yet.
        lock, waiting = self._joining.get(hello.drone_id, (asyncio.Lock(), 0))
        self._joining[hello.drone_id] = (lock, waiting + 1)
        try:
            async with lock:
                route = DroneRoute(**hello.record().model_dump(), sid=sid, instance=instance)
                if await self.relay.directory.claim(route) is not None:
                    raise socketio.exceptions.ConnectionRefusedError(ALREADY_CONNECTED)
                self.connections[sid] = DroneConnection(self.relay, route)
                to_abort = await self.relay.reports.drone_joined(route, hello.running)
        finally:
            lock, waiting = self._joining[hello.drone_id]
            if waiting == 1:
                del self._joining[hello.drone_id]
            else:
                self._joining[hello.drone_id] = (lock, waiting - 1)
        if to_abort:  # told once the connection is accepted, in a task of its own
            self.relay.background.spawn(self.relay.reports.abort_on_drone(route, to_abort))

    async def revoked(self, revocation: Revocation) -> None:
        """A revoked drone is disconnected at once, its running turns ended in error, and the
        turns waiting for it by name too (every relay hears of it; the first ends them)."""
        if revocation.kind != "drone":
            return
        ending = Ending("error", TOKEN_REVOKED, "drone_failed")
        # First, so that no turn waiting for it is sent to it as its own turns end and free
        # its slots (it would come back in line once it is gone, and wait for ever).
        if (route := await self.relay.directory.route(revocation.revoked)) is not None:
            self.relay.dispatcher.stopping(route.instance)
        for sid, connection in list(self.connections.items()):
            if connection.route.drone_id == revocation.revoked:
                await self.relay.reports.end_drone_turns(connection.route.drone_id, ending)
                await self.emit(DISMISSED, {"reason": TOKEN_REVOKED}, to=sid)
                await self.server.disconnect(sid, namespace=DRONE_NAMESPACE)
        for turn_id in await queue.waiting_for(self.relay.store, revocation.revoked):
            await self.relay.turns.end_here(turn_id, ending, from_statuses=("queued",))

    async def disconnect(self, sid: str) -> None:
        drone = self.connections.pop(sid, None)
        if drone is not None:
            await drone.close()
