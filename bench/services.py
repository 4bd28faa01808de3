"""Redis and PostgreSQL servers of their own, on loopback, for faults (the tests' and the chaos
benchmark's): killed, paused and restarted by their PID. The machine's shared servers are never
touched."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

STOP_TIMEOUT = 10


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class OwnRedis:
    """``redis-server --port N --save ''``: nothing on disk, so a restart comes back empty."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.options = options
        """More of ``redis-server``'s options (``--rename-command EVAL ''``, say)."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--loglevel", "warning", *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for_port(self.port)

    def kill(self) -> None:
        """Gone at once (SIGKILL), as a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT)

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Killed and started again on the same port, empty."""
        self.kill()
        self.start()


class OwnPostgres:
    """An ``initdb`` cluster in a temporary folder, started with ``pg_ctl`` on a port of its own
    (as the ``postgres`` user when the tests run as root, which initdb refuses)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="hangar-pg-"))
        self.data = self.folder / "data"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.folder, "postgres")

    @property
    def url(self) -> str:
        # Without SSL (the cluster has none): asyncpg's first try at it, cut by the cluster's
        # death, leaves an error in a future nobody reads, which asyncio logs as an ERROR.
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres?sslmode=disable"

    def _run(self, *argv: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        subprocess.run(
            [*prefix, *argv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=60,
        )  # fmt: skip

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"),
                  "-w", "start")  # fmt: skip

    @property
    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def kill(self) -> None:
        """Stopped as a crash does (``-m immediate``: every backend quits at once, no
        checkpoint; the next start recovers)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _wait_for_port(port: int, attempts: int = 500) -> None:
    for _ in range(attempts):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.01)  # polling a server process that is starting; bounded above
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")
