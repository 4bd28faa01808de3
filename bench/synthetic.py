"""A synthetic drone: a bare socket.io client on ``/drone`` with no model behind it."""

from __future__ import annotations

import asyncio
from typing import Any

import socketio

from .common import TOKEN

DRONE = "/drone"


class SyntheticDrone:
    """Accepts every work order; answers an abort at once, then ends the turn ``aborted``."""

    def __init__(self) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.orders: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sio.on("workOrder", self._on_work_order, namespace=DRONE)
        self.sio.on("abortWorkOrder", self._on_abort, namespace=DRONE)

    async def connect(self, url: str, drone_id: str) -> SyntheticDrone:
        auth: dict[str, Any] = {"token": TOKEN, "droneId": drone_id, "name": "bench"}
        auth |= {"provider": "openai", "model": "m", "concurrency": 1000}
        auth["instance"] = f"synthetic-instance-{drone_id}"
        await self.sio.connect(url, auth=auth, namespaces=[DRONE], transports=["websocket"])
        return self

    async def close(self) -> None:
        await self.sio.disconnect()

    async def _on_work_order(self, data: dict[str, Any]) -> dict[str, Any]:
        self.orders.put_nowait(data["turnId"])
        return {"ok": True}

    async def _on_abort(self, data: dict[str, Any]) -> tuple[bool, str]:
        task = asyncio.ensure_future(self.complete(data["turnId"], "aborted"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True, "Abort signaled"

    async def complete(self, turn_id: str, message: str) -> None:
        await self.sio.emit("workOrderComplete", (turn_id, True, message), namespace=DRONE)

    async def blast(self, turn_id: str, count: int) -> None:
        """``count`` progress text events as fast as possible, then ``done``."""
        for i in range(count):
            event = {"kind": "text", "turnId": turn_id, "text": "x", "depth": 0}
            await self.sio.emit("workOrderProgress", event, namespace=DRONE)
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the client's writer task send
        await self.complete(turn_id, "done")
