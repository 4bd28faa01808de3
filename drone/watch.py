"""Whether a drone's worker processes answer: each is pinged every ``WORKER_PING``, and one
whose loop leaves its pings unanswered for ``WORKER_SILENT`` (frozen, stopped) is killed, to be
replaced as a dead one is (``pool.WorkerPool``): its work orders end instead of running on past
every bound of theirs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from .pipes import WorkerProcess, frame

log = logging.getLogger("hangar.drone")

WORKER_PING = 1.0
"""Seconds between the drone's asking each worker whether its loop runs."""
WORKER_SILENT = 15.0
"""Seconds a worker may leave that unanswered (frozen, stopped) before it is replaced."""
STOPPING_SILENT = 3.0
"""The same once the drone stops: its work orders were aborted, and a worker that does not
answer is not waited for (the drone would hang on its way out)."""
PING = frame(["ping"])


def silent(worker: WorkerProcess) -> bool:
    """Whether ``worker`` left its last pings unanswered (frozen, say): new work goes to others."""
    return asyncio.get_running_loop().time() - worker.answered > 2 * WORKER_PING


async def watch(workers: list[WorkerProcess], stopping: Callable[[], bool]) -> None:
    """Ping ``workers`` and kill those that stopped answering, for ever."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(WORKER_PING)
        if loop.time() - before > 2 * WORKER_PING:  # the drone itself was stopped or starved:
            for worker in workers:  # its workers' answers wait unread, not late
                worker.answered = max(worker.answered, loop.time())
        bound = STOPPING_SILENT if stopping() else WORKER_SILENT
        for worker in workers:
            process = worker.process
            if process is None or process.returncode is not None or not worker.ready.is_set():
                continue  # starting (``pool.START_WITHIN``), or being replaced
            quiet = loop.time() - worker.answered
            if quiet < bound:
                worker.send(PING)
                continue
            log.warning("%s has not answered for %.0f s: it is replaced", worker.name, quiet)
            worker.ready.clear()
            with contextlib.suppress(ProcessLookupError):
                process.kill()
