"""Ctrl-C stops a drone promptly at every stage of its start (README: it exits "also while it
… waits for its relay"): while it makes its event loop ready, while it connects to a relay that
accepts connections but never answers, while it looks at what answers there, and while its
worker processes load; and it says nothing of Python's (no warning, no traceback) on the way.

The bound is the behaviour: the drone sat out the attempt under way first (its websocket's
5 s, then a look's 3 s), and each worker still loading for up to 5 s in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.test_cli import start, waiting_drone_args
from tests.test_drone_workers import alive, children_of, importing

STOP_WITHIN = 2.0
"""Seconds from a Ctrl-C to the drone's exit, whatever it was doing."""
KILLED = "did not exit; killed"
RUNNING = "work orders run in"
"""How a drone says its worker processes run."""


def python_said(stderr: str) -> list[str]:
    """Python's own words in ``stderr`` (a warning, such as a coroutine never awaited, or a
    traceback): a person who stops a drone sees none of them."""
    return [line for line in stderr.splitlines() if "Warning:" in line or "Traceback" in line]


def mapped(pid: int, path: str) -> bool:
    """Whether process ``pid`` has loaded the file at ``path`` (a compiled module, say)."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return path in Path(f"/proc/{pid}/maps").read_text()
    return False


class FrozenRelay:
    """A relay frozen: its kernel completes TCP handshakes, nothing ever answers. Each
    connection's request line goes to ``requests`` as it comes."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[str] = asyncio.Queue()
        self.port = 0
        self._held: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._take, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._held.append(writer)  # never written to, never closed while the test runs
        line = await reader.readline()
        await self.requests.put(line.decode(errors="replace").strip())

    async def request(self, wanted: str, timeout: float = 30) -> str:
        """The next request line, which must hold ``wanted``."""
        line = await asyncio.wait_for(self.requests.get(), timeout)
        assert wanted in line, line
        return line

    async def close(self) -> None:
        for writer in self._held:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def frozen_relay() -> AsyncIterator[FrozenRelay]:
    relay = FrozenRelay()
    await relay.open()
    yield relay
    await relay.close()


async def stopped(drone: asyncio.subprocess.Process) -> tuple[float, str]:
    """Ctrl-C ``drone``: the seconds it took to exit (killed past 30), and its standard error."""
    loop = asyncio.get_running_loop()
    asked = loop.time()
    drone.send_signal(signal.SIGINT)
    try:
        _, stderr = await asyncio.wait_for(drone.communicate(), 30)
    finally:
        if drone.returncode is None:
            drone.kill()
            await drone.wait()
    return loop.time() - asked, stderr.decode()


async def test_ctrl_c_while_the_drone_connects_to_a_frozen_relay_exits_at_once(
    frozen_relay: FrozenRelay,
) -> None:
    """The drone waited for its websocket's handshake to time out, then looked at what answers
    there, and said so, before it stopped: up to 8 s."""
    drone = await start(*waiting_drone_args(frozen_relay.port), "--workers", "0")
    await frozen_relay.request("transport=websocket")  # its connect is under way

    took, stderr = await stopped(drone)

    assert drone.returncode == 0, stderr
    assert took < STOP_WITHIN, stderr
    assert "trying again" not in stderr  # the attempt was given up, not finished
    assert python_said(stderr) == [], stderr


async def test_ctrl_c_while_the_drone_looks_at_a_frozen_relay_exits_at_once(
    frozen_relay: FrozenRelay,
) -> None:
    """The drone waited for its look at what answers to time out (3 s) before it stopped."""
    drone = await start(*waiting_drone_args(frozen_relay.port), "--workers", "0")
    await frozen_relay.request("transport=websocket")
    await frozen_relay.request("transport=polling")  # the websocket timed out: it looks

    took, stderr = await stopped(drone)

    assert drone.returncode == 0, stderr
    assert took < STOP_WITHIN, stderr
    assert "trying again" not in stderr
    assert python_said(stderr) == [], stderr


async def test_ctrl_c_while_the_drone_readies_its_loop_exits_130_without_a_warning() -> None:
    """README: a Ctrl-C while the program still loads exits 130 with no more to say. One that
    came once the drone had loaded uvloop, while it collected and froze its start-up heap or
    made its loop (before its own Ctrl-C handling runs), left its main coroutine made but never
    started: Python warned "RuntimeWarning: coroutine 'run.<locals>.main' was never awaited"."""
    loop_module = pytest.importorskip("uvloop.loop").__file__
    assert loop_module is not None
    with socket.socket() as down:  # a relay not up: nothing listens there
        down.bind(("127.0.0.1", 0))
        port = down.getsockname()[1]
        for _ in range(3):  # the moment varies a little with the machine's load
            drone = await start(*waiting_drone_args(port), "--workers", "0")
            try:
                await eventually(partial(mapped, drone.pid, loop_module), 30, "uvloop to load")
            except BaseException:
                drone.kill()
                await drone.wait()
                raise
            took, stderr = await stopped(drone)

            assert drone.returncode in (130, 0), stderr  # 0: its loop ran by then
            assert python_said(stderr) == [], stderr
            assert took < STOP_WITHIN, stderr


async def loading_drone(port: int, workers: int) -> tuple[asyncio.subprocess.Process, list[int]]:
    """A drone started for a relay at ``port``, once one of its ``workers`` loads; and the
    processes it started by then."""
    drone = await start(
        *waiting_drone_args(port), "--workers", str(workers), "--concurrency", str(workers)
    )

    def loading() -> bool:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            return any(importing(pid, "worker_process") for pid in children_of(drone.pid))
        return False

    try:
        await eventually(loading, timeout=30, what="a worker to load")
    except BaseException:
        drone.kill()
        await drone.wait()
        raise
    return drone, children_of(drone.pid)


@pytest.mark.parametrize("workers", [2, 16])
async def test_ctrl_c_while_the_workers_load_stops_them_at_once(workers: int) -> None:
    """Workers still loading run nothing yet: the drone closed their pipes and waited up to
    5 s for each in turn, which read its pipe only once loaded (2-15 s in all), then killed
    the late."""
    with socket.socket() as down:  # a relay not up: nothing listens there
        down.bind(("127.0.0.1", 0))
        drone, started = await loading_drone(down.getsockname()[1], workers)
        took, stderr = await stopped(drone)

    assert drone.returncode == 0, stderr
    assert KILLED not in stderr, stderr
    assert took < STOP_WITHIN, stderr
    assert python_said(stderr) == [], stderr
    await eventually(lambda: not any(map(alive, started)), 5, "the workers to end")


async def test_a_drone_stopped_while_its_workers_load_never_says_they_run() -> None:
    """The drone stopped its loading workers, then logged "work orders run in 2 worker
    processes" all the same, and only then gave up reaching its relay."""
    with socket.socket() as down:  # a relay not up: nothing listens there
        down.bind(("127.0.0.1", 0))
        drone, started = await loading_drone(down.getsockname()[1], 2)
        _, stderr = await stopped(drone)

    assert drone.returncode == 0, stderr
    assert RUNNING not in stderr, stderr
    assert "not up yet" not in stderr, stderr  # it did not go on to reach its relay
    assert python_said(stderr) == [], stderr
    await eventually(lambda: not any(map(alive, started)), 5, "the workers to end")
