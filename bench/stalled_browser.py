"""Relay memory with a stalled browser: a browser that has a session open stops reading its
socket while the session's turn streams; the relay's RSS is sampled as it goes, beside a browser
of the same person that reads everything.

    .venv/bin/python -m bench.stalled_browser [--seconds 60] [--rate 20] [--event-size 100000]

The turn streams a sub-agent's text, which the relay forwards and does not keep, so what the
relay holds for the stalled browser is not hidden by the turn's own text (kept while it runs).

``StalledBrowser`` (also used by ``tests/test_relay_load.py``) speaks engine.io and socket.io by
hand over one websocket with a small kernel receive buffer, so that when it stops reading the
relay's writes back up at once, as for a tab the system froze or a phone in a tunnel.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import socketio

from .common import (
    IDE,
    RELAY_DATABASES,
    TOKEN,
    Browser,
    Proc,
    Stack,
    people,
    rss_kib,
    run_main,
    table,
)

DRONE = "/drone"
RECEIVE_BUFFER = 4096
"""Bytes of kernel receive buffer the stalled browser asks for (Linux doubles it)."""


def small_buffer_socket(addr_info: Any) -> socket.socket:
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.setblocking(False)
    return sock


class StalledBrowser:
    """A browser on ``/ide`` that can stop reading (``read`` only runs when asked)."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        self.token = token
        self.events: list[tuple[str, Any]] = []
        self._ids = 0
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    async def connect(self) -> StalledBrowser:
        connector = aiohttp.TCPConnector(socket_factory=small_buffer_socket)
        self._session = aiohttp.ClientSession(connector=connector)
        address = self.url.replace("http", "ws", 1) + "/socket.io/?EIO=4&transport=websocket"
        self._ws = await self._session.ws_connect(address, max_msg_size=0)
        opened = await self._ws.receive_str()
        if not opened.startswith("0"):
            raise RuntimeError(f"no engine.io open packet: {opened[:200]}")
        await self._ws.send_str(f"40{IDE}," + json.dumps({"token": self.token}))
        await self.read(lambda: any(e == "connected" for e, _ in self.events), 10.0)
        return self

    async def call(self, event: str, payload: Any, within: float = 10.0) -> Any:
        """Emit an acknowledged event and read until its answer (recording what comes first)."""
        assert self._ws is not None
        self._ids += 1
        ack = f"ack{self._ids}"
        await self._ws.send_str(f"42{IDE},{self._ids}" + json.dumps([event, payload]))
        await self.read(lambda: any(e == ack for e, _ in self.events), within)
        return next(args for e, args in self.events if e == ack)[0]

    async def read(self, until: Any, within: float) -> None:
        """Read (answering engine.io pings) until ``until()`` holds, within ``within`` s."""
        assert self._ws is not None
        async with asyncio.timeout(within):
            while not until():
                message = await self._ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise ConnectionError(f"the relay closed the connection ({message.type})")
                await self._record(message.data)

    async def _record(self, data: str) -> None:
        assert self._ws is not None
        if data == "2":
            await self._ws.send_str("3")
        elif data.startswith(f"40{IDE},"):
            self.events.append(("connected", None))
        elif data.startswith(f"42{IDE},"):
            name, *args = json.loads(data[len(IDE) + 3 :])
            self.events.append((name, args[0] if len(args) == 1 else args))
        elif data.startswith(f"43{IDE},"):
            rest = data[len(IDE) + 3 :]
            number = rest[: rest.index("[")]
            self.events.append((f"ack{number}", json.loads(rest[len(number) :])))

    def received(self, name: str) -> list[Any]:
        return [args for event, args in self.events if event == name]

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()


class TextDrone:
    """A drone driven by hand on ``/drone``: takes work orders, sends the text it is given."""

    def __init__(self, url: str, token: str = TOKEN, drone_id: str = "textdrone-1") -> None:
        self.url = url
        self.token = token
        self.drone_id = drone_id
        self.client = socketio.AsyncClient(reconnection=False)
        self.orders: asyncio.Queue[str] = asyncio.Queue()
        self.client.on("workOrder", self._order, namespace=DRONE)

    async def connect(self) -> TextDrone:
        hello: dict[str, Any] = {"token": self.token, "instance": f"instance-of-{self.drone_id}"}
        hello |= {"droneId": self.drone_id, "name": "textdrone", "provider": "openai"}
        hello |= {"model": "m", "concurrency": 8}
        await self.client.connect(
            self.url, namespaces=[DRONE], auth=hello, transports=["websocket"]
        )
        return self

    async def _order(self, order: dict[str, Any]) -> dict[str, Any]:
        await self.orders.put(order["turnId"])
        return {"ok": True}

    async def text(self, turn_id: str, text: str, depth: int = 0) -> None:
        """Send a text delta and wait for the relay's ack."""
        payload = {"kind": "text", "turnId": turn_id, "text": text, "depth": depth}
        ack = await self.client.call("workOrderProgress", payload, namespace=DRONE, timeout=30)
        if isinstance(ack, dict) and not ack.get("ok", True):
            raise RuntimeError(f"the relay refused the text: {ack}")

    async def close(self) -> None:
        await self.client.disconnect()


