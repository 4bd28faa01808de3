"""A synthetic drone: a bare socket.io client on ``/drone`` with no model behind it.

As a process of its own (``bench.abort_floor --burst``), streaming one text event per turn
every INTERVAL seconds until the turn is aborted:

    .venv/bin/python -m bench.synthetic URL DRONE_ID INTERVAL [PEER]

With PEER (``bench.abort_floor --burst --sdk``), each turn streams a model's answer from the
upstream peer at PEER through the openai SDK instead, one text event per chunk; an abort is
answered at once, the stream is closed (the SDK's own close), and then the turn ends: the least
a drone must do, in one process, with no agent loop, worker or history.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import openai
import socketio

from hangar.shared import runtime

from .common import TOKEN

DRONE = "/drone"


class SyntheticDrone:
    """Accepts every work order; answers an abort at once, then ends the turn ``aborted``."""

    def __init__(self, interval: float = 0.0, peer: str | None = None) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.model = (
            None if peer is None else openai.AsyncOpenAI(base_url=peer + "/v1", api_key="x")
        )
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
        if self.model is not None:
            self._streams[data["turnId"]] = asyncio.ensure_future(self._relay_model(data))
        elif self.interval > 0:
            self._streams[data["turnId"]] = asyncio.ensure_future(self._stream(data["turnId"]))
        return {"ok": True}

    async def _stream(self, turn_id: str) -> None:
        at = 0
        while True:
            event = {"kind": "text", "turnId": turn_id, "text": "word ", "depth": 0, "at": at}
            await self.sio.emit("workOrderProgress", event, namespace=DRONE)
            at += 5
            await asyncio.sleep(self.interval)

    async def _relay_model(self, order: dict[str, Any]) -> None:
        assert self.model is not None
        turn_id, at = order["turnId"], 0
        stream = await self.model.chat.completions.create(
            model="m", messages=[{"role": "user", "content": order["prompt"]}], stream=True
        )
        try:
            async for chunk in stream:
                if chunk.choices and (text := chunk.choices[0].delta.content):
                    event = {"kind": "text", "turnId": turn_id, "text": text, "depth": 0, "at": at}
                    await self.sio.emit("workOrderProgress", event, namespace=DRONE)
                    at += len(text)
        finally:
            await stream.close()

    async def _on_abort(self, data: dict[str, Any]) -> tuple[bool, str]:
        stream = self._streams.pop(data["turnId"], None)
        if stream is not None:
            stream.cancel()
        task = asyncio.ensure_future(self._end_aborted(data["turnId"], stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True, "Abort signaled"

    async def _end_aborted(self, turn_id: str, stream: asyncio.Task[None] | None) -> None:
        if stream is not None and self.model is not None:
            await asyncio.wait([stream])  # its model stream closed
        await self.complete(turn_id, "aborted")

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


async def serve(url: str, drone_id: str, interval: float, peer: str | None) -> None:
    drone = await SyntheticDrone(interval, peer).connect(url, drone_id)
    print(f"SYNTHETIC {drone_id} READY", flush=True)
    try:
        await drone.sio.wait()
    finally:
        with contextlib.suppress(Exception):
            await drone.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        peer = sys.argv[4] if len(sys.argv) > 4 else None
        runtime.run(serve(sys.argv[1], sys.argv[2], float(sys.argv[3]), peer))
