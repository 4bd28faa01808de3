"""``run_shell`` in the bubblewrap sandbox (the confinement list of README "Tools"), and the
reaping every shell command gets, sandboxed or not: nothing it starts outlives its abort or the
drone, a ``setsid`` grandchild included.

The sandbox tests skip where bubblewrap is missing or cannot run, and fail instead under CI=true.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import uvloop

from hangar.drone.tools import ToolError
from hangar.drone.tools.sandbox import (
    Limits,
    Sandbox,
    SandboxStatus,
    detect_sandbox,
    unconfined,
)
from hangar.drone.tools.shell import run_shell
from hangar.shared.abort import AbortController, AbortError
from tests.conftest import ROOT, ci, eventually


def the_sandbox() -> Sandbox:
    status: SandboxStatus = detect_sandbox()
    if status.sandbox is None:
        message = f"No bubblewrap sandbox here: {status.reason} (apt-get install bubblewrap)"
        if ci():
            pytest.fail(f"{message}; required under CI=true")
        pytest.skip(message)
    return status.sandbox


@pytest.fixture
def sandbox() -> Sandbox:
    return the_sandbox()


@pytest.fixture(params=["unconfined", "sandbox"])
def place(request: pytest.FixtureRequest) -> Sandbox | None:
    """Where a command runs: each reaping test runs both ways."""
    if request.param == "sandbox":
        return the_sandbox()
    if not unconfined().pid_namespace:
        pytest.skip("No PID namespace here for unconfined commands (needs root or user namespaces)")
    return None


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder.resolve()


async def shell(workdir: Path, command: str, sandbox: Sandbox | None, network: bool = False) -> str:
    with AbortController() as controller:
        return await run_shell(
            workdir, command, controller.signal, 30, sandbox=sandbox, network=network
        )


# ---- processes seen from the host


def processes_running(*argv: str) -> list[int]:
    """Host pids of live processes whose command line is exactly ``argv``."""
    wanted = "\0".join(argv) + "\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_text() == wanted and _alive(entry):
                found.append(int(entry.name))
        except OSError:  # gone while it was read
            continue
    return found


def _alive(entry: Path) -> bool:
    return (entry / "stat").read_text().rsplit(") ", 1)[-1][0] != "Z"


def unique_sleep() -> tuple[str, str]:
    """A ``sleep`` command line no other process has (its duration is the marker)."""
    return ("sleep", str(random.randint(10**8, 10**9)))


def grandchild_command(sleeper: tuple[str, str]) -> str:
    """A command that starts a grandchild in a session of its own, then waits."""
    return f"setsid {' '.join(sleeper)} > /dev/null 2>&1 < /dev/null & sleep 600"


async def started(sleeper: tuple[str, str]) -> list[int]:
    found: list[int] = await eventually(
        lambda: processes_running(*sleeper), what="the setsid grandchild"
    )
    return found


# ---- confinement


async def test_a_sandboxed_command_reads_and_writes_the_work_directory(
    sandbox: Sandbox, workdir: Path
) -> None:
    (workdir / "in.txt").write_text("from the host")

    result = await shell(workdir, "cat in.txt; echo made here > out.txt; pwd", sandbox)

    assert result == f"exit code 0\nfrom the host{workdir}\n"
    assert (workdir / "out.txt").read_text() == "made here\n"


@pytest.mark.parametrize("confined", [True, False], ids=["sandboxed", "unconfined"])
def test_a_command_with_a_nul_is_refused_not_run_cut_at_it(
    sandbox: Sandbox, workdir: Path, confined: bool
) -> None:
    """On uvloop, the drone's event loop, an argument is cut at a NUL instead of refused: what
    ran was not what the person approved."""
    (workdir / "build").mkdir()
    command = "rm -rf build\0/cache"
    running = run_shell(
        workdir, command, AbortController().signal, 30, sandbox=sandbox if confined else None
    )

    with pytest.raises(ToolError, match="NUL character"):
        uvloop.run(running)
    assert (workdir / "build").is_dir()


async def test_a_sandboxed_command_cannot_write_outside_the_work_directory(
    sandbox: Sandbox, workdir: Path, tmp_path: Path
) -> None:
    targets = [
        tmp_path / "beside-the-workdir.txt",  # its parent: the sandbox's /tmp is its own
        Path(f"/tmp/hangar-escape-{uuid.uuid4().hex}"),
        Path(f"/usr/hangar-escape-{uuid.uuid4().hex}"),
        Path(f"/root/hangar-escape-{uuid.uuid4().hex}"),
        Path(f"/var/tmp/hangar-escape-{uuid.uuid4().hex}"),
    ]
    command = "; ".join(f"echo escaped > {target}" for target in targets)

    result = await shell(workdir, command, sandbox)

    assert "Read-only file system" in result  # /usr
    assert [target for target in targets if target.exists()] == []


async def test_a_sandboxed_command_cannot_fill_the_machines_memory_outside_its_bounds(
    sandbox: Sandbox, workdir: Path
) -> None:
    """The sandbox's root and ``/dev`` are memory-backed: a command wrote gigabytes there,
    past its 1 GiB ``/tmp``. Now they are read-only, and ``/dev/shm`` is bounded; what
    commands need of them still works."""
    command = (
        "mkdir /made; echo x > /dev/made; "
        "head -c 100000000 /dev/zero > /dev/shm/big; echo shm $?; rm /dev/shm/big; "
        "echo > /dev/null && echo null writable; "
        "python3 -c 'import multiprocessing as m; print(m.Pool(2).map(abs, [-1, -2]))'"
    )

    result = await shell(workdir, command, sandbox)

    assert "cannot create directory '/made': Read-only" in result.replace("‘", "'").replace(
        "’", "'"
    )
    assert "cannot create /dev/made: Read-only file system" in result
    assert "No space left on device" in result and "shm 1" in result
    assert result.endswith("null writable\n[1, 2]\n"), result


async def test_a_sandboxed_command_sees_no_home_no_drone_files_and_no_drone_environment(
    sandbox: Sandbox, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = Path.home() / f"hangar-secret-{uuid.uuid4().hex}"
    secret.write_text("the operator's secret")
    monkeypatch.setenv("HANGAR_TEST_SECRET", "token-in-the-drone-environment")
    hidden = [secret, "/home", "/root", ROOT, "/etc/shadow", "/etc/ssh", "/etc/hostname"]
    hidden += ["/var", "/run", "/opt", "/srv", "/mnt", "/sys"]
    checks = "; ".join(f"test -e {path} && echo present: {path}" for path in hidden)
    try:
        # Every process in the sandbox: the command's, and bwrap's own (PID 1 there).
        environments = "for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done"
        result = await shell(workdir, f"{checks}; cat {secret} 2>&1; env; {environments}", sandbox)
    finally:
        secret.unlink()

    assert "present:" not in result
    assert "the operator's secret" not in result
    assert "token-in-the-drone-environment" not in result


async def test_a_sandboxed_command_has_no_capabilities_to_undo_its_read_only_mounts(
    sandbox: Sandbox, workdir: Path
) -> None:
    planted = Path(f"/usr/hangar-escape-{uuid.uuid4().hex}")

    result = await shell(
        workdir,
        f"grep CapEff /proc/self/status; mount -o remount,rw,bind /usr 2>/dev/null; "
        f"touch {planted} 2>/dev/null || echo still read-only",
        sandbox,
    )

    assert result == "exit code 0\nCapEff:\t0000000000000000\nstill read-only\n"
    assert planted.name not in os.listdir("/usr")


KERNEL_SETTINGS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
"""What of ``/proc`` changes the whole machine: a drone running as root stays root (uid 0) in
its sandbox, and writing these needs no capability, only their owner's permission."""


