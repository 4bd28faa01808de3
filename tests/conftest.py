"""Fixtures: a real relay on a free port, real drones, real socket.io browser clients, and local
LLM upstream peers. Everything talks over loopback sockets; nothing of Hangar is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import socketio

from bench.peers import OllamaPeer, OpenAIPeer, UpstreamPeer
from bench.services import OwnPostgres, OwnRedis
from hangar.drone.tools.policy import ToolPolicy
from hangar.drone.worker import DroneConfig, run_drone
from hangar.server.access import LOGIN_COOKIE
from hangar.server.accounts import Accounts, Role
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.relay import Relay
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.protocol import IDE_NAMESPACE

DRONE_TOKEN = "test-drone-token-0123456789"
ROOT = Path(__file__).resolve().parent.parent
HANGAR = [sys.executable, "-m", "hangar.shared.cli"]
"""The ``hangar`` command, run by this interpreter."""


LOG_LINES = 40
"""The last lines of each of a failed test's process logs shown with its failure."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that ran relays or drones as processes shows the end of their logs (the
    ``*.log`` files in its ``tmp_path``): a run elsewhere keeps nothing else of them."""
    report = yield
    folder = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when == "call" and isinstance(folder, Path):
        for log in sorted(folder.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
            report.sections.append((f"{log.name}, its last {len(lines)} lines", "\n".join(lines)))
    return report


async def eventually(
    check: Callable[[], Any], timeout: float = 5.0, what: str = "condition"
) -> Any:
    """Wait until ``check()`` (plain or async) is truthy, within ``timeout``; returns its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


class People:
    """Accounts for tests: each name becomes a person (made on first use) with an API token."""

    def __init__(self, accounts: Accounts) -> None:
        self.accounts = accounts
        self.tokens: dict[str, str] = {}
        self._count = 0

    async def token(self, name: str | None = None, role: Role = "member") -> str:
        """The API token of ``name`` (a new person of their own when None)."""
        if name is None:
            self._count += 1
            name = f"person-{self._count}"
        if name not in self.tokens:
            if await self.accounts.user(name) is None:
                await self.accounts.add_user(name, None, role)
            self.tokens[name] = await self.accounts.create_api_token(name, "tests")
        return self.tokens[name]


@dataclass
class RelayHandle:
    url: str
    relay: Relay
    config: RelayConfig
    people: People


@pytest.fixture
def relay_ping() -> tuple[float, float] | None:
    """engine.io's ping of the test relay: from its drone grace (browser tests override it)."""
    return None


def relay_folder(tmp_path: Path) -> Path:
    """Where a test's relay keeps its database: apart from the drones' work directory (a drone
    refuses one that holds a relay's database)."""
    folder = tmp_path / "relay"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture
async def relay(
    tmp_path: Path, relay_ping: tuple[float, float] | None
) -> AsyncIterator[RelayHandle]:
    config = RelayConfig(
        port=0,
        database=str(relay_folder(tmp_path) / "hangar.db"),
        drone_token=DRONE_TOKEN,
        abort_grace=2.0,
        drone_grace=0.5,
        ping=relay_ping,
    )
    async with relay_on(config) as relay:
        yield relay


@contextlib.asynccontextmanager
async def relay_on(config: RelayConfig) -> AsyncIterator[RelayHandle]:
    """A relay in this process with ``config``, stopped on the way out."""
    runner, port = await start_relay(config)
    relay = runner.app[RELAY]
    try:
        yield RelayHandle(f"http://127.0.0.1:{port}", relay, config, People(relay.accounts))
    finally:
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
    root: AbortController
    task: asyncio.Task[int]

    def stop(self) -> None:
        """Stop the drone as its operator's Ctrl-C would."""
        self.root.abort(AbortError("The drone's operator stopped it.", cause="operator"))

    @property
    def drone_id(self) -> str:
        return self.config.drone_id()


