"""A browser for benchmarks that costs the machine little: socket.io's wire protocol spoken
directly over one aiohttp websocket (engine.io 4, the ``/ide`` namespace), instead of a
python-socketio client with its own queues and loops per connection.

A benchmark's 200 browsers share the 2 cores with what they measure; in use they run on 200
other machines. ``--light`` in ``bench.abort_burst`` and ``bench.abort_floor --burst`` runs them
with this client, to show how much of a figure the benchmark's own clients are. Only what those
benchmarks use: connect with a token, submit, abort, and the progress and completion events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from .common import IDE, TurnsSeen


class LightBrowser(TurnsSeen):
    """The ``Browser`` interface of ``bench.common`` the burst benchmarks use."""

    def __init__(self, url: str, token: str | None = None) -> None:
        super().__init__()
        self.url = url
        self.token = token
        self._acks: dict[int, Callable[[list[Any]], None]] = {}
        self._next_id = 0
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None

    async def connect(self) -> LightBrowser:
        self._session = aiohttp.ClientSession()
        try:
            await self._open()
        except BaseException:
            await self.close()
            raise
        return self

    async def _open(self) -> None:
        assert self._session is not None
        url = self.url.replace("http", "ws", 1) + "/socket.io/?EIO=4&transport=websocket"
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        opened = await self._ws.receive_str(timeout=10)
        if not opened.startswith("0"):
            raise RuntimeError(f"no engine.io open packet: {opened[:80]!r}")
        auth = {"token": self.token} if self.token else {}
        await self._ws.send_str(f"40{IDE},{json.dumps(auth)}")
        while not (joined := await self._ws.receive_str(timeout=10)).startswith(f"40{IDE},"):
            if joined.startswith(f"44{IDE},"):
                raise RuntimeError(f"namespace refused: {joined[:200]!r}")
            await self._take(joined)  # the relay's greeting may come first
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        with contextlib.suppress(Exception):
            if self._ws is not None:
                await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def emit(self, event: str, data: Any, on_ack: Callable[[list[Any]], None]) -> None:
        """Send ``event`` with an ack id; ``on_ack`` gets the answer's arguments."""
        assert self._ws is not None
        self._next_id += 1
        self._acks[self._next_id] = on_ack
        packet = json.dumps([event, data], separators=(",", ":"))
        await self._ws.send_str(f"42{IDE},{self._next_id}{packet}")

    async def submit(self, prompt: str) -> str:
        answer: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        await self.emit("submitWorkOrder", {"prompt": prompt}, answer.set_result)
        (ack,) = await asyncio.wait_for(answer, 60)
        return self._submitted(ack)

    async def abort(self, turn_id: str) -> tuple[float, float, bool, str]:
        """Emit ``abortWorkOrder``; returns (emitted at, acked at, success, message)."""
        acked: asyncio.Future[tuple[float, list[Any]]] = asyncio.get_running_loop().create_future()
        emitted = time.monotonic()
        await self.emit(
            "abortWorkOrder", {"turnId": turn_id}, lambda a: acked.set_result((time.monotonic(), a))
        )
        at, (success, message) = await asyncio.wait_for(acked, 30)
        return emitted, at, success, message

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                return
            await self._take(message.data)

    async def _take(self, text: str) -> None:
        if text == "2":
            assert self._ws is not None
            await self._ws.send_str("3")
            return
        prefix = f"{IDE},"
        if text[:1] != "4" or not text.startswith(prefix, 2):
            return
        kind, body = text[1], text[2 + len(prefix) :]
        start = body.index("[")
        if kind == "3":
            self._acks.pop(int(body[:start]))(json.loads(body[start:]))
        elif kind == "2":
            self._event(*json.loads(body[start:]))

    def _event(self, name: str, *args: Any) -> None:
        if name == "workOrderProgress":
            self._progressed(args[0]["turnId"])
        elif name == "workOrderComplete":
            self._ended(args[0], args[1], args[2])
