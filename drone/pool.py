"""The drone's worker processes: work orders run there, so the drone's own loop stays light.

The drone's process keeps what the relay talks to (the connection, deliveries, acks, the
engine.io heartbeat) and answers for the work orders (``WorkOrders``: accept, abort, decide,
waiting calls, what runs). The model streams, their SDKs and the tools run in a few worker
processes (``worker_process``), started with the drone and at a lower CPU priority: however
busy they are, an abort is acknowledged at once and the heartbeat is never late.

Each worker's progress comes back through the same ``TurnReport`` and deliveries as in a
single-process drone, so the relay sees the same events. A worker that dies ends its work
orders in error ("The drone's worker stopped.") and another takes its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from hangar.shared.abort import AbortCause, AbortSignal
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    DRONE_BUSY,
    DRONE_STOPPING,
    NO_SUCH_CALL,
    RAN_ALREADY,
    STOP_AFTER_STEP,
    ChatMessage,
    Ending,
    ToolCall,
    WorkOrder,
)

from .histories import MAX_SESSIONS
from .outbox import relog
from .pipes import FrameError, WorkerProcess, frame, frame_bytes, read_frame
from .service import AbortMode, abort_early, abort_outcome, remember
from .verdicts import Verdicts
from .watch import silent, watch

log = logging.getLogger("hangar.drone")

WORKER_STOPPED = "The drone's worker stopped."
START_WITHIN = 60.0
"""Seconds the workers may take to start (Python and the model SDKs load in each)."""
EXIT_WITHIN = 5.0
"""Seconds a worker may take to exit once the drone closed its pipe, before it is killed."""
RESTART_PAUSES = (0.0, 1.0, 2.0, 5.0)
"""Seconds before a dead worker is replaced: longer while replacements keep dying young."""
YOUNG = 10.0


class WorkerStartError(Exception):
    """A worker process could not start (the message says how it ended)."""


class Progress(Protocol):
    """A turn's report in the drone (``report.TurnReport``)."""

    async def text(self, text: str, depth: int, chunks: int = 1) -> None: ...

    async def message(self, message: ChatMessage) -> None: ...

    async def tool(
        self, call: ToolCall, state: str, depth: int, result: str | None = None
    ) -> None: ...


class Outlet(Protocol):
    """The drone's connection, as the pool needs it."""

    def report_for(self, turn_id: str) -> Progress: ...

    async def complete(self, turn_id: str, success: bool, message: str, ending: Ending) -> None: ...


@dataclass
class Assigned:
    """A work order in a worker."""

    worker: WorkerProcess
    report: Progress
    aborted: bool = False
    """An immediate abort was asked: its slot is free."""
    asked: AbortCause | None = None
    """Why an abort (now or after the step) was asked: the turn ends aborted for it, even if
    its worker dies before it says so."""
    waiting: dict[str, tuple[ToolCall, int]] = field(default_factory=dict)
    """Its tool calls waiting for a person: call id -> (call, depth)."""


def lost_ending(cause: AbortCause | None) -> tuple[bool, str, Ending]:
    """How a turn ends whose worker died: as its abort (or the drone's stop) would have ended
    it, else in error."""
    if cause is None:
        return False, WORKER_STOPPED, Ending(reason="drone_failed")
    success, message, reason = abort_outcome(cause)
    return success, message, Ending(reason=reason)


