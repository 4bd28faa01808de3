"""A drone's worker process: runs work orders with ``AgentService`` on an event loop of its own.

The drone (``pool.WorkerPool``) starts it as ``python -m hangar.drone.worker_process``, writes
its settings as the first frame on its stdin and then orders (with only the part of their
history this worker does not keep), aborts, approvals, ``forget`` and ``stop``;
the worker writes progress, completions and its log records to its stdout (``outbox``). Its
event loop runs at a lower CPU priority than the drone's, so the drone's connection, acks and
heartbeats win the CPU when the cores are busy.

A thread of normal priority reads what the drone sends. An abort shuts the work order's model
streams down from that thread at once (``Upstreams``), however busy the loop is, then the abort
fires on the loop. When the drone goes away (its end of the pipe closes) every work order is
aborted and the worker exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import platform
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from hangar.shared import runtime
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.logs import configure_logging
from hangar.shared.protocol import Ending, WorkOrder

from .config import DroneConfig, make_provider
from .histories import HistoryKeeper
from .outbox import Outbox, PipeOutlet
from .pipes import FrameError, read_frame_blocking
from .service import AgentService, ToolSettings
from .tools.policy import ToolPolicy
from .tools.sandbox import Limits, Sandbox
from .upstreams import WORK_ORDER, Upstreams

log = logging.getLogger("hangar.drone")

PR_SET_PDEATHSIG = 1
NICE = 10
"""How much lower a worker's event loop runs than the drone's (``nice``; 19 is the lowest)."""
UNBOUNDED = 1 << 30
"""A worker never refuses an order: the drone counts the slots."""
DRAIN_ON_EXIT = 5.0
"""Seconds a worker whose drone went away waits for its work orders to unwind."""
SWITCH_INTERVAL = 0.001
"""Seconds (CPython's default is 0.005) before a busy loop hands the GIL to the control thread
when it has an abort to act on."""
DRONE_GONE = "The drone stopped."
WORKER_FAILED = "The drone's worker could not run this work order: {}"


def settings_wire(
    config: DroneConfig, tools: ToolSettings | None, *, log_level: int, nice: int = NICE
) -> dict[str, Any]:
    """What a worker needs to run work orders (not the drone's token: it never talks to a
    relay), as the first frame it reads."""
    provider = {
        "provider": config.provider,
        "model": config.model,
        "base_url": config.base_url,
        "api_key": config.api_key,
        "ollama_host": config.ollama_host,
        "max_retries": config.max_retries,
    }
    return {
        "provider": provider,
        "deadline": config.deadline,
        "stall": config.stall,
        "tools": None if tools is None else _tools_wire(tools),
        "logLevel": log_level,
        "nice": nice,
        "drone": os.getpid(),
    }


def _tools_wire(tools: ToolSettings) -> dict[str, Any]:
    sandbox = tools.sandbox
    return {
        "workdir": str(tools.workdir),
        "policy": dict(tools.policy.rules),
        "ask_each_time": sorted(tools.policy.ask_each_time),
        "approval_timeout": tools.approval_timeout,
        "sandbox": None if sandbox is None else {"bwrap": sandbox.bwrap, **asdict(sandbox.limits)},
        "network": tools.network,
        "allow_private_urls": tools.allow_private_urls,
    }


def _tools_from(wire: dict[str, Any] | None) -> ToolSettings | None:
    if wire is None:
        return None
    sandbox = dict(wire["sandbox"]) if wire["sandbox"] is not None else None
    return ToolSettings(
        Path(wire["workdir"]),
        policy=ToolPolicy(dict(wire["policy"]), frozenset(wire["ask_each_time"])),
        approval_timeout=float(wire["approval_timeout"]),
        sandbox=None if sandbox is None else Sandbox(sandbox.pop("bwrap"), Limits(**sandbox)),
        network=bool(wire["network"]),
        allow_private_urls=bool(wire["allow_private_urls"]),
    )


class Worker:
    """What the drone's messages do, on the worker's loop."""

    def __init__(self, service: AgentService, root: AbortController, outbox: Outbox) -> None:
        self.service = service
        self.root = root
        self.outbox = outbox
        self.gone = asyncio.Event()
        """The drone closed its end: time to go."""
        self.histories = HistoryKeeper()
        """The histories of the sessions whose last order ran here."""

    def take(self, message: list[Any]) -> None:
        kind = message[0]
        try:
            if kind == "order":
                self._accept(message[1], bool(message[2]))
            elif kind == "abort":
                self.service.abort(message[1], message[2], message[3])
            elif kind == "decide":
                turn_id, call_id = message[1], message[2]
                refusal = self.service.decide_now(
                    turn_id, call_id, bool(message[3]), bool(message[4])
                )
                self.outbox.event(["decided", turn_id, call_id, refusal], turn_id)
            elif kind == "stop":
                self.root.abort(AbortError(message[1], cause=message[2]))
            elif kind == "forget":
                self.histories.forget(message[1])
            elif kind == "ping":  # on the loop: a loop that is stuck does not answer
                self.outbox.event(["pong"])
            elif kind == "gone":
                self.root.abort(AbortError(DRONE_GONE, cause="shutdown"))
                self.gone.set()
        except Exception:
            log.exception("a worker could not take %s", kind)

    def _accept(self, data: dict[str, Any], aborted: bool) -> None:
        sent = WorkOrder.model_validate(data)
        order = self.histories.complete(sent)
        if order is None:  # the drone sends only what this worker keeps the rest of
            ending = Ending(reason="drone_failed").wire()
            error = WORKER_FAILED.format("its session's history is not kept here.")
            self.outbox.event(["complete", sent.turn_id, False, error, ending], sent.turn_id)
            return
        self.histories.keep(order)
        token = WORK_ORDER.set(order.turn_id)  # its task, and every stream it opens, inherit it
        try:
            answer = self.service.accept(order)
        finally:
            WORK_ORDER.reset(token)
        if not answer["ok"]:
            ending = Ending(reason="drone_failed").wire()
            error = WORKER_FAILED.format(answer["error"])
            self.outbox.event(["complete", order.turn_id, False, error, ending], order.turn_id)
        elif aborted:  # before its task first runs: it never calls the model
            self.service.abort(order.turn_id)


def listen(
    inbox: BinaryIO, loop: asyncio.AbstractEventLoop, upstreams: Upstreams, worker: Worker
) -> None:
    """The control thread: read the drone's messages; close streams at once on an abort."""
    message: list[Any] = ["gone"]
    while True:
        try:
            message = read_frame_blocking(inbox)
        except (EOFError, FrameError, OSError):
            message = ["gone"]
        kind = message[0]
        if kind == "abort" and message[2] == "now":
            upstreams.shut_down(AbortError(cause=message[3]), message[1])
        elif kind == "stop":
            upstreams.shut_down(AbortError(message[1], cause=message[2]))
        elif kind == "gone":
            upstreams.shut_down(AbortError(DRONE_GONE, cause="shutdown"))
        try:
            loop.call_soon_threadsafe(worker.take, message)
        except RuntimeError:
            return  # the loop is closed: the worker is exiting
        if kind == "gone":
            return


def lower_priority(nice: int) -> None:
    """Lower this thread's CPU priority (on Linux a thread's own; elsewhere the process's).

    Called on the loop's thread after the control thread started, so that thread keeps the
    drone's priority; threads the loop starts later (the executor's, tools') inherit the lower.
    """
    if nice <= 0:
        return
    with contextlib.suppress(OSError):
        if sys.platform == "linux":
            current = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, min(19, current + nice))
        else:
            os.nice(nice)


