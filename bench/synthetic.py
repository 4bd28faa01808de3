"""A synthetic drone: a bare socket.io client on ``/drone`` with no model behind it.

As a process of its own (``bench.abort_floor --burst``), streaming one text event per turn
every INTERVAL seconds until the turn is aborted:

    .venv/bin/python -m bench.synthetic URL DRONE_ID INTERVAL
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import socketio

from hangar.shared import runtime

from .common import TOKEN

DRONE = "/drone"


class SyntheticDrone:
    """Accepts every work order; answers an abort at once, then ends the turn ``aborted``."""

    def __init__(self, interval: float = 0.0) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.orders: asyncio.Queue[str] = asyncio.Queue()
        self.interval = interval
        """With ``interval`` > 0, each turn streams a text event every ``interval`` s."""
        self._streams: dict[str, asyncio.Task[None]] = {}
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
        if self.interval > 0:
            self._streams[data["turnId"]] = asyncio.ensure_future(self._stream(data["turnId"]))
        return {"ok": True}

    async def _stream(self, turn_id: str) -> None:
        at = 0
        while True:
            event = {"kind": "text", "turnId": turn_id, "text": "word ", "depth": 0, "at": at}
            await self.sio.emit("workOrderProgress", event, namespace=DRONE)
            at += 5
            await asyncio.sleep(self.interval)

    async def _on_abort(self, data: dict[str, Any]) -> tuple[bool, str]:
        if (stream := self._streams.pop(data["turnId"], None)) is not None:
            stream.cancel()
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


async def serve(url: str, drone_id: str, interval: float) -> None:
    drone = await SyntheticDrone(interval).connect(url, drone_id)
    print(f"SYNTHETIC {drone_id} READY", flush=True)
    try:
        await drone.sio.wait()
    finally:
        with contextlib.suppress(Exception):
            await drone.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        runtime.run(serve(sys.argv[1], sys.argv[2], float(sys.argv[3])))