def on_this_machine(paths: tuple[str, ...]) -> list[str]:
    return [path for path in paths if os.path.exists(path)]


async def test_a_sandboxed_command_cannot_change_the_machines_kernel_settings(
    sandbox: Sandbox, workdir: Path
) -> None:
    """A command of a drone running as root wrote the host's ``/proc/sys`` (a sysctl changed
    for the whole machine; ``kernel/core_pattern`` runs a program as the host's root). Each
    such part of ``/proc`` is read-only there; writing a setting's own value back shows it
    without changing the machine whatever the outcome."""
    setting = "/proc/sys/kernel/printk_ratelimit"
    mounts = " ".join(KERNEL_SETTINGS)
    option = "awk -v m=$m '$5 == m { split($6, o, \",\"); print m, o[1] }' /proc/self/mountinfo"
    command = (
        f"for m in {mounts}; do test -e $m || continue; {option}; done; "
        f'v=$(cat {setting}) && (echo "$v" > {setting}) 2>/dev/null && echo wrote the setting; '
        "echo checked"
    )

    result = await shell(workdir, command, sandbox)

    seen = dict(line.split() for line in result.splitlines() if line.startswith("/proc"))
    assert "wrote the setting" not in result, result
    assert result.endswith("checked\n"), result
    present = on_this_machine(KERNEL_SETTINGS)
    assert present and {m: seen.get(m) for m in present} == dict.fromkeys(present, "ro")


