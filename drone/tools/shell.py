"""``run_shell``: a command in the work directory, in its own process group.

On abort the whole group gets SIGTERM, then SIGKILL after a short grace, so no child is orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal as signals
from pathlib import Path

from hangar.shared.abort import AbortSignal, AbortTimeoutError

from .errors import ToolError

KILL_GRACE = 1.0
MAX_OUTPUT_CHARS = 20_000


async def run_shell(workdir: Path, command: str, signal: AbortSignal, seconds: float) -> str:
    process = await asyncio.create_subprocess_shell(
        command,
        cwd=workdir,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group, so the group can be killed
    )
    try:
        async with signal.scope(seconds):
            output, _ = await process.communicate()
    except AbortTimeoutError:
        await kill_group(process)
        signal.throw_if_aborted()  # the person's abort, not the command's own time limit
        raise ToolError(f"The command timed out after {seconds:g} s.") from None
    except BaseException:
        await kill_group(process)
        raise
    text = output.decode("utf-8", errors="replace")
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + f"\n[… {len(text) - MAX_OUTPUT_CHARS} more characters]"
    return f"exit code {process.returncode}\n{text}"


async def kill_group(process: asyncio.subprocess.Process) -> None:
    """TERM the process group, wait a grace for the leader, then KILL whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signals.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), KILL_GRACE)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signals.SIGKILL)
    await process.wait()