@pytest.fixture
async def start_drone(relay: RelayHandle, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    drones: list[DroneHandle] = []
    counter = iter(range(1000))

    async def start(upstream: Upstream | None = None, **settings: Any) -> DroneHandle:
        # Every tool runs at once unless a test says otherwise (approvals have tests of their own).
        defaults = {
            "token": DRONE_TOKEN,
            "name": f"drone{next(counter)}",
            "tools": ToolPolicy.allow_all(),
            "workdir": str(tmp_path),  # never the checkout the tests run from
        }
        options = {**defaults, **(upstream.drone_settings() if upstream else {}), **settings}
        config = DroneConfig(server=relay.url, **options)
        root = AbortController()
        handle = DroneHandle(config, root, asyncio.ensure_future(run_drone(config, root)))
        drones.append(handle)
        await eventually(
            lambda: handle.drone_id in relay.relay.directory.local or handle.task.done(),
            what="the drone to connect",
        )
        return handle

    yield start
    for handle in drones:
        handle.stop()
    await asyncio.gather(*(h.task for h in drones), return_exceptions=True)


@dataclass
class Browser:
    """A socket.io client on ``/ide`` that records every event it receives, in order.

    It is a person by their API token (``token``) or their login cookie (``login``).
    """

    url: str
    token: str | None = None
    login: str | None = None
    sio: socketio.AsyncClient = field(default_factory=socketio.AsyncClient)
    events: list[tuple[str, Any]] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    """When each of ``events`` arrived (``time.monotonic()``)."""

    async def connect(self) -> Browser:
        self.sio.on("*", self._record, namespace=IDE_NAMESPACE)
        auth = {"token": self.token} if self.token else None
        headers = {"Cookie": f"{LOGIN_COOKIE}={self.login}"} if self.login else {}
        await self.sio.connect(
            self.url,
            namespaces=[IDE_NAMESPACE],
            auth=auth,
            headers=headers,
            transports=["websocket"],
        )
        return self

    async def _record(self, event: str, *args: Any) -> None:
        self._note(event, args[0] if len(args) == 1 else args)

    def _note(self, event: str, args: Any) -> None:
        self.events.append((event, args))
        self.arrived.append(time.monotonic())

    async def call(self, event: str, *data: Any, timeout: float = 5.0) -> Any:
        return await self.sio.call(event, *data, namespace=IDE_NAMESPACE, timeout=timeout)

    async def submit(self, prompt: str, **extra: Any) -> dict[str, Any]:
        ack: dict[str, Any] = await self.call("submitWorkOrder", {"prompt": prompt, **extra})
        return ack

    async def abort(self, turn_id: str | None = None, timeout: float = 5.0) -> tuple[bool, str]:
        """Emit ``abortWorkOrder``; the ack is recorded in ``events`` in its arrival order."""
        answered: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

        def on_ack(success: bool, message: str) -> None:
            self._note("abortAck", (turn_id, success, message))
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
        turn, success, message = found[0]
        return turn, success, message

    async def ending(self, turn_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """The ``turnEnded`` of a turn: why it ended, who ended it, the tokens it used."""
        found = await eventually(
            lambda: [a for e, a in self.events if e == "turnEnded" and a["turnId"] == turn_id],
            timeout,
            f"turnEnded of {turn_id}",
        )
        ending: dict[str, Any] = found[0]
        return ending

    def progress(self, turn_id: str, kind: str = "text") -> list[dict[str, Any]]:
        return [args for args, _ in self._progress(turn_id, kind)]

    def progress_times(self, turn_id: str, kind: str = "text") -> list[float]:
        """When each of ``progress(turn_id, kind)`` arrived (``time.monotonic()``)."""
        return [when for _, when in self._progress(turn_id, kind)]

    def _progress(self, turn_id: str, kind: str) -> list[tuple[dict[str, Any], float]]:
        """The turn's progress events of ``kind``, each with when it arrived."""
        return [
            (args, when)
            for (event, args), when in zip(self.events, self.arrived, strict=True)
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

    async def open_browser(person: str | None = None) -> Browser:
        """A browser of ``person`` (a new person of their own when None)."""
        browser = await Browser(relay.url, await relay.people.token(person)).connect()
        opened.append(browser)
        return browser

    yield open_browser
    for browser in opened:
        await browser.close()


@pytest.fixture
async def browser(browsers: Callable[..., Any]) -> Browser:
    opened: Browser = await browsers()
    return opened


def ignore_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def ignore_interrupt() -> None:
    """As a shell script starts a job in the background: Ctrl-C ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def drone_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``hangar drone`` as a real subprocess (for tests that kill it)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(
        upstream: Upstream,
        server: str,
        name: str = "proc-drone",
        concurrency: int = 1,
        tools: str = "all=allow",
        env: dict[str, str] | None = None,
        token: str = DRONE_TOKEN,
        nohup: bool = False,
        background: bool = False,
    ) -> subprocess.Popen[bytes]:
        """``nohup``: started with SIGHUP ignored, as ``nohup hangar drone …`` starts it;
        ``background``: with SIGINT ignored, as ``hangar drone … &`` in a script starts it."""
        settings = upstream.drone_settings()
        args = [
            *HANGAR, "drone", "--server", server,
            "--token", token, "--name", name, "--concurrency", str(concurrency),
            "--provider", settings["provider"], "--model", settings["model"],
            "--workdir", str(tmp_path), "--tools", tools,
        ]  # fmt: skip
        if "base_url" in settings:
            args += ["--base-url", settings["base_url"], "--api-key", settings["api_key"]]
        else:
            args += ["--ollama-host", settings["ollama_host"]]
        log = open(tmp_path / f"{name}-{len(started)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=env and {**os.environ, **env},
            preexec_fn=ignore_hangup if nohup else ignore_interrupt if background else None,
        )  # fmt: skip
        log.close()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(10)


def drone_hello(drone_id: str, concurrency: int = 1) -> dict[str, Any]:
    """The connect ``auth`` of a hand-driven drone client."""
    return {
        "token": DRONE_TOKEN,
        "instance": f"instance-secret-of-{drone_id}",
        "droneId": drone_id,
        "name": drone_id.split("-")[0],
        "provider": "openai",
        "model": "m",
        "concurrency": concurrency,
    }


def need(service: str, reason: str) -> None:
    """Skip a test whose service is missing, except in CI, where it is a failure."""
    message = f"{service} is not reachable: {reason}"
    if ci():
        pytest.fail(f"{message} (required under CI=true)")
    pytest.skip(message)


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A fresh, empty PostgreSQL database for the test; dropped afterwards."""
    import asyncpg

    admin_url = os.environ.get(
        "HANGAR_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    try:
        admin = await asyncpg.connect(admin_url, timeout=5)
    except (OSError, asyncpg.PostgresError) as error:
        need("PostgreSQL", f"{admin_url}: {error}")
    name = f"hangar_test_{os.getpid()}_{id(admin)}"
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    """A Redis database emptied before and after the test."""
    import redis.asyncio as aioredis

    url = os.environ.get("HANGAR_TEST_REDIS", "redis://127.0.0.1:6379/15")
    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
    except (OSError, aioredis.RedisError) as error:
        await client.aclose()
        need("Redis", f"{url}: {error}")
    await client.flushdb()
    try:
        yield url
    finally:
        await client.flushdb()
        await client.aclose()


@dataclass
class RelayProcess:
    url: str
    process: asyncio.subprocess.Process
    database: str
    log: Path

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)


@pytest.fixture
async def relay_processes(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    """Start ``hangar serve`` subprocesses sharing one PostgreSQL database and one Redis."""
    started: list[RelayProcess] = []

    async def start(
        abort_grace: float = 2.0,
        drone_grace: float = 1.0,
        port: int = 0,
        redis: bool | str = True,
        database: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> RelayProcess:
        """``redis``: the shared test Redis, False for none, or a URL (a test's own server)."""
        # Appended to: the relay's writes never land where the test last read (one offset).
        log = open(tmp_path / f"relay-{len(started)}.log", "ab")  # noqa: SIM115, ASYNC230
        shared = ["--redis", redis if isinstance(redis, str) else redis_url] if redis else []
        process = await asyncio.create_subprocess_exec(
            *HANGAR, "serve", "--port", str(port),
            "--database", database or postgres_url, *shared, "--drone-token", DRONE_TOKEN,
            "--abort-grace", str(abort_grace), "--drone-grace", str(drone_grace), *extra,
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

        def listening() -> str | None:
            written = Path(log.name).read_bytes()
            found = re.search(rb"listening on (http://\S+)/", written)
            if process.returncode is not None:
                raise AssertionError(f"relay exited: {written.decode()}")
            return found.group(1).decode() if found else None

        url = await eventually(listening, timeout=20, what="the relay to listen")
        relay = RelayProcess(url, process, database or postgres_url, Path(log.name))
        started.append(relay)
        return relay

    yield start
    for relay in started:
        if relay.process.returncode is None:
            relay.kill()
        await relay.process.wait()


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    """A Redis of the test's own, which it may stall, kill or restart empty."""
    server = OwnRedis()
    server.start()
    yield server
    server.kill()


@pytest.fixture
async def own_postgres() -> AsyncIterator[OwnPostgres]:
    """A PostgreSQL cluster of the test's own, which it may kill and start again."""
    server = OwnPostgres()
    await asyncio.to_thread(server.init)
    await asyncio.to_thread(server.start)
    yield server
    await asyncio.to_thread(server.remove)


def ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