class WorkerPool:
    """``connection.WorkOrders`` over worker processes."""

    def __init__(
        self,
        settings: dict[str, Any],
        outlet: Outlet,
        *,
        root: AbortSignal,
        workers: int,
        concurrency: int,
    ) -> None:
        self.settings = frame(settings)
        self.outlet = outlet
        self.root = root
        self.concurrency = concurrency
        self.workers = [WorkerProcess(n) for n in range(max(1, min(workers, concurrency)))]
        self.running: dict[str, Assigned] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.aborted_early: OrderedDict[str, AbortMode] = OrderedDict()
        self._held: OrderedDict[str, tuple[WorkerProcess, str]] = OrderedDict()
        """session -> the worker keeping its history, and the turn whose order that was."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._verdicts = Verdicts()
        self._closing = False
        self._lives: list[asyncio.Task[None]] = []
        self._unsubscribe = root.add_callback(self._stop)

    async def start(self, within: float = START_WITHIN) -> None:
        """Start every worker and wait until each is ready; ``WorkerStartError`` if one ends
        first (or none is ready in time). The drone stopped meanwhile (Ctrl-C), it starts no
        more, closes the pool and raises the stop's ``AbortError``: no worker runs."""
        self._lives = [asyncio.ensure_future(watch(self.workers, lambda: self.root.aborted))]
        for worker in self.workers:  # one at a time: starting a process holds the loop (a fork)
            if self.root.aborted:
                break
            self._lives.append(asyncio.ensure_future(self._live(worker)))
            await asyncio.sleep(0)  # it starts; a Ctrl-C meanwhile is taken before the next
        for worker in self.workers:
            waits = [worker.ready.wait(), worker.exited.wait(), self.root.wait()]
            tasks = [asyncio.ensure_future(wait) for wait in waits]
            try:
                await asyncio.wait(tasks, timeout=within, return_when="FIRST_COMPLETED")
            finally:
                for task in tasks:
                    task.cancel()
            if self.root.aborted:
                await self.close()
                self.root.throw_if_aborted()
            if not worker.ready.is_set():
                process = worker.process
                code = process.returncode if process is not None else None
                await self.close()
                said = f"it exited with code {code}" if code is not None else "it did not answer"
                raise WorkerStartError(f"A worker process could not start: {said}.")

    # ---- WorkOrders

    def accept(self, order: WorkOrder, sent: WorkOrder | None = None) -> dict[str, Any]:
        turn_id = order.turn_id
        if turn_id in self.running:
            return {"ok": True}
        if order.resent and turn_id in self.ended:  # its answer was lost: it has run here
            return {"ok": False, "error": RAN_ALREADY}
        if self.root.aborted or self._closing:
            return {"ok": False, "error": DRONE_STOPPING}
        if sum(not a.aborted for a in self.running.values()) >= self.concurrency:
            return {"ok": False, "error": DRONE_BUSY}
        worker, part = self._place(order, sent)
        early = self.aborted_early.pop(turn_id, None)
        aborted = early == "now"
        self.running[turn_id] = Assigned(worker, self.outlet.report_for(turn_id), aborted=aborted)
        self._idle.clear()
        data = part.model_dump_json(by_alias=True, exclude_none=True).encode()
        log.debug(
            "work order turn=%s to %s: %d of its %d history messages sent",
            turn_id,
            worker.name,
            len(part.history),
            len(order.history),
        )
        worker.send(frame_bytes(b'["order",' + data + (b",true]" if aborted else b",false]")))
        if early == "after_step":
            worker.send(frame(["abort", turn_id, early, "person"]))
        return {"ok": True}

    def abort(
        self, turn_id: str, mode: AbortMode = "now", cause: AbortCause = "person"
    ) -> tuple[bool, str]:
        """Answered here, at once; the worker closes the model's stream from its own thread."""
        assigned = self.running.get(turn_id)
        if assigned is None:
            return abort_early(self.aborted_early, self.ended, turn_id, mode)
        assigned.worker.send(frame(["abort", turn_id, mode, cause]))
        assigned.asked = assigned.asked or cause
        if mode == "after_step":
            return True, STOP_AFTER_STEP
        assigned.aborted = True
        assigned.waiting.clear()  # cancelled: an answer racing the abort is refused
        return True, ABORT_SIGNALED

    async def decide(self, turn_id: str, call_id: str, approve: bool, always: bool) -> str | None:
        assigned = self.running.get(turn_id)
        if assigned is None or assigned.waiting.pop(call_id, None) is None:
            return NO_SUCH_CALL
        answer = frame(["decide", turn_id, call_id, approve, always])
        return await self._verdicts.ask(turn_id, call_id, lambda: assigned.worker.send(answer))

    def waiting_calls(self) -> list[tuple[str, ToolCall, int]]:
        return [
            (turn_id, call, depth)
            for turn_id, assigned in self.running.items()
            for call, depth in assigned.waiting.values()
        ]

    def running_ids(self) -> list[str]:
        return list(self.running)

    async def drain(self) -> None:
        """Wait for every running work order to end (after the root was aborted, say)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Close every worker's pipe, wait for them all at once to exit (killing the late),
        and stop. A worker still loading runs nothing yet, and reads its pipe only once loaded:
        it is killed at once."""
        self._closing = True
        self._unsubscribe()
        for worker in self.workers:
            worker.close()
            if not worker.ready.is_set():
                worker.kill()
        exits = {asyncio.ensure_future(w.process.wait()): w for w in self.workers if w.process}
        if exits:
            _, late = await asyncio.wait(exits, timeout=EXIT_WITHIN)
            for wait in late:
                log.warning("%s did not exit; killed", exits[wait].name)
                exits[wait].kill()
                wait.cancel()
        for life in self._lives:
            life.cancel()
        await asyncio.gather(*self._lives, return_exceptions=True)
        for worker in self.workers:
            worker.kill()  # one a start under way (cancelled above) may have left

    # ---- the workers

    def _place(self, order: WorkOrder, sent: WorkOrder | None) -> tuple[WorkerProcess, WorkOrder]:
        """The worker for ``order``, and what to send it: only the relay's part of the history
        when that worker keeps the rest (it ran the session's previous order here), else all."""
        session = order.session_id
        held = self._held.pop(session, None)
        if (
            held is not None
            and sent is not None
            and held[1] == sent.history_base
            and held[0].ready.is_set()
            and not silent(held[0])
        ):
            worker, part = held[0], sent
        else:
            worker, part = self._pick(), order
            if held is not None and held[0] is not worker:
                held[0].send(frame(["forget", session]))
        self._held[session] = (worker, order.turn_id)
        while len(self._held) > MAX_SESSIONS:
            dropped, (keeper, _) = self._held.popitem(last=False)
            keeper.send(frame(["forget", dropped]))
        return worker, part

    def _pick(self) -> WorkerProcess:
        load = dict.fromkeys(self.workers, 0)
        for assigned in self.running.values():
            load[assigned.worker] += not assigned.aborted
        return min(self.workers, key=lambda w: (not w.ready.is_set(), silent(w), load[w], w.number))

    def _stop(self) -> None:
        reason = self.root.reason
        assert reason is not None
        for worker in self.workers:
            worker.send(frame(["stop", str(reason), reason.cause]))

    async def _live(self, worker: WorkerProcess) -> None:
        """Run ``worker``, and a new one each time it dies, until the pool closes."""
        loop = asyncio.get_running_loop()
        deaths = 0
        while True:
            born = loop.time()
            code = await self._run(worker)
            worker.ready.clear()  # new work orders go to the others while it is replaced
            worker.exited.set()
            lost = [t for t, a in self.running.items() if a.worker is worker]
            worker.backlog.clear()  # what it was sent is for the work orders it lost
            for session in [s for s, (w, _) in self._held.items() if w is worker]:
                del self._held[session]  # its histories died with it
            if not self._closing or lost:
                log.warning(
                    "%s stopped (%s); %d work orders end in error",
                    worker.name,
                    "could not start" if code is None else f"exit code {code}",
                    len(lost),
                )
            stopping = self.root.reason.cause if self.root.reason is not None else None
            for turn_id in lost:  # "Abort signaled" was answered, or the drone stops: as said
                await self._end(turn_id, *lost_ending(self.running[turn_id].asked or stopping))
            if self._closing or self.root.aborted:
                return  # the drone is stopping: no new work order will come
            deaths = deaths + 1 if loop.time() - born < YOUNG else 0
            await asyncio.sleep(RESTART_PAUSES[min(deaths, len(RESTART_PAUSES) - 1)])

    async def _run(self, worker: WorkerProcess) -> int | None:
        """Start ``worker``'s process and take its events until it ends; its exit code (None
        if it could not start)."""
        try:
            process = await worker.start(self.settings)
        except OSError as error:
            log.error("a worker process cannot start: %s", error)
            return None
        assert process.stdout is not None
        try:
            await self._read(worker, process.stdout)
        except Exception as error:  # not frames, or (a bug) an event the drone cannot take:
            # unread, the worker would wait forever; it is replaced, its turns end in error.
            trace = not isinstance(error, FrameError)
            log.error("%s sent what the drone cannot take: %s", worker.name, error, exc_info=trace)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        return await process.wait()

    async def _read(self, worker: WorkerProcess, stdout: asyncio.StreamReader) -> None:
        while True:
            try:
                events = await read_frame(stdout)
            except EOFError:
                return
            worker.answered = asyncio.get_running_loop().time()
            for event in events:
                await self._take(worker, event)

    async def _take(self, worker: WorkerProcess, event: list[Any]) -> None:
        kind = event[0]
        if kind == "log":
            relog(event)
            return
        if kind == "ready":
            worker.ready.set()
            return
        if kind == "pong":
            return  # its loop runs (``watch``)
        if kind == "decided":
            self._verdicts.heard(event[1], event[2], event[3])
            return
        turn_id = event[1]
        assigned = self.running.get(turn_id)
        if assigned is None or assigned.worker is not worker:
            return  # ended meanwhile
        if kind == "text":
            text, depth, chunks = event[3], event[2], event[4]
            if not isinstance(text, str) or type(depth) is not int or type(chunks) is not int:
                raise FrameError("a text event that is not text")  # kept, it broke the ending
            await assigned.report.text(text, depth, chunks)
        elif kind == "message":
            await assigned.report.message(ChatMessage.model_validate(event[2]))
        elif kind == "tool":
            call, state, depth = ToolCall.model_validate(event[2]), event[3], event[4]
            if state == "waiting" and not assigned.aborted:
                assigned.waiting[call.id] = (call, depth)
            else:
                assigned.waiting.pop(call.id, None)
            await assigned.report.tool(call, state, depth, event[5])
        elif kind == "complete":
            success, message, ending = event[2], event[3], Ending.model_validate(event[4])
            if assigned.aborted and ending.reason == "finished":
                # Answered "Abort signaled" while this ending was on its way: it ends aborted,
                # as that answer promised (and as the worker's own late abort would).
                success, message, ending = (
                    True,
                    ABORTED,
                    ending.model_copy(update={"reason": "aborted"}),
                )
            await self._end(turn_id, success, message, ending)

    async def _end(self, turn_id: str, success: bool, message: str, ending: Ending) -> None:
        if self.running.pop(turn_id, None) is None:
            return
        self._verdicts.ended(turn_id)
        remember(self.ended, turn_id, None)
        try:
            await self.outlet.complete(turn_id, success, message, ending)
        finally:
            if not self.running:
                self._idle.set()
