"""What confinement costs a shell command: the time to run ``true`` bare, under the resource
limits, in a PID namespace of its own, in the bubblewrap sandbox, and through ``run_shell``
itself (spawn, read the output to its end, reap), each run one after the other. Then, for
``run_shell`` unconfined and sandboxed: a command printing 1 GB (time, and how far this process's
peak RSS rose) and the time from an abort to ``run_shell`` returning, a ``setsid`` grandchild
running.

    .venv/bin/python -m bench.sandbox [--runs 200] [--aborts 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import platform
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from hangar.drone.tools.sandbox import Sandbox, Unconfined, detect_sandbox, unconfined
from hangar.drone.tools.shell import run_shell
from hangar.shared.abort import AbortController, AbortError

from .common import run_main, summary, table

WARM_UP = 10
FLOOD = "head -c 1000000000 /dev/zero | tr '\\0' x"


async def spawn(argv: list[str], cwd: Path) -> None:
    """Start ``argv`` as ``run_shell`` does and wait for its end and its output's."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    await process.communicate()
    assert process.returncode == 0, (argv, process.returncode)


async def timed(runs: int, once: Callable[[], Awaitable[object]]) -> list[float]:
    seconds = []
    for i in range(WARM_UP + runs):
        started = time.perf_counter()
        await once()
        if i >= WARM_UP:
            seconds.append(time.perf_counter() - started)
    return seconds


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS


async def until(check: Callable[[], bool], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the command did not start")
        await asyncio.sleep(0.005)


async def flood(workdir: Path, sandbox: Sandbox | None) -> tuple[float, float]:
    """Seconds to run a command printing 1 GB, and the rise of peak RSS (MB) meanwhile."""
    reset_peak_rss()
    before = peak_rss_mb()
    started = time.perf_counter()
    with AbortController() as controller:
        await run_shell(workdir, FLOOD, controller.signal, 120, sandbox=sandbox)
    return time.perf_counter() - started, peak_rss_mb() - before


async def abort_once(workdir: Path, sandbox: Sandbox | None) -> float:
    """Seconds from the abort to ``run_shell`` raising, once the command has started."""
    marker = workdir / "started"
    marker.unlink(missing_ok=True)
    command = "setsid sleep 600 > /dev/null 2>&1 < /dev/null & touch started; sleep 600"
    with AbortController() as controller:
        task = asyncio.create_task(
            run_shell(workdir, command, controller.signal, 60, sandbox=sandbox)
        )
        await until(marker.exists)
        started = time.perf_counter()
        controller.abort()
        with contextlib.suppress(AbortError):
            await task
        return time.perf_counter() - started


def machine() -> str:
    """The kernel, Python and bubblewrap this was measured with."""
    found = detect_sandbox().sandbox
    bwrap = "no bubblewrap"
    if found is not None:
        said = subprocess.run([found.bwrap, "--version"], capture_output=True, check=False)
        bwrap = said.stdout.decode().strip()
    return f"{platform.system()} {platform.release()}, Python {platform.python_version()}, {bwrap}"


async def main_async(args: argparse.Namespace, about: str) -> None:
    status = detect_sandbox()
    reaped = unconfined()
    print(about)
    print(status.describe(network=False))
    print(f"Without it, commands run {reaped.describe()}.\n")
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as scratch, AbortController() as ctl:
        workdir = Path(scratch)
        argvs = [
            ("exec `true` (no shell)", ["true"]),
            ("`sh -c true`", ["/bin/sh", "-c", "true"]),
            ("`sh -c true` under prlimit", Unconfined().argv(workdir, "true", network=False)),
            ("+ PID namespace (setpriv, unshare)", reaped.argv(workdir, "true", network=False)),
        ]
        if status.sandbox is not None:
            for network in (False, True):
                name = f"bubblewrap sandbox, {'network' if network else 'no network'}"
                argvs.append((name, status.sandbox.argv(workdir, "true", network=network)))
        cases: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            (name, functools.partial(spawn, argv, workdir)) for name, argv in argvs
        ]
        shell = functools.partial(run_shell, workdir, "true", ctl.signal, 10)
        cases.append(("`run_shell`, unconfined", shell))
        if status.sandbox is not None:
            cases.append(
                (
                    "`run_shell`, sandbox, no network",
                    functools.partial(shell, sandbox=status.sandbox),
                )
            )
        rows = []
        for name, once in cases:
            seconds = await timed(args.runs, once)
            rows.append([name, str(len(seconds)), *summary(seconds)])
        print(table(["`true` run as", "n", "p50 ms", "p99 ms", "max ms"], rows) + "\n")

        places: list[tuple[str, Sandbox | None]] = [("unconfined", None)]
        if status.sandbox is not None:
            places.append(("sandbox", status.sandbox))
        rows = []
        for name, place in places:
            flooded, rise = await flood(workdir, place)
            aborts = [await abort_once(workdir, place) for _ in range(args.aborts)]
            rows.append([name, f"{flooded:.2f}", f"{rise:.1f}", str(len(aborts)), *summary(aborts)])
    headers = ["`run_shell`", "1 GB output s", "peak RSS rise MB", "aborts", "p50 ms", "p99 ms"]
    print(table([*headers, "max ms"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per case")
    parser.add_argument("--aborts", type=int, default=50, help="aborts per place")
    run_main(main_async(parser.parse_args(), machine()))


if __name__ == "__main__":
    main()
