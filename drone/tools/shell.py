"""``run_shell``: a command in the work directory, sandboxed where the machine allows it.

The command runs in its own process group, inside a bubblewrap sandbox (``Sandbox``) or, without
one, in a PID namespace of its own where the machine allows it (``sandbox.unconfined()``), so
everything it starts ends when it ends, when it is aborted and when the drone dies. On abort the
whole group gets SIGTERM, then SIGKILL after a short grace. Its output is read in bounded chunks:
the head and a short tail are kept, the rest is counted and dropped. A command that reaches its
time limit is ended the same way, and its error keeps what it printed until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal as signals
from pathlib import Path

from hangar.shared.abort import AbortSignal, AbortTimeoutError

from .capture import BoundedOutput, drain
from .errors import ToolError
from .sandbox import Sandbox, unconfined

KILL_GRACE = 1.0
LINGER = 0.5
"""After the command's first process exits, how long its output may still arrive (a process
that left its group and kept the pipe open, where there is no PID namespace to end it)."""
MAX_OUTPUT_CHARS = 20_000
TAIL_CHARS = 2_000


MAX_COMMAND_BYTES = 131_071
"""The most one argument of a process may hold on Linux (``MAX_ARG_STRLEN``, its NUL included):
the command is one, ``sh -c``'s."""


def check_command(command: str) -> None:
    """Raise ``ToolError`` for a command no process can be given."""
    if "\0" in command:  # no argument can carry it (some event loops cut it there)
        raise ToolError("The command contains a NUL character.")
    size = len(command.encode("utf-8", "surrogatepass"))
    if size > MAX_COMMAND_BYTES:
        raise ToolError(
            f"The command is {size:,} bytes, and a command may have at most "
            f"{MAX_COMMAND_BYTES:,}: write a longer one to a file with write_file, and run it."
        )


async def run_shell(
    workdir: Path,
    command: str,
    signal: AbortSignal,
    seconds: float,
    *,
    sandbox: Sandbox | None = None,
    network: bool = False,
) -> str:
    """Run ``command`` with ``sh -c``; "exit code N\\n<output>". ``network`` applies in the
    sandbox only (unconfined commands have the host's network)."""
    check_command(command)
    # The first call probes the machine (a few ms of subprocesses): off the event loop.
    place = sandbox if sandbox is not None else await asyncio.to_thread(unconfined)
    argv = place.argv(workdir, command, network=network)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env=place.environment,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group, so the group can be killed
        )
    except OSError as error:
        raise ToolError(f"The command could not be started: {error.strerror}.") from None
    assert process.stdout is not None
    output = BoundedOutput(MAX_OUTPUT_CHARS - TAIL_CHARS, TAIL_CHARS)
    reader = asyncio.ensure_future(drain(process.stdout, output))
    try:
        async with signal.scope(seconds):
            await process.wait()
            _signal_group(process.pid, signals.SIGKILL)  # what it left in its group ends too
            await asyncio.wait({reader}, timeout=LINGER)
    except AbortTimeoutError:
        await kill_group(process)
        signal.throw_if_aborted()  # the person's abort, not the command's own time limit
        await asyncio.wait({reader}, timeout=LINGER)  # what is still in the pipe
        printed = output.text()
        said = f"Its output until then:\n{printed}" if printed else "It printed nothing."
        raise ToolError(f"The command timed out after {seconds:g} s. {said}") from None
    except BaseException:
        await kill_group(process)
        raise
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await reader
        _release(process)
    return f"exit code {process.returncode}\n{output.text()}"


def _release(process: asyncio.subprocess.Process) -> None:
    """Close the command's pipes now. asyncio closes them only once it has read their end, which
    a cancelled reader may never do: left open, they outlive the work order (and its loop)."""
    transport = getattr(process, "_transport", None)
    if isinstance(transport, asyncio.SubprocessTransport):
        transport.close()


async def kill_group(process: asyncio.subprocess.Process) -> None:
    """TERM the process group, wait a grace for the leader, then KILL whatever is left.

    Bounded: the abort never waits on the command longer than two graces.
    """
    _signal_group(process.pid, signals.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), KILL_GRACE)
    _signal_group(process.pid, signals.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), KILL_GRACE)


def _signal_group(pgid: int, signal: signals.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal)
