"""Fixtures: a real relay on a free port, real drones, real socket.io browser clients, and local
LLM upstream peers. Everything talks over loopback sockets; nothing of Hangar is mocked."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import socketio

from drone.cli import DroneConfig, run_drone
from server.app import RELAY, RelayConfig
from server.cli import start_relay
from server.relay import Relay
from shared.protocol import IDE_NAMESPACE
from tests.peers import OllamaPeer, OpenAIPeer, UpstreamPeer

DRONE_TOKEN = "test-drone-token-0123456789"
ROOT = Path(__file__).resolve().parent.parent


async def eventually(
    check: Callable[[], Any], timeout: float = 5.0, what: str = "condition"
) -> Any:
    """Wait until ``check()`` is truthy (bounded); returns its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class RelayHandle:
    url: str
    relay: Relay
    config: RelayConfig


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[RelayHandle]:
    config = RelayConfig(
        port=0,
        database=str(tmp_path / "hangar.db"),
        drone_token=DRONE_TOKEN,
        abort_grace=2.0,
        drone_grace=0.5,
    )
    runner, port = await start_relay(config)
    yield RelayHandle(f"http://127.0.0.1:{port}", runner.app[RELAY], config)
    await runner.cleanup()


@pytest.fixture
async def openai_peer() -> AsyncIterator[OpenAIPeer]:
    async with OpenAIPeer() as peer:
        yield peer


@pytest.fixture
async def ollama_peer() -> AsyncIterator[OllamaPeer]:
    async with OllamaPeer() as peer:
        yield peer


@dataclass
class Upstream:
    """One provider's upstream peer and how a drone is pointed at it."""

    provider: str
    peer: UpstreamPeer

    def drone_settings(self) -> dict[str, Any]:
        if self.provider == "openai":
            return {
                "provider": "openai",
                "model": "gpt-test",
                "base_url": self.peer.base_url + "/v1",
                "api_key": "test-key",
            }
        return {"provider": "ollama", "model": "llama-test", "ollama_host": self.peer.base_url}


@pytest.fixture(params=["openai", "ollama"])
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[Upstream]:
    peer_class: type[UpstreamPeer] = OpenAIPeer if request.param == "openai" else OllamaPeer
    async with peer_class() as peer:
        yield Upstream(request.param, peer)


@dataclass
class DroneHandle:
    config: DroneConfig
    stop: asyncio.Event
    task: asyncio.Task[int]

    @property
    def drone_id(self) -> str:
        return self.config.drone_id()


@pytest.fixture
async def start_drone(relay: RelayHandle) -> AsyncIterator[Callable[..., Any]]:
    drones: list[DroneHandle] = []
    counter = iter(range(1000))

    async def start(upstream: Upstream | None = None, **settings: Any) -> DroneHandle:
        options = {**(upstream.drone_settings() if upstream else {}), **settings}
        config = DroneConfig(
            server=relay.url,
            token=DRONE_TOKEN,
            name=f"drone{next(counter)}",
            **options,
        )
        stop = asyncio.Event()
        handle = DroneHandle(config, stop, asyncio.ensure_future(run_drone(config, stop)))
        drones.append(handle)
        await eventually(
            lambda: handle.drone_id in relay.relay.drones or handle.task.done(),
            what="the drone to connect",
        )
        return handle

    yield start
    for handle in drones:
        handle.stop.set()
    await asyncio.gather(*(h.task for h in drones), return_exceptions=True)