async def test_a_sandboxed_command_has_namespaces_of_its_own_and_cannot_make_more(
    sandbox: Sandbox, workdir: Path
) -> None:
    kinds = ("user", "pid", "ipc", "uts", "cgroup", "net", "mnt")
    ours = {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in kinds}
    listing = " ".join(f"$(readlink /proc/self/ns/{kind})" for kind in kinds)

    result = await shell(
        workdir,
        f"echo {listing}; hostname; unshare --user true 2>/dev/null || echo no nested namespace",
        sandbox,
    )

    lines = result.splitlines()
    theirs = dict(zip(kinds, lines[1].split(), strict=True))
    assert [kind for kind in kinds if theirs[kind] == ours[kind]] == []
    assert lines[2:] == ["sandbox", "no nested namespace"]


async def test_a_sandboxed_command_runs_python_and_git(sandbox: Sandbox, workdir: Path) -> None:
    result = await shell(
        workdir,
        "python3 -c 'print(6 * 7)' && git init -q . && git status --short && echo git ok",
        sandbox,
    )

    assert result == "exit code 0\n42\ngit ok\n"


async def test_a_sandboxed_command_has_no_network_unless_it_is_allowed(
    sandbox: Sandbox, workdir: Path
) -> None:
    connected = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connect = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 5)\""
    try:
        refused = await shell(workdir, f"{connect} 2>/dev/null || echo unreachable", sandbox)
        assert refused == "exit code 0\nunreachable\n"
        assert not connected.is_set()

        allowed = await shell(workdir, f"{connect} && echo reached", sandbox, network=True)
        assert allowed == "exit code 0\nreached\n"
        assert connected.is_set()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_sandboxed_command_cannot_hard_link_a_file_from_outside(
    sandbox: Sandbox, workdir: Path
) -> None:
    result = await shell(workdir, "ln /usr/bin/env env-link; ln /etc/passwd passwd-link", sandbox)

    assert result.count("Invalid cross-device link") == 2
    assert os.listdir(workdir) == []


# ---- reaping, sandboxed or not


LIMITS = "grep -E 'Max (cpu time|file size|address space|processes)' /proc/self/limits"


def limits_seen(result: str) -> dict[str, int]:
    """``Max …`` lines of /proc/self/limits, as the command saw them: name -> soft limit."""
    seen = {}
    for line in result.splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:].split()[0]
        seen[name] = int(soft)
    return seen


