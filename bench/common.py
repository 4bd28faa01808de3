"""Shared benchmark setup: subprocesses (relay, drones, upstream peer), browser clients, stats."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import socketio

from hangar.shared import runtime

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TOKEN = "bench-drone-token-0123456789"
IDE = "/ide"
C = TypeVar("C")
"""A connection of any kind ``connect_each`` makes."""


@dataclass
class Proc:
    """A subprocess whose stdout and stderr go to ``log``."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_line(self, pattern: str, limit: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + limit
        while True:
            found = re.search(pattern, self.text())
            if found:
                return found
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {pattern!r} after {limit} s")
            await asyncio.sleep(0.05)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the benchmark process dies (Linux prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def run_main(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` that also unwinds (and so stops its subprocesses) on SIGTERM."""

    async def guarded() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await main

    try:
        runtime.run(guarded())
    except asyncio.CancelledError:
        sys.exit(143)


@dataclass
class Stack:
    """Every subprocess a benchmark started; ``stop()`` ends them all (SIGTERM, then SIGKILL)."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drone_workdir.mkdir(parents=True, exist_ok=True)

    @property
    def drone_workdir(self) -> Path:
        """The drones' ``--workdir``: not ``workdir``, which holds the relays' databases (a
        drone refuses a work directory holding one)."""
        return self.workdir / "drone-work"

    def spawn(self, name: str, args: Sequence[str], python: bool = True) -> Proc:
        log = self.workdir / f"{name}.log"
        argv = [PYTHON, *args] if python else list(args)
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, procs: Sequence[Proc] | None = None) -> None:
        chosen = list(procs) if procs is not None else list(self.procs)
        for proc in chosen:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in chosen:
            try:
                proc.popen.wait(5)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
            if proc in self.procs:
                self.procs.remove(proc)

    async def relay(
        self, name: str = "relay", database: str | None = None, redis: str | None = None
    ) -> tuple[str, Proc]:
        """A relay on a SQLite file of its own, or on ``database`` (with ``redis`` for several)."""
        db = database or str(self.workdir / f"{name}.db")
        args = ["-m", "bench.hangar_mono", "serve", "--port", "0", "--database", db]
        args += ["--redis", redis] if redis else []
        proc = self.spawn(name, [*args, "--drone-token", TOKEN])
        found = await proc.wait_line(r"listening on (http://127\.0\.0\.1:\d+)/")
        RELAY_DATABASES[found.group(1)] = db
        return found.group(1), proc

    async def forwarder(self) -> tuple[str, Proc]:
        """A bare python-socketio forwarder (``bench.forwarder``): the baseline server."""
        proc = self.spawn("forwarder", ["-m", "bench.forwarder"])
        found = await proc.wait_line(r"listening on (http://127\.0\.0\.1:\d+)/")
        return found.group(1), proc

    async def peer(
        self, provider: str, interval: float, chunks: int = 1_000_000
    ) -> tuple[str, Proc]:
        args = ["-m", "bench.peer", "--provider", provider, "--interval", str(interval)]
        args += ["--chunks", str(chunks)]
        proc = self.spawn(f"peer-{provider}", args)
        found = await proc.wait_line(r"PEER (http://\S+)")
        return found.group(1), proc

    def drone(self, relay: str, provider: str, peer: str, concurrency: int, name: str) -> Proc:
        upstream = (
            ["--base-url", peer + "/v1", "--api-key", "x", "--model", "m"]
            if provider == "openai"
            else ["--ollama-host", peer, "--model", "m"]
        )
        args = ["-m", "bench.hangar_mono", "drone", "--server", relay, "--token", TOKEN]
        args += ["--name", name, "--provider", provider, *upstream]
        args += ["--concurrency", str(concurrency), "--workdir", str(self.drone_workdir)]
        return self.spawn(name, args)


def get_json(url: str, method: str = "GET") -> Any:
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


async def peer_requests(
    peer: str, enough: Callable[[list[dict[str, Any]]], bool], within: float = 15
) -> list[dict[str, Any]]:
    """What the upstream peer saw (``GET /bench/requests``), read again every 0.1 s until
    ``enough`` holds of it or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        rows: list[dict[str, Any]] = await asyncio.to_thread(get_json, peer + "/bench/requests")
        if enough(rows) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.1)


RELAY_DATABASES: dict[str, str] = {}
"""The database of each relay a ``Stack`` started, by URL: where its people are made."""


async def people(url: str, count: int) -> list[str | None]:
    """API tokens of ``count`` new people of the relay at ``url`` (Nones for a bare forwarder,
    which has no accounts). Each browser connection of a benchmark is a person of its own."""
    database = RELAY_DATABASES.get(url)
    if database is None:
        return [None] * count
    from hangar.server.accounts import Accounts
    from hangar.server.app import open_store

    store = open_store(database)
    await store.open()
    try:
        accounts = Accounts(store)
        tokens: list[str | None] = []
        for _ in range(count):
            name = f"bench-{os.urandom(6).hex()}"
            await accounts.add_user(name, None)
            tokens.append(await accounts.create_api_token(name, "benchmark"))
        return tokens
    finally:
        await store.close()


async def wait_drones(relay: str, count: int, limit: float = 30.0) -> None:
    """Wait until ``count`` drones are online (``listDrones``)."""
    browser = await Browser(relay, (await people(relay, 1))[0]).connect()
    try:
        deadline = time.monotonic() + limit
        while len((await browser.sio.call("listDrones", {}, namespace=IDE))["drones"]) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} drones connected after {limit} s")
            await asyncio.sleep(0.1)
    finally:
        await browser.close()


def log_times(text: str, pattern: str) -> dict[str, tuple[float, re.Match[str]]]:
    """Per group 1 of ``pattern``: the ``time.monotonic()`` stamp and match of its first line."""
    found: dict[str, tuple[float, re.Match[str]]] = {}
    for line in re.finditer(r"^(\d+\.\d+) (.*)$", text, re.MULTILINE):
        match = re.search(pattern, line.group(2))
        if match:
            found.setdefault(match.group(1), (float(line.group(1)), match))
    return found


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class TurnsSeen:
    """What a benchmark's browser records of its turns: progress events counted, the first
    one and the completion stamped (``Browser``, and ``bench.light``'s cheaper client)."""

    def __init__(self) -> None:
        self.progress: dict[str, int] = {}
        self.first_progress: dict[str, asyncio.Event] = {}
        self.completed: dict[str, tuple[float, bool, str]] = {}
        self.done: dict[str, asyncio.Event] = {}

    def _watch(self, turn_id: str) -> None:
        self.first_progress.setdefault(turn_id, asyncio.Event())
        self.done.setdefault(turn_id, asyncio.Event())

    def _progressed(self, turn_id: str) -> None:
        self.progress[turn_id] = self.progress.get(turn_id, 0) + 1
        self._watch(turn_id)
        self.first_progress[turn_id].set()

    def _ended(self, turn_id: str, success: bool, message: str) -> None:
        self.completed.setdefault(turn_id, (time.monotonic(), success, message))
        self._watch(turn_id)
        self.done[turn_id].set()

    def _submitted(self, ack: dict[str, Any]) -> str:
        """The turn a submit's answer made (watched from now on); refused raises."""
        if not ack.get("ok"):
            raise RuntimeError(f"submit refused: {ack}")
        turn_id: str = ack["turnId"]
        self._watch(turn_id)
        return turn_id


class Browser(TurnsSeen):
    """A socket.io client on ``/ide``: submits work orders, aborts them, stamps what arrives."""

    def __init__(self, url: str, token: str | None = None) -> None:
        super().__init__()
        self.url = url
        self.token = token
        self.sio = socketio.AsyncClient(reconnection=False)
        self.sio.on("workOrderProgress", self._on_progress, namespace=IDE)
        self.sio.on("workOrderComplete", self._on_complete, namespace=IDE)

    async def connect(self) -> Browser:
        auth = {"token": self.token} if self.token else None
        await self.sio.connect(self.url, namespaces=[IDE], auth=auth, transports=["websocket"])
        return self

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.sio.disconnect()

    async def _on_progress(self, data: dict[str, Any]) -> None:
        self._progressed(data["turnId"])

    async def _on_complete(self, turn_id: str, success: bool, message: str) -> None:
        self._ended(turn_id, success, message)

    async def submit(self, prompt: str) -> str:
        ack = await self.sio.call("submitWorkOrder", {"prompt": prompt}, namespace=IDE, timeout=60)
        return self._submitted(ack)

    async def abort(self, turn_id: str) -> tuple[float, float, bool, str]:
        """Emit ``abortWorkOrder``; returns (emitted at, acked at, success, message)."""
        acked: asyncio.Future[tuple[float, bool, str]] = asyncio.get_running_loop().create_future()

        def on_ack(success: bool, message: str) -> None:
            acked.set_result((time.monotonic(), success, message))

        emitted = time.monotonic()
        await self.sio.emit("abortWorkOrder", {"turnId": turn_id}, namespace=IDE, callback=on_ack)
        at, success, message = await asyncio.wait_for(acked, 30)
        return emitted, at, success, message


class Client(Protocol):
    """What the burst benchmarks need of a browser: ``Browser``, or ``bench.light``'s."""

    first_progress: dict[str, asyncio.Event]
    done: dict[str, asyncio.Event]
    completed: dict[str, tuple[float, bool, str]]

    async def submit(self, prompt: str) -> str: ...

    async def abort(self, turn_id: str) -> tuple[float, float, bool, str]: ...

    async def close(self) -> None: ...


async def connect_each(
    url: str, count: int, connect: Callable[[str | None], Awaitable[C]], batch: int = 25
) -> list[C]:
    """``count`` connections, a person each (``connect`` takes the person's token), ``batch``
    at a time."""
    made: list[C] = []
    tokens = await people(url, count)
    for start in range(0, count, batch):
        made += await asyncio.gather(*(connect(token) for token in tokens[start : start + batch]))
    return made


async def connect_browsers(url: str, count: int, batch: int = 25) -> list[Browser]:
    return await connect_each(url, count, lambda token: Browser(url, token).connect(), batch)


async def connect_clients(url: str, count: int, light: bool) -> list[Client]:
    """``count`` browsers, a person each: python-socketio clients, or with ``light`` the
    cheaper ones of ``bench.light``."""
    if not light:
        return list(await connect_browsers(url, count))
    from .light import LightBrowser

    return list(await connect_each(url, count, lambda token: LightBrowser(url, token).connect()))


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (p99 of 50 samples is the largest, of 200 the third largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(values: Sequence[float]) -> list[str]:
    """p50, p99, max in ms of values in seconds (n/a when empty)."""
    if not values:
        return ["n/a", "n/a", "n/a"]
    return [f"{quantile(values, q) * 1000:.1f}" for q in (0.5, 0.99, 1.0)]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def task_seconds(pid: int) -> tuple[float, float]:
    """Seconds the process's live threads have run so far, and waited to run (runnable, no
    core free), from each thread's ``schedstat``; the run time from the process's ``stat``
    (in ticks of 10 ms, no wait) where the kernel keeps no ``schedstat``."""
    ran = waited = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it just ended
                run, wait, _ = (task / "schedstat").read_text().split()
                ran, waited = ran + int(run), waited + int(wait)
    except FileNotFoundError:
        pass
    if ran == 0 and not Path(f"/proc/{pid}/schedstat").exists():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 0.0
    return ran / 1e9, waited / 1e9


def with_children(pid: int) -> list[int]:
    """``pid`` and its descendants (a drone's worker processes), for ``cpu_load``."""
    found, i = [pid], 0
    while i < len(found):
        for task in Path(f"/proc/{found[i]}/task").glob("*/children"):
            found += [int(child) for child in task.read_text().split()]
        i += 1
    return found


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far (all cores, from /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuLoad(dict[str, float]):
    """Per name, the CPU share used (1.0 = one core, summed over its processes); ``others``:
    what the rest of the machine used (from ``/proc/stat``, in ticks of 10 ms: rough over a
    short block, and never below 0). ``waited``: per name, the share of a core its threads
    spent runnable but waiting for one (0 where the kernel does not say). ``seconds``: per
    name, the CPU seconds it used (``others`` too)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def per_item(self, count: int) -> str:
        """``seconds`` per item of ``count``, in ms, and their sum: "relay 0.52, ..., all
        1.40 ms". Unlike a share of a core, this does not depend on how long the block took."""
        if count <= 0:
            return "no items"
        parts = [f"{name} {spent * 1000 / count:.2f}" for name, spent in self.seconds.items()]
        return ", ".join([*parts, f"all {self.total() * 1000 / count:.2f} ms"])

    def total(self) -> float:
        """The CPU seconds every process used in the block, ``others`` included."""
        return sum(self.seconds.values())

    def waits(self) -> str:
        """``waited`` as text: "relay 12%, drones 30%"."""
        return ", ".join(f"{name} {share:.0%}" for name, share in self.waited.items())


@contextlib.contextmanager
def cpu_load(pids: dict[str, list[int]]) -> Iterator[CpuLoad]:
    """The CPU the named groups of processes used in the block, and how long they waited for
    a core (``CpuLoad``)."""
    result = CpuLoad()
    start, machine = time.monotonic(), busy_seconds()
    before = {name: [task_seconds(p) for p in group] for name, group in pids.items()}
    yield result
    elapsed = time.monotonic() - start
    for name, group in pids.items():
        spent = [
            (now[0] - then[0], now[1] - then[1])
            for now, then in zip([task_seconds(p) for p in group], before[name], strict=True)
        ]
        result.seconds[name] = sum(ran for ran, _ in spent)
        result[name] = result.seconds[name] / elapsed
        result.waited[name] = sum(waited for _, waited in spent) / elapsed
    rest = busy_seconds() - machine - sum(result.seconds.values())
    result.seconds["others"] = max(0.0, rest)
    result["others"] = result.seconds["others"] / elapsed


async def wait_quiet(limit: float = 30.0, threshold: float = 0.3) -> str:
    """Wait (at most ``limit`` s) until the machine is nearly idle for a second, so other
    processes' load does not distort a measurement; says how it went."""
    start = time.monotonic()
    while True:
        machine = busy_seconds()
        await asyncio.sleep(1.0)
        load = busy_seconds() - machine
        waited = time.monotonic() - start
        if load < threshold:
            return f"machine quiet after {waited:.0f} s ({load:.0%} of a core busy)"
        if waited >= limit:
            return f"machine still busy after {waited:.0f} s ({load:.0%} of a core): noisy"
