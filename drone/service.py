"""The drone's work: one AbortController per work order, one ``workOrderComplete`` per turn.

Each work order's controller is linked to the drone's root: stopping the drone (Ctrl-C, a relay
that refuses it) aborts the root, which aborts every work order the way a person's Cancel does.
An abort may reach the drone before the work order it is for (they travel separately): it is
kept, and the order is ended aborted the moment it arrives, before any model call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from hangar.shared.abort import (
    AbortCause,
    AbortController,
    AbortError,
    AbortSignal,
    AbortTimeoutError,
    linked_controller,
    release,
)
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    CUT_OFF,
    DRONE_BUSY,
    DRONE_STOPPING,
    NO_ACTIVE_WORK_ORDER,
    NO_SUCH_CALL,
    RAN_ALREADY,
    STALLED,
    STOP_AFTER_STEP,
    ChatMessage,
    Ending,
    EndReason,
    ToolCall,
    WorkOrder,
)

from .agent import STALL, Agent, NoTools, Report, StepLimitError, Tally, ToolRunner
from .approvals import APPROVAL_TIMEOUT, Approvals
from .histories import alternating
from .providers import Provider, ProviderError
from .tools import Toolbox
from .tools.policy import ToolPolicy
from .tools.sandbox import Sandbox

T = TypeVar("T")
AbortMode = Literal["now", "after_step"]
log = logging.getLogger("hangar.drone")

REMEMBERED = 1000
"""How many recently ended turns, and aborts ahead of their order, a drone remembers."""
ABORT_REASONS: dict[AbortCause, EndReason] = {
    "person": "aborted",
    "operator": "operator",
    "shutdown": "shutdown",
    "relay": "shutdown",
    "scope": "aborted",
}


class Outlet(Protocol):
    """The drone's connection, as the work needs it."""

    def report_for(self, turn_id: str) -> Report: ...

    async def complete(self, turn_id: str, success: bool, message: str, ending: Ending) -> None: ...


@dataclass(frozen=True)
class ToolSettings:
    """How a drone's tools run: where, which wait for a person, and how commands are confined."""

    workdir: Path
    policy: ToolPolicy = field(default_factory=ToolPolicy)
    approval_timeout: float = APPROVAL_TIMEOUT
    sandbox: Sandbox | None = None
    """Where commands run confined; None: unconfined (the drone then has ``run_shell`` ask,
    see ``ToolPolicy.unconfined``)."""
    network: bool = False
    """Whether sandboxed commands may use the network."""
    allow_private_urls: bool = False


@dataclass
class RunningOrder:
    order: WorkOrder
    controller: AbortController
    approvals: Approvals
    gentle: AbortController = field(default_factory=AbortController)
    """"Stop after this step"."""
    tally: Tally = field(default_factory=Tally)
    deadline: asyncio.TimerHandle | None = None
    task: asyncio.Task[None] | None = None