async def serve(settings: dict[str, Any], inbox: BinaryIO, out_fd: int) -> None:
    outbox = await Outbox.open(out_fd)
    outbox.ship_logs(int(settings["logLevel"]))
    config = DroneConfig(**settings["provider"])
    tools = _tools_from(settings["tools"])
    upstreams = Upstreams(make_provider(config))
    root = AbortController()
    service = AgentService(
        upstreams,
        PipeOutlet(outbox),
        root=root.signal,
        concurrency=UNBOUNDED,
        deadline=settings["deadline"],
        tools=tools,
        stall=settings["stall"],
    )
    worker = Worker(service, root, outbox)
    loop = asyncio.get_running_loop()
    control = threading.Thread(
        target=listen, args=(inbox, loop, upstreams, worker), name="drone-control", daemon=True
    )
    control.start()
    lower_priority(int(settings["nice"]))
    outbox.event(["ready", os.getpid()])
    await worker.gone.wait()
    try:
        async with asyncio.timeout(DRAIN_ON_EXIT):
            await service.drain()
    except TimeoutError:
        log.warning("a worker exits with %d work orders still unwinding", len(service.running))
    await outbox.close()
    await upstreams.close()


def _ignore(signum: int, frame: object) -> None:
    """Ctrl-C in a terminal reaches the whole process group: the drone decides, not the worker.
    A handler, not SIG_IGN, so the commands tools start get the default again."""


def die_with(drone: int) -> None:
    """Be killed the moment the drone's process ends, however it ends (Linux): the kernel then
    closes this worker's model streams, and its commands' sandboxes die with it. Elsewhere the
    drone's pipe closing does it, once this worker's loop has its turn."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != drone:  # it ended before the line above
        os._exit(1)


KEYCTL = {"x86_64": 250, "aarch64": 219}
"""Linux's number of the ``keyctl`` system call, by machine (libc has no wrapper for it)."""
KEYCTL_JOIN_SESSION_KEYRING = 1


def own_keyring() -> None:
    """Join a new, empty session keyring (Linux): the commands this worker runs, sandboxed or
    not, inherit it, not the drone's, which may hold what its login put there (bubblewrap
    leaves keyrings as they are)."""
    number = KEYCTL.get(platform.machine())
    if sys.platform == "linux" and number is not None:
        ctypes.CDLL(None, use_errno=True).syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None)


def close_inherited() -> None:
    """Close every descriptor past stdio this process was started with: uvloop's spawn leaves
    copies of the drone's ends of the worker's pipes here (and whatever the drone had open
    that is inheritable), and a command the worker runs, sandboxed or not, inherited them: it
    could read other turns' orders and write their progress. Python's own are not inheritable."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        with contextlib.suppress(OSError):
            if fd > 2 and os.get_inheritable(fd):
                os.close(fd)


def main() -> None:
    close_inherited()
    own_keyring()
    # The pipes are the protocol: nothing printed may land in them, nothing started may read them.
    inbox = os.fdopen(os.dup(0), "rb")
    out_fd = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    # The control thread waits for the GIL while the loop parses streams: at most this long.
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        settings = read_frame_blocking(inbox)
    except (EOFError, FrameError):
        sys.exit(2)
    die_with(int(settings["drone"]))
    configure_logging(logging.getLevelName(int(settings["logLevel"])))
    runtime.run(serve(settings, inbox, out_fd))


if __name__ == "__main__":
    main()
