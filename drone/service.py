"""The drone's work: one AbortController per work order, one ``workOrderComplete`` per turn.

Each work order's controller is linked to the drone's root: stopping the drone (Ctrl-C, a relay
that refuses it) aborts the root, which aborts every work order the way a person's Cancel does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hangar.shared.abort import (
    AbortController,
    AbortError,
    AbortSignal,
    AbortTimeoutError,
    linked_controller,
)
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    NO_ACTIVE_WORK_ORDER,
    ChatMessage,
    WorkOrder,
)

from .agent import Agent, NoTools, Report, ToolRunner
from .providers import Provider, ProviderError
from .tools import Toolbox

log = logging.getLogger("hangar.drone")


class Outlet(Protocol):
    """The drone's connection, as the work needs it."""

    def report_for(self, turn_id: str) -> Report: ...

    async def complete(self, turn_id: str, success: bool, message: str) -> None: ...


@dataclass
class RunningOrder:
    order: WorkOrder
    controller: AbortController
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
        workdir: Path | None = None,
    ) -> None:
        self.provider = provider
        self.outlet = outlet
        self.root = root
        self.concurrency = concurrency
        self.deadline = deadline
        self.workdir = workdir
        """Where tools work; None runs work orders with no tools."""
        self.running: dict[str, RunningOrder] = {}

    def accept(self, order: WorkOrder) -> dict[str, Any]:
        """Take a work order (or refuse it, busy); its controller exists from this moment on."""
        if order.turn_id in self.running:
            return {"ok": True}
        if self.root.aborted:
            return {"ok": False, "error": "The drone is stopping."}
        if len(self.running) >= self.concurrency:
            return {"ok": False, "error": "The drone is busy."}
        running = RunningOrder(order, linked_controller(self.root))
        if self.deadline is not None:
            running.deadline = asyncio.get_running_loop().call_later(
                self.deadline, running.controller.abort, AbortTimeoutError(self.deadline)
            )
        self.running[order.turn_id] = running
        running.task = asyncio.ensure_future(self.process(running))
        return {"ok": True}

    def abort(self, turn_id: str) -> tuple[bool, str]:
        """Fire the work order's signal and answer at once; the turn ends on its own."""
        running = self.running.get(turn_id)
        if running is None:
            return False, NO_ACTIVE_WORK_ORDER
        running.controller.abort(AbortError(cause="person"))
        log.info("abort signaled turn=%s", turn_id)
        return True, ABORT_SIGNALED

    def running_ids(self) -> list[str]:
        return list(self.running)

    async def process(self, running: RunningOrder) -> None:
        order, controller = running.order, running.controller
        report = self.outlet.report_for(order.turn_id)
        tools: ToolRunner = (
            Toolbox(self.workdir, self.provider, report) if self.workdir else NoTools()
        )
        agent = Agent(self.provider, tools, report)
        messages = [*order.history, ChatMessage(role="user", content=order.prompt)]
        try:
            answer = await agent.run(messages, controller.signal)
            # An abort acknowledged as the last chunk arrived still ends the turn aborted:
            # the person was told "Abort signaled".
            controller.signal.throw_if_aborted()
            success, message = True, _summary(answer)
        except AbortTimeoutError as error:
            log.info("deadline turn=%s: %s", order.turn_id, error)
            success, message = False, str(error)
        except AbortError as error:
            log.info("aborted turn=%s by=%s", order.turn_id, error.cause)
            success, message = True, ABORTED
        except ProviderError as error:
            log.warning("provider failed turn=%s: %s", order.turn_id, error)
            success, message = False, str(error)
        except Exception as error:
            log.exception("work order failed turn=%s", order.turn_id)
            success, message = False, f"The drone failed: {error}"
        finally:
            if running.deadline is not None:
                running.deadline.cancel()
            controller.close()
            self.running.pop(order.turn_id, None)
        await self.outlet.complete(order.turn_id, success, message)

    async def drain(self) -> None:
        """Wait for every running work order to end (after the root was aborted, say)."""
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _summary(answer: str) -> str:
    answer = answer.strip()
    if not answer:
        return "Done."
    return answer if len(answer) <= 200 else answer[:199] + "…"
