"""The drone's work: one AbortController per work order, one ``workOrderComplete`` per turn."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.abort import AbortController, AbortError, AbortTimeoutError, any_of, timeout
from shared.protocol import ABORT_SIGNALED, ABORTED, NO_ACTIVE_WORK_ORDER, ChatMessage, WorkOrder

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
    task: asyncio.Task[None] | None = None


class AgentService:
    def __init__(
        self,
        provider: Provider,
        outlet: Outlet,
        *,
        concurrency: int = 1,
        deadline: float | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.provider = provider
        self.outlet = outlet
        self.concurrency = concurrency
        self.deadline = deadline
        self.workdir = workdir
        """Where tools work; None runs work orders with no tools."""
        self.running: dict[str, RunningOrder] = {}

    def accept(self, order: WorkOrder) -> dict[str, Any]:
        """Take a work order (or refuse it, busy); its controller exists from this moment on."""
        if order.turn_id in self.running:
            return {"ok": True}
        if len(self.running) >= self.concurrency:
            return {"ok": False, "error": "The drone is busy."}
        running = RunningOrder(order, AbortController())
        self.running[order.turn_id] = running
        running.task = asyncio.ensure_future(self.process(running))
        return {"ok": True}

    def abort(self, turn_id: str) -> tuple[bool, str]:
        """Fire the work order's signal and answer at once; the turn ends on its own."""
        running = self.running.get(turn_id)
        if running is None:
            return False, NO_ACTIVE_WORK_ORDER
        running.controller.abort()
        log.info("abort signaled turn=%s", turn_id)
        return True, ABORT_SIGNALED

    def abort_all(self) -> int:
        for running in self.running.values():
            running.controller.abort()
        return len(self.running)

    async def process(self, running: RunningOrder) -> None:
        order, controller = running.order, running.controller
        signal = controller.signal
        if self.deadline is not None:
            signal = any_of(signal, timeout(self.deadline))
        report = self.outlet.report_for(order.turn_id)
        tools: ToolRunner = (
            Toolbox(self.workdir, self.provider, report) if self.workdir else NoTools()
        )
        agent = Agent(self.provider, tools, report)
        messages = [*order.history, ChatMessage(role="user", content=order.prompt)]
        try:
            answer = await agent.run(messages, signal)
            # An abort acknowledged as the last chunk arrived still ends the turn aborted:
            # the person was told "Abort signaled".
            controller.signal.throw_if_aborted()
            success, message = True, _summary(answer)
        except AbortTimeoutError as error:
            log.info("deadline turn=%s: %s", order.turn_id, error)
            success, message = False, str(error)
        except AbortError:
            log.info("aborted turn=%s", order.turn_id)
            success, message = True, ABORTED
        except ProviderError as error:
            log.warning("provider failed turn=%s: %s", order.turn_id, error)
            success, message = False, str(error)
        except Exception as error:
            log.exception("work order failed turn=%s", order.turn_id)
            success, message = False, f"The drone failed: {error}"
        finally:
            self.running.pop(order.turn_id, None)
        await self.outlet.complete(order.turn_id, success, message)

    async def drain(self) -> None:
        """Wait for every running work order to end (after ``abort_all`` on shutdown)."""
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _summary(answer: str) -> str:
    answer = answer.strip()
    if not answer:
        return "Done."
    return answer if len(answer) <= 200 else answer[:199] + "…"
