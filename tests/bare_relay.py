"""A relay of the bare protocol on ``/drone``, for tests that run one real drone against it."""

from __future__ import annotations

import asyncio
from typing import Any

import socketio
from aiohttp import web

from hangar.shared.protocol import DRONE_NAMESPACE


class BareRelay:
    """A relay of the bare protocol on ``/drone``, for one real drone: it takes what the drone
    sends and keeps its completions. Started and stopped by the test, on one port."""

    def __init__(self) -> None:
        self.sio = socketio.AsyncServer(async_mode="aiohttp")
        self.app = web.Application()
        self.sio.attach(self.app)
        self.runner = web.AppRunner(self.app)
        self.drone: str | None = None
        self.completions: list[tuple[Any, ...]] = []
        self.completed = asyncio.Event()
        self.sio.on("connect", self.on_connect, namespace=DRONE_NAMESPACE)
        self.sio.on("workOrderProgress", self.on_progress, namespace=DRONE_NAMESPACE)
        self.sio.on("workOrderComplete", self.on_complete, namespace=DRONE_NAMESPACE)

    async def start(self, port: int = 0) -> int:
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, "127.0.0.1", port)
        await self.site.start()
        return int(self.runner.addresses[0][1])

    async def vanish(self) -> None:
        """Take no more connections, and drop the drone's."""
        await self.site.stop()
        assert self.drone is not None
        await self.sio.disconnect(self.drone, namespace=DRONE_NAMESPACE)

    async def on_connect(self, sid: str, environ: Any, auth: Any) -> None:
        self.drone = sid

    async def on_progress(self, sid: str, data: Any) -> dict[str, Any]:
        return {"ok": True}

    async def on_complete(self, sid: str, *args: Any) -> dict[str, Any]:
        self.completions.append(args)
        self.completed.set()
        return {"ok": True}