async def start_relay(stack: Stack, extra: list[str]) -> tuple[str, Proc]:
    """A relay on a SQLite file of its own, with ``extra`` options (``Stack.relay`` has none)."""
    db = str(stack.workdir / "relay.db")
    args = ["-m", "bench.hangar_mono", "serve", "--port", "0", "--database", db]
    proc = stack.spawn("relay", [*args, "--drone-token", TOKEN, *extra])
    found = await proc.wait_line(r"listening on (http://127\.0\.0\.1:\d+)/")
    RELAY_DATABASES[found.group(1)] = db
    return found.group(1), proc


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        stack = Stack(Path(args.logs or tmp))
        try:
            # A long engine.io ping: the stalled browser is not dropped for missing pings.
            relay, relay_proc = await start_relay(stack, ["--drone-grace", "300"])
            drone = await TextDrone(relay).connect()
            try:
                await measure(relay, relay_proc, drone, args)
            finally:
                await drone.close()
        finally:
            stack.stop()


async def measure(relay: str, relay_proc: Proc, drone: TextDrone, args: argparse.Namespace) -> None:
    (token,) = await people(relay, 1)
    reader = await Browser(relay, token).connect()
    stalled = await StalledBrowser(relay, token).connect()
    ack = await reader.sio.call("submitWorkOrder", {"prompt": "stall"}, namespace=IDE)
    turn_id = await asyncio.wait_for(drone.orders.get(), 30)
    await drone.text(turn_id, "Answer: ")
    await stalled.call("openSession", {"sessionId": ack["sessionId"]})
    await asyncio.sleep(1.0)
    base = rss_kib(relay_proc.pid)
    piece = "y" * args.event_size
    start, sent, rows = time.monotonic(), 0, []
    while (elapsed := time.monotonic() - start) < args.seconds:
        await drone.text(turn_id, piece, depth=1)
        await drone.text(turn_id, "word ")
        sent += 1
        await asyncio.sleep(max(0.0, sent / args.rate - (time.monotonic() - start)))
        if sent % int(args.rate * args.every) == 0:
            rss, megabytes = rss_kib(relay_proc.pid), sent * args.event_size / 1e6
            change, read = (rss - base) / 1024, reader.progress.get(turn_id, 0)
            rows.append([f"{elapsed:.0f}", f"{rss / 1024:.1f}", f"{change:+.1f}"])
            rows[-1] += [f"{megabytes:.0f}", f"{read:,}"]
    print(
        f"one turn streaming a sub-agent's text ({args.event_size:,} characters an event, "
        f"{args.rate:g} events/s; the relay forwards it and keeps none) and its own text (5 "
        f"characters an event); relay RSS {base / 1024:.1f} MiB when the browser stopped reading"
    )
    print(
        table(
            ["s", "relay RSS MiB", "change MiB", "MB sent to the turn's browsers", "events read"],
            rows,
        )
    )
    try:
        await stalled.read(lambda: stalled.received("resync"), 20.0)
        snapshot = await stalled.call("openSession", {"sessionId": ack["sessionId"]})
        text = snapshot["turns"][-1]
        print(
            f"\nthe stalled browser, reading again: {len(stalled.received('resync'))} resync; "
            f"then its snapshot holds {len(text['text']):,} characters of the turn's text, "
            f"textSeq {text['textSeq']} (sent: {sent + 1})"
        )
    except TimeoutError:
        print("\nthe stalled browser, reading again for 20 s: no resync")
    finally:
        await stalled.close()
        await reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=20.0, help="sub-agent text events a second")
    parser.add_argument("--event-size", type=int, default=100_000, help="characters an event")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--logs", help="keep the processes' logs in this folder")
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