class AgentService:
    def __init__(
        self,
        provider: Provider,
        outlet: Outlet,
        *,
        root: AbortSignal,
        concurrency: int = 1,
        deadline: float | None = None,
        tools: ToolSettings | None = None,
        stall: float | None = STALL,
    ) -> None:
        self.provider = provider
        self.outlet = outlet
        self.root = root
        self.concurrency = concurrency
        self.deadline = deadline
        self.tools = tools
        """How tools run; None runs work orders with no tools."""
        self.policy = tools.policy if tools is not None else ToolPolicy.allow_all()
        self.stall = stall
        """Seconds a model stream may send nothing before the turn fails (None: no limit)."""
        self.running: dict[str, RunningOrder] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        """Turns that ran here and ended, most recent last."""
        self.aborted_early: OrderedDict[str, AbortMode] = OrderedDict()
        """Turns aborted (or to stop after their first step) before their work order arrived."""

    def accept(self, order: WorkOrder, sent: WorkOrder | None = None) -> dict[str, Any]:
        """Take a work order (or refuse it, busy); its controller exists from this moment on.
        ``order`` has its whole history (``sent``, the relay's part of it, is not needed here)."""
        if order.turn_id in self.running:
            return {"ok": True}
        if order.resent and order.turn_id in self.ended:  # its answer was lost: it ran here
            return {"ok": False, "error": RAN_ALREADY}
        if self.root.aborted:
            return {"ok": False, "error": DRONE_STOPPING}
        # An aborted work order only unwinds: its slot is free the moment the abort lands.
        if sum(not r.controller.signal.aborted for r in self.running.values()) >= self.concurrency:
            return {"ok": False, "error": DRONE_BUSY}
        timeout = self.tools.approval_timeout if self.tools else APPROVAL_TIMEOUT
        approvals = Approvals(self.policy, timeout, set(order.approved_tools))
        running = RunningOrder(order, linked_controller(self.root), approvals)
        early = self.aborted_early.pop(order.turn_id, None)
        if early == "now":
            running.controller.abort(AbortError(cause="person"))
        else:
            if early == "after_step":
                running.gentle.abort(AbortError(cause="person"))
            if self.deadline is not None:
                running.deadline = asyncio.get_running_loop().call_later(
                    self.deadline, running.controller.abort, AbortTimeoutError(self.deadline)
                )
        self.running[order.turn_id] = running
        running.task = asyncio.ensure_future(self.process(running))
        return {"ok": True}

    def abort(
        self, turn_id: str, mode: AbortMode = "now", cause: AbortCause = "person"
    ) -> tuple[bool, str]:
        """Fire the work order's signal and answer at once; the turn ends on its own. (The
        connection logs the answer: in a worker process this is not where the drone answers.)"""
        running = self.running.get(turn_id)
        if running is None:
            return abort_early(self.aborted_early, self.ended, turn_id, mode)
        if mode == "after_step":
            running.gentle.abort(AbortError(cause="person"))
            return True, STOP_AFTER_STEP
        running.controller.abort(AbortError(cause=cause))
        return True, ABORT_SIGNALED

    async def decide(self, turn_id: str, call_id: str, approve: bool, always: bool) -> str | None:
        return self.decide_now(turn_id, call_id, approve, always)

    def decide_now(self, turn_id: str, call_id: str, approve: bool, always: bool) -> str | None:
        """A person's answer to a tool call waiting for approval; None once taken."""
        running = self.running.get(turn_id)
        if running is None:
            return NO_SUCH_CALL
        refusal = running.approvals.decide(call_id, approve, always)
        if refusal is None:
            log.info(
                "tool call %s %s turn=%s", call_id, "approved" if approve else "declined", turn_id
            )
        return refusal

    def waiting_calls(self) -> list[tuple[str, ToolCall, int]]:
        """Tool calls waiting for a person now: (turn, call, depth)."""
        return [
            (turn_id, waiting.call, waiting.depth)
            for turn_id, running in self.running.items()
            for waiting in running.approvals.waiting.values()
        ]

    def running_ids(self) -> list[str]:
        return list(self.running)

    async def process(self, running: RunningOrder) -> None:
        order, controller = running.order, running.controller
        report = self.outlet.report_for(order.turn_id)
        settings = self.tools
        tools: ToolRunner = (
            Toolbox(
                settings.workdir,
                self.provider,
                report,
                tally=running.tally,
                step_signal=running.gentle.signal,
                sandbox=settings.sandbox,
                network=settings.network,
                allow_private_urls=settings.allow_private_urls,
                gate=running.approvals,
                stall=self.stall,
                turn_id=order.turn_id,
            )
            if settings is not None
            else NoTools()
        )
        agent = Agent(
            self.provider,
            tools,
            report,
            tally=running.tally,
            step_signal=running.gentle.signal,
            stall=self.stall,
            gate=running.approvals,
            turn_id=order.turn_id,
        )
        messages = alternating([*order.history, ChatMessage(role="user", content=order.prompt)])
        reason: EndReason
        failure: Exception | None = None
        try:
            answer = await agent.run(messages, controller.signal)
            # An abort acknowledged as the last chunk arrived still ends the turn aborted:
            # the person was told "Abort signaled".
            controller.signal.throw_if_aborted()
            success, message, reason = True, _summary(answer), "finished"
        except Exception as error:
            success, message, reason = _outcome(error, order.turn_id, controller.signal)
            failure = error
        finally:
            if running.deadline is not None:
                running.deadline.cancel()
            controller.close()
            self.running.pop(order.turn_id, None)
            remember(self.ended, order.turn_id, None)
        ending = Ending(reason=reason, usage=running.tally.usage)
        try:
            await self.outlet.complete(order.turn_id, success, message, ending)
        finally:
            # Freed once reported, not before: the completion does not wait for it.
            release(failure)
            release(controller.signal.reason)

    async def drain(self) -> None:
        """Wait for every running work order to end (after the root was aborted, say)."""
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Release the provider's connections (after ``drain``)."""
        await self.provider.close()


def remember(recent: OrderedDict[str, T], turn_id: str, value: T) -> None:
    recent[turn_id] = value
    while len(recent) > REMEMBERED:
        recent.popitem(last=False)


def abort_early(
    early: OrderedDict[str, AbortMode], ended: OrderedDict[str, None], turn_id: str, mode: AbortMode
) -> tuple[bool, str]:
    """The answer to an abort of a turn not running here: kept (its work order is still on its
    way) unless it ran here; a "now" is not made "after this step" by a later one."""
    if turn_id in ended:
        return False, NO_ACTIVE_WORK_ORDER
    if early.get(turn_id) != "now":
        remember(early, turn_id, mode)
    return (True, ABORT_SIGNALED) if early[turn_id] == "now" else (True, STOP_AFTER_STEP)


def abort_outcome(cause: AbortCause) -> tuple[bool, str, EndReason]:
    """How a work order aborted for ``cause`` ends: (success, message, reason)."""
    if cause == "cut_off":  # out of touch with every relay: stopped, not aborted by anyone
        return False, CUT_OFF, "drone_lost"
    return True, ABORTED, ABORT_REASONS.get(cause, "aborted")


def _outcome(error: Exception, turn_id: str, signal: AbortSignal) -> tuple[bool, str, EndReason]:
    """How a work order that raised ``error`` ends: (success, message, reason)."""
    if isinstance(error, AbortTimeoutError):
        log.info("deadline turn=%s: %s", turn_id, error)
        return False, str(error), "deadline"
    if isinstance(error, AbortError):
        if error.cause == "stall" and not signal.aborted:
            log.warning("model stream stalled turn=%s: closed", turn_id)
            return False, STALLED, "stalled"
        if error.cause == "cut_off":
            log.warning("out of touch with every relay turn=%s: stopped", turn_id)
        else:
            log.info("aborted turn=%s by=%s", turn_id, error.cause)
        return abort_outcome(error.cause)
    if isinstance(error, ProviderError):
        log.warning("provider failed turn=%s: %s", turn_id, error)
        return False, str(error), "model_failed"
    if isinstance(error, StepLimitError):  # the model called tools and never answered
        log.warning("step limit turn=%s: %s", turn_id, error)
        return False, str(error), "model_failed"
    log.error("work order failed turn=%s", turn_id, exc_info=error)
    return False, f"The drone failed: {error}", "drone_failed"


def _summary(answer: str) -> str:
    answer = answer.strip()
    if not answer:
        return "Done."
    return answer if len(answer) <= 200 else answer[:199] + "…"
