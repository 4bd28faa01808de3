"""A drone, composed: its connection to the relays and its work orders (run in worker processes,
or in its own), all under one root controller. Ctrl-C and a relay's refusal abort the root; the
drone then reports every running work order aborted and exits."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Protocol

from hangar.shared.abort import AbortController, AbortError, AbortSignal

from .config import DEFAULT_MODELS, PROVIDERS, DroneConfig, make_provider
from .connection import DroneRefusedError, RelayConnection, WorkOrders
from .pool import WorkerPool, WorkerStartError
from .reach import reach_relay
from .service import AgentService, ToolSettings
from .status import StatusLine
from .tools.sandbox import detect_sandbox
from .worker_process import settings_wire

__all__ = ["DEFAULT_MODELS", "PROVIDERS", "DroneConfig", "make_provider", "run_drone"]

log = logging.getLogger("hangar.drone")

WORKERS_HINT = "--workers 0 runs work orders in the drone's own process"


def tool_settings(config: DroneConfig) -> ToolSettings | None:
    """How this drone's tools run, said in one line at start (the sandbox, or its absence)."""
    if not config.workdir:
        return None
    found = detect_sandbox()
    line = found.describe(network=config.shell_network)
    if found.available:
        log.info(line)
    else:
        log.warning("%s Commands always wait for a person's approval.", line)
    return ToolSettings(
        Path(config.workdir),
        policy=config.tools if found.available else config.tools.unconfined(),
        approval_timeout=config.approval_timeout,
        sandbox=found.sandbox,
        network=config.shell_network,
        allow_private_urls=config.allow_private_urls,
    )


class Work(WorkOrders, Protocol):
    """A drone's work orders: the agent service, or the worker pool running it."""

    async def drain(self) -> None: ...

    async def close(self) -> None: ...


async def start_work(config: DroneConfig, connection: RelayConnection, root: AbortSignal) -> Work:
    """The drone's work orders: in worker processes (``config.workers``), or in this one.

    Raises ``WorkerStartError`` if a worker process cannot start.
    """
    tools = tool_settings(config)
    if config.workers > 0:
        pool = WorkerPool(
            settings_wire(config, tools, log_level=logging.getLogger().getEffectiveLevel()),
            connection,
            root=root,
            workers=config.workers,
            concurrency=config.concurrency,
        )
        await pool.start()
        count = len(pool.workers)
        log.info("work orders run in %d worker process%s", count, "" if count == 1 else "es")
        return pool
    return AgentService(
        make_provider(config),
        connection,
        root=root,
        concurrency=config.concurrency,
        deadline=config.deadline,
        tools=tools,
        stall=config.stall,
    )


async def run_drone(config: DroneConfig, root: AbortController, live_status: bool = False) -> int:
    """Serve work orders until ``root`` is aborted or the relay refuses this drone.

    Until a relay answers it waits, trying again every few seconds. On the way out every
    running work order is reported ``aborted``; then it returns 0 (2 if a relay refused the
    drone, or its worker processes could not start). ``live_status`` draws a status line for a
    terminal.
    """
    connection = RelayConnection(config.server, config.record(), config.token)
    try:
        work = await start_work(config, connection, root.signal)
    except WorkerStartError as error:
        print(f"hangar drone: {error} ({WORKERS_HINT})", file=sys.stderr)
        return 2
    connection.take_orders(work)
    try:
        if not await reach_relay(connection, root.signal):
            await work.close()
            return 0  # stopped while it waited
    except DroneRefusedError as error:
        print(f"hangar drone: the relay refused this drone: {error}", file=sys.stderr)
        await work.close()
        return 2

    async def abort_when_refused() -> None:
        reason = await connection.wait_refused()
        root.abort(AbortError(f"The relay refused this drone: {reason}", cause="relay"))

    async def abort_when_cut_off(seconds: float) -> None:
        while True:
            await connection.cut_off.wait()
            try:
                await asyncio.wait_for(connection.connected.wait(), seconds)
                continue
            except TimeoutError:
                pass
            running = work.running_ids()
            if running:
                log.warning(
                    "no relay heard from for %g s: aborting %d running work order%s",
                    seconds,
                    len(running),
                    "" if len(running) == 1 else "s",
                )
            for turn_id in running:
                work.abort(turn_id, cause="cut_off")
            await connection.connected.wait()

    refused = asyncio.ensure_future(abort_when_refused())
    cut_off = asyncio.ensure_future(abort_when_cut_off(config.cut_off)) if config.cut_off else None
    drawing = asyncio.ensure_future(StatusLine(connection, work).run()) if live_status else None
    try:
        await root.signal.wait()
    finally:
        refused.cancel()
        if cut_off is not None:
            cut_off.cancel()
        if drawing is not None:
            drawing.cancel()
        if work.running_ids():
            log.info("aborting running work orders before exit")
        await work.drain()
        await connection.close()
        await work.close()
    if connection.refusal:
        print(f"hangar drone: the relay refused this drone: {connection.refusal}", file=sys.stderr)
        return 2
    return 0
