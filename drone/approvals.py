"""A work order's tool calls that wait for a person: the gate the agent passes each call through.

An ``ask`` call is reported ``waiting`` (with its arguments) and waits for the person's answer,
which the relay brings (``approveToolCall``). Approve runs it; deny gives the model a result
saying the person declined, and the loop goes on. "Always for this session" approves the tool
for the rest of the work order (the relay remembers it for the session's next ones). An abort
while waiting ends the wait at once: the call gets the cancelled result like any other. Nobody
answering within ``timeout`` reads as declined.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from hangar.shared.abort import AbortSignal, AbortTimeoutError
from hangar.shared.protocol import NO_SUCH_CALL, TOOL_NOT_RUN, ToolCall

from .agent import Report
from .report import SHOWN_ARGUMENTS_CHARS
from .tools.policy import ToolPolicy

log = logging.getLogger("hangar.drone")

APPROVAL_TIMEOUT = 600.0
"""Seconds a tool call waits for a person before it counts as declined."""
DECLINED = "The person declined this tool call" + TOOL_NOT_RUN


def not_allowed(name: str) -> str:
    return f"This drone does not allow the tool {name}" + TOOL_NOT_RUN


def too_long(chars: int) -> str:
    return f"This call is too long ({chars:,} characters) to be shown whole for approval" + (
        TOOL_NOT_RUN
    )


def unanswered(seconds: float) -> str:
    return f"Nobody approved this tool call within {seconds:g} s" + TOOL_NOT_RUN


@dataclass
class Waiting:
    call: ToolCall
    depth: int
    answer: asyncio.Future[tuple[bool, bool]]
    signal: AbortSignal


@dataclass
class Approvals:
    """The gate of one work order (its sub-agents' calls included)."""

    policy: ToolPolicy
    timeout: float = APPROVAL_TIMEOUT
    always: set[str] = field(default_factory=set)
    """Tools approved for the rest of the session."""
    waiting: dict[str, Waiting] = field(default_factory=dict)
    """Calls waiting for an answer, by call id."""

    async def verdict(
        self, call: ToolCall, signal: AbortSignal, report: Report, depth: int
    ) -> str | None:
        """None to run the call; otherwise the result the model gets instead. Raises
        ``AbortError`` if the work order is aborted while the call waits."""
        rule = self.policy.rule(call.name)
        if rule == "deny":
            return not_allowed(call.name)
        if rule == "allow" or (
            call.name in self.always and call.name not in self.policy.ask_each_time
        ):
            return None
        if call.name != "write_file" and len(call.arguments) > SHOWN_ARGUMENTS_CHARS:
            # Shown cut, the rest would run unseen (a file's content shows its size instead).
            return too_long(len(call.arguments))
        answer: asyncio.Future[tuple[bool, bool]] = asyncio.get_running_loop().create_future()
        self.waiting[call.id] = Waiting(call, depth, answer, signal)
        try:
            await report.tool(call, "waiting", depth)
            async with signal.scope(self.timeout):
                approve, always = await answer
        except AbortTimeoutError:
            if signal.aborted:
                raise  # the work order's own deadline, not the wait's
            log.info("tool call %s waited %g s: declined", call.id, self.timeout)
            return unanswered(self.timeout)
        finally:
            self.waiting.pop(call.id, None)
        if approve and always:
            self.always.add(call.name)
        return None if approve else DECLINED

    def decide(self, call_id: str, approve: bool, always: bool) -> str | None:
        """A person's answer; None once taken, else why not."""
        waiting = self.waiting.get(call_id)
        if waiting is None or waiting.answer.done() or waiting.signal.aborted:
            return NO_SUCH_CALL  # an answer racing an abort: the call is cancelled
        waiting.answer.set_result((approve, always))
        return None
