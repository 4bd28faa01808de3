"""Drone connections (``/drone``): authenticated at connect; each turn's events handled in the
order the drone sent them."""

from __future__ import annotations

import hmac
from typing import Any

import socketio
from pydantic import ValidationError

from hangar.shared.protocol import (
    DRONE_NAMESPACE,
    PROGRESS,
    Completion,
    DroneHello,
    MessageAdded,
    TextDelta,
    ToolActivity,
    describe,
)

from .connections import ConnectionNamespace
from .identity import one_payload, refusal
from .lanes import TurnLanes
from .live_state import DroneRoute
from .relay import Relay


class DroneConnection:
    def __init__(self, relay: Relay, route: DroneRoute) -> None:
        self.relay = relay
        self.route = route
        self.lanes = TurnLanes(route.drone_id)

    async def on_work_order_progress(self, *args: Any) -> dict[str, Any]:
        try:
            event: TextDelta | MessageAdded | ToolActivity = PROGRESS.validate_python(
                one_payload(args)
            )
        except (ValidationError, ValueError) as error:
            return {"ok": False, "error": refusal(error)}
        drone_id = self.route.drone_id
        return await self.lanes.run(
            event.turn_id, lambda: self.relay.turns.progress(drone_id, event)
        )

    async def on_work_order_complete(self, *args: Any) -> dict[str, Any]:
        if len(args) != 3:
            return {"ok": False, "error": "Invalid payload (expected turnId, success, message)."}
        try:
            completion = Completion(turn_id=args[0], success=args[1], message=args[2])
        except ValidationError as error:
            return {"ok": False, "error": refusal(error)}
        drone_id = self.route.drone_id
        return await self.lanes.run(
            completion.turn_id, lambda: self.relay.turns.complete(drone_id, completion)
        )

    async def close(self) -> None:
        """Finish what the drone sent before it left, then let the relay end its turns."""
        await self.lanes.settle()
        await self.relay.turns.drone_left(self.route)


class DroneNamespace(ConnectionNamespace[DroneConnection]):
    def __init__(self, relay: Relay) -> None:
        super().__init__(DRONE_NAMESPACE)
        self.relay = relay

    async def connect(self, sid: str, environ: dict[str, Any], auth: Any) -> None:
        if not isinstance(auth, dict) or not isinstance(auth.get("token"), str):
            raise socketio.exceptions.ConnectionRefusedError("A drone token is required.")
        if not hmac.compare_digest(auth["token"].encode(), self.relay.drone_token.encode()):
            raise socketio.exceptions.ConnectionRefusedError("Invalid drone token.")
        try:
            hello = DroneHello.model_validate(auth)
        except ValidationError as error:
            raise socketio.exceptions.ConnectionRefusedError(describe(error)) from None
        route = DroneRoute(**hello.record().model_dump(), sid=sid)
        self.connections[sid] = DroneConnection(self.relay, route)
        await self.relay.turns.drone_joined(route, hello.running)

    async def disconnect(self, sid: str) -> None:
        drone = self.connections.pop(sid, None)
        if drone is not None:
            await drone.close()