@dataclass
class Browser:
    """A socket.io client on ``/ide`` that records every event it receives, in order."""

    url: str
    token: str | None = None
    sio: socketio.AsyncClient = field(default_factory=socketio.AsyncClient)
    events: list[tuple[str, Any]] = field(default_factory=list)

    async def connect(self) -> Browser:
        self.sio.on("*", self._record, namespace=IDE_NAMESPACE)
        auth = {"token": self.token} if self.token else None
        await self.sio.connect(
            self.url, namespaces=[IDE_NAMESPACE], auth=auth, transports=["websocket"]
        )
        return self

    async def _record(self, event: str, *args: Any) -> None:
        self.events.append((event, args[0] if len(args) == 1 else args))

    async def call(self, event: str, *data: Any, timeout: float = 5.0) -> Any:
        return await self.sio.call(event, *data, namespace=IDE_NAMESPACE, timeout=timeout)

    async def submit(self, prompt: str, **extra: Any) -> dict[str, Any]:
        ack: dict[str, Any] = await self.call("submitWorkOrder", {"prompt": prompt, **extra})
        return ack

    async def abort(self, turn_id: str | None = None, timeout: float = 5.0) -> tuple[bool, str]:
        """Emit ``abortWorkOrder``; the ack is recorded in ``events`` in its arrival order."""
        answered: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

        def on_ack(success: bool, message: str) -> None:
            self.events.append(("abortAck", (turn_id, success, message)))
            answered.set_result((success, message))

        payload = {"turnId": turn_id} if turn_id else {}
        await self.sio.emit("abortWorkOrder", payload, namespace=IDE_NAMESPACE, callback=on_ack)
        return await asyncio.wait_for(answered, timeout)

    def order_of(self, turn_id: str) -> list[str]:
        """The abort acks and completions of a turn, in the order they arrived."""
        return [
            event
            for event, args in self.events
            if event in ("abortAck", "workOrderComplete") and args[0] == turn_id
        ]

    def completions(self, turn_id: str) -> list[tuple[str, bool, str]]:
        return [
            args
            for event, args in self.events
            if event == "workOrderComplete" and args[0] == turn_id
        ]

    async def completion(self, turn_id: str, timeout: float = 5.0) -> tuple[str, bool, str]:
        found = await eventually(
            lambda: self.completions(turn_id), timeout, f"workOrderComplete of {turn_id}"
        )
        return tuple(found[0])  # type: ignore[return-value]

    def progress(self, turn_id: str, kind: str = "text") -> list[dict[str, Any]]:
        return [
            args
            for event, args in self.events
            if event == "workOrderProgress" and args["turnId"] == turn_id and args["kind"] == kind
        ]

    def text(self, turn_id: str) -> str:
        return "".join(p["text"] for p in self.progress(turn_id) if p["depth"] == 0)

    async def wait_text(self, turn_id: str, pieces: int, timeout: float = 5.0) -> str:
        await eventually(lambda: len(self.progress(turn_id)) >= pieces, timeout, "streamed text")
        return self.text(turn_id)

    async def close(self) -> None:
        await self.sio.disconnect()


@pytest.fixture
async def browsers(relay: RelayHandle) -> AsyncIterator[Callable[..., Any]]:
    opened: list[Browser] = []

    async def open_browser(token: str | None = None) -> Browser:
        browser = await Browser(relay.url, token).connect()
        opened.append(browser)
        return browser

    yield open_browser
    for browser in opened:
        await browser.close()


@pytest.fixture
async def browser(browsers: Callable[..., Any]) -> Browser:
    opened: Browser = await browsers()
    return opened


@pytest.fixture
def drone_process(relay: RelayHandle) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``hangar drone`` as a real subprocess (for tests that kill it)."""
    started: list[subprocess.Popen[str]] = []

    def start(upstream: Upstream, name: str = "proc-drone") -> subprocess.Popen[str]:
        settings = upstream.drone_settings()
        args = [
            sys.executable, "-m", "server.cli", "drone",
            "--server", relay.url, "--token", DRONE_TOKEN, "--name", name,
            "--provider", settings["provider"], "--model", settings["model"],
        ]  # fmt: skip
        if "base_url" in settings:
            args += ["--base-url", settings["base_url"], "--api-key", settings["api_key"]]
        else:
            args += ["--ollama-host", settings["ollama_host"]]
        process = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(10)


def ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