async def test_every_command_runs_under_the_limits_the_readme_names(
    place: Sandbox | None, workdir: Path
) -> None:
    seen = limits_seen(await shell(workdir, LIMITS, place))

    assert seen["Max cpu time"] == 300
    assert seen["Max address space"] == 4 << 30
    assert seen["Max file size"] == 1 << 30
    if place is not None:  # counted in the sandbox's own user namespace
        assert seen["Max processes"] == 512
        tmp = await shell(workdir, "df -k /tmp | tail -1", place)
        assert tmp.split()[3:5] == ["tmpfs", str((1 << 30) // 1024)]  # its own 1 GiB /tmp


async def test_a_sandboxed_command_past_a_limit_is_stopped_and_writes_no_more(
    sandbox: Sandbox, workdir: Path
) -> None:
    tight = replace(
        sandbox, limits=Limits(cpu_seconds=1, address_space=256 << 20, file_size=1 << 20)
    )
    small_tmp = replace(sandbox, limits=Limits(tmp_size=1 << 20))

    spin = await asyncio.wait_for(shell(workdir, "python3 -c 'while True: pass'", tight), 10)
    memory = await shell(workdir, "python3 -c 'b = bytearray(512 << 20)'", tight)
    big_file = await shell(workdir, "head -c 3000000 /dev/zero > big; echo written", tight)
    full_tmp = await shell(workdir, "head -c 3000000 /dev/zero > /tmp/big", small_tmp)

    assert spin.startswith("exit code 137\n")  # killed at its second of CPU
    assert memory.startswith("exit code 1\n") and "MemoryError" in memory
    assert "File size limit exceeded" in big_file
    assert (workdir / "big").stat().st_size == 1 << 20
    assert "No space left on device" in full_tmp


async def test_abort_ends_a_command_and_its_setsid_grandchild_promptly(
    place: Sandbox | None, workdir: Path
) -> None:
    sleeper = unique_sleep()
    with AbortController() as controller:
        running = asyncio.create_task(
            run_shell(workdir, grandchild_command(sleeper), controller.signal, 60, sandbox=place)
        )
        await started(sleeper)

        controller.abort()

        with pytest.raises(AbortError):
            await asyncio.wait_for(running, 2.5)  # bound: TERM, then KILL after a 1 s grace
    await eventually(lambda: not processes_running(*sleeper), timeout=2, what="no survivor")


async def test_a_command_ends_what_it_left_running_when_it_exits(
    place: Sandbox | None, workdir: Path
) -> None:
    sleeper = unique_sleep()
    command = f"{' '.join(sleeper)} & setsid {' '.join(sleeper)} > /dev/null 2>&1 & echo left"

    result = await asyncio.wait_for(shell(workdir, command, place), 10)

    assert result == "exit code 0\nleft\n"
    await eventually(lambda: not processes_running(*sleeper), timeout=2, what="no survivor")


DRONE_STAND_IN = """
import asyncio, sys
from pathlib import Path
from hangar.drone.tools.sandbox import detect_sandbox
from hangar.drone.tools.shell import run_shell
from hangar.shared.abort import AbortController

async def main() -> None:
    sandbox = detect_sandbox().sandbox if sys.argv[3] == "sandbox" else None
    with AbortController() as controller:
        await run_shell(Path(sys.argv[1]), sys.argv[2], controller.signal, 600, sandbox=sandbox)

asyncio.run(main())
"""


@pytest.fixture
async def stand_ins() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    started: list[asyncio.subprocess.Process] = []
    yield started
    for process in started:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_a_drone_killed_with_sigkill_leaves_no_process_of_its_commands(
    place: Sandbox | None, workdir: Path, stand_ins: list[asyncio.subprocess.Process]
) -> None:
    sleeper = unique_sleep()
    mode = "unconfined" if place is None else "sandbox"
    drone = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DRONE_STAND_IN, str(workdir), grandchild_command(sleeper), mode
    )
    stand_ins.append(drone)
    await started(sleeper)

    os.kill(drone.pid, signal.SIGKILL)
    await drone.wait()

    await eventually(lambda: not processes_running(*sleeper), timeout=3, what="no survivor")


def test_the_sandbox_status_says_in_one_line_how_commands_run() -> None:
    status = detect_sandbox()
    line = status.describe(network=False)
    if status.available:
        assert line == (
            "Shell commands run in a bubblewrap sandbox (work directory writable, no network)."
        )
    else:
        assert line.startswith("No sandbox available (")
    assert "\n" not in line
