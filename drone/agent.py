"""The agent loop: call the model, run the tools it asks for, feed results back, until it answers.

Two signals stop it: ``signal`` at once (the abort), and ``step_signal`` at the next step's end
("stop after this step": the model call or tool in progress finishes and its result is kept,
the tool calls not yet run get the cancelled result). Either way it raises ``AbortError``.

Abort lands by the phase-by-phase rules of ``docs/architecture.md``: whatever the phase, the
messages kept form a valid conversation (partial text is kept and flagged; every tool call gets a
result, a synthetic "cancelled" one when it did not run), then ``AbortError`` propagates to the
caller. The model's stream is read inside an abort scope, so an abort interrupts the pending read
at once; what must be kept is kept outside any scope, so it is never interrupted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from hangar.shared.abort import AbortController, AbortError, AbortSignal, linked_controller
from hangar.shared.protocol import (
    ANSWER_TOO_LONG,
    ID_PATTERN,
    MAX_MESSAGE_BYTES,
    STALLED,
    TOOL_CANCELLED,
    TOOL_LOST,
    ChatMessage,
    ToolCall,
    Usage,
    cut,
    whole_text,
)

from .providers import (
    ChatEvent,
    ChatOptions,
    Provider,
    ProviderError,
    TextChunk,
    ToolCallRequest,
    ToolSpec,
    UsageReport,
)
from .providers.base import EMPTY_ANSWER, WholeText

log = logging.getLogger("hangar.agent")

MAX_STEPS = 25
MAX_TOOL_RESULT_CHARS = 200_000
"""The most of a tool's result the model (and the person) is given; the rest is counted."""
STALL = 120.0
"""Seconds a model stream may go without bringing anything of its answer (text, a piece of a
tool call, reasoning) before it is given up."""
MAX_TOOL_NAME = 128
"""A call's name is cut there (as ``ToolCall`` holds it): a longer one names no tool anyway."""
ID_ROOM = 120
"""Characters of a model's call id kept, leaving room for a suffix that makes it unique."""


class Report(Protocol):
    """Where a work order's progress goes (the relay, through the drone's connection)."""

    async def text(self, text: str, depth: int) -> None: ...

    async def message(self, message: ChatMessage) -> None:
        """A finished message of the work order's own conversation (depth 0), to persist."""

    async def tool(
        self,
        call: ToolCall,
        state: str,
        depth: int,
        result: str | None = None,
    ) -> None: ...


class ToolRunner(Protocol):
    @property
    def specs(self) -> list[ToolSpec]: ...

    async def run(self, call: ToolCall, signal: AbortSignal, depth: int) -> str:
        """Run one tool call; raise ``AbortError`` if the signal cut it short."""

    def refusal(self, call: ToolCall) -> str | None:
        """Why the call cannot run whatever a person would answer (its arguments), else None:
        said before anyone is asked."""


class Gate(Protocol):
    """Whether a tool call may run: None to run it, else the result the model gets instead (a
    person declined it, the drone's policy refuses it). May wait for a person; raises
    ``AbortError`` if the work order is aborted meanwhile."""

    async def verdict(
        self, call: ToolCall, signal: AbortSignal, report: Report, depth: int
    ) -> str | None: ...


class Open:
    """Every call runs."""

    async def verdict(
        self, call: ToolCall, signal: AbortSignal, report: Report, depth: int
    ) -> str | None:
        return None


class NoTools:
    def __init__(self) -> None:
        self.specs: list[ToolSpec] = []

    async def run(self, call: ToolCall, signal: AbortSignal, depth: int) -> str:
        return f"Error: there is no tool named {call.name!r}."

    def refusal(self, call: ToolCall) -> str | None:
        return None


class StepLimitError(Exception):
    pass


CHARS_PER_TOKEN = 4
"""For an estimate where the service did not count: about four characters a token."""


@dataclass
class Tally:
    """The tokens a work order used and the tool call ids it gave out, its sub-agents'
    included."""

    usage: Usage = field(default_factory=Usage)
    ids: set[str] = field(default_factory=set)

    def call_id(self, proposed: str) -> str:
        """``proposed``, or a new id if a call of the work order has it already: a model may
        number each answer's calls from ``call_1`` (Ollama does), and a page, the relay and
        the person's approvals tell a work order's calls apart by id."""
        if not re.fullmatch(ID_PATTERN, proposed):  # empty, too long, or not an id's characters
            proposed = re.sub(r"[^A-Za-z0-9_.:-]", "_", proposed)[:ID_ROOM] or "call"
        unique = proposed
        while unique in self.ids:
            unique = f"{proposed[:ID_ROOM]}_{secrets.token_hex(3)}"
        self.ids.add(unique)
        return unique

    def counted(self, report: UsageReport) -> None:
        self.usage += Usage(
            prompt_tokens=report.prompt_tokens, completion_tokens=report.completion_tokens
        )

    def estimate(self, messages: list[ChatMessage], chunks: int) -> None:
        """A call the service did not count (cut short, or a service that does not say)."""
        prompt = sum(
            len(m.content) + sum(len(c.arguments) for c in m.tool_calls or []) for m in messages
        )
        self.usage += Usage(
            prompt_tokens=prompt // CHARS_PER_TOKEN + 1, completion_tokens=chunks, estimated=True
        )


@dataclass
class Agent:
    provider: Provider
    tools: ToolRunner
    report: Report
    depth: int = 0
    max_steps: int = MAX_STEPS
    tally: Tally = field(default_factory=Tally)
    step_signal: AbortSignal | None = None
    """Fired for "stop after this step"."""
    stall: float | None = STALL
    """Seconds without a chunk after which a model stream is closed and the turn fails."""
    gate: Gate = field(default_factory=Open)
    """What each tool call passes before it runs (approvals, the drone's policy)."""
    turn_id: str = "-"
    """The work order's turn, for log lines."""

    async def run(self, messages: list[ChatMessage], signal: AbortSignal) -> str:
        """Run to a final answer and return it; ``messages`` grows with everything kept."""
        keep = self._keeper(messages)
        for step in range(self.max_steps):
            signal.throw_if_aborted()
            if step:  # "stop after this step" asked before the first: that step is run
                self._stop_if_asked()
            text: list[str] = []
            calls: list[ToolCall] = []
            try:
                await self._call_model(messages, signal, text, calls)
            except AbortError:
                if "".join(text):  # a message that says nothing is no message (docs/protocol.md)
                    await keep(ChatMessage(role="assistant", content="".join(text), aborted=True))
                raise
            if not calls and not "".join(text).strip():  # nothing to show, keep or run
                raise ProviderError(EMPTY_ANSWER)
            await keep(
                ChatMessage(role="assistant", content="".join(text), tool_calls=calls or None)
            )
            if not calls:
                if self.depth == 0:  # asked to stop: the answer is kept, the turn ends aborted
                    self._stop_if_asked()
                return "".join(text)
            if self._asked_to_stop():
                await self._cancel(calls, keep)
                self._stop_if_asked()
            await self._run_tools(calls, signal, keep)
        raise StepLimitError(f"Stopped after {self.max_steps} model calls without a final answer.")

    async def _call_model(
        self,
        messages: list[ChatMessage],
        signal: AbortSignal,
        text: list[str],
        calls: list[ToolCall],
    ) -> None:
        """One model call, read inside an abort scope: ``text`` and ``calls`` fill as it streams
        (what streamed before an abort stays in them); the tokens it used are tallied. An answer
        that would not fit in a message (``MAX_MESSAGE_BYTES``) is a ``ProviderError``: the
        stream is closed there, and what came before it is not kept."""
        counted = False
        size = 0
        whole = WholeText()
        try:
            with linked_controller(signal) as call, _StallWatch(call, self.stall) as watch:
                async with call.signal.scope() as scope:
                    model, hold = self.provider.model, watch.hold
                    options = ChatOptions(model, scope.signal, hold, self.turn_id)
                    stream = self.provider.chat(messages, self.tools.specs, options)
                    async with aclosing(stream) as events:
                        async for event in events:
                            watch.heard()
                            size += _wire_size(event)
                            if size > MAX_MESSAGE_BYTES:
                                raise ProviderError(ANSWER_TOO_LONG)
                            await self._take(event, text, calls, whole)
                            counted = counted or isinstance(event, UsageReport)
        finally:
            await self._said(whole.end(), text)  # a half held back: nothing is left dangling
            if not counted:
                self.tally.estimate(messages, len(text) + len(calls))

    async def _take(
        self, event: ChatEvent, text: list[str], calls: list[ToolCall], whole: WholeText
    ) -> None:
        if isinstance(event, TextChunk):
            await self._said(whole.add(event.text), text)
        elif isinstance(event, ToolCallRequest):
            await self._said(whole.end(), text)
            name, arguments = whole_text(event.name), whole_text(event.arguments)
            name = name[:MAX_TOOL_NAME] or "unnamed"  # no tool is named so: an error result
            calls.append(ToolCall(id=self.tally.call_id(event.id), name=name, arguments=arguments))
        elif isinstance(event, UsageReport):
            self.tally.counted(event)

    async def _said(self, chunk: str, text: list[str]) -> None:
        if chunk:
            text.append(chunk)
            await self.report.text(chunk, self.depth)

    async def _run_tools(
        self,
        calls: list[ToolCall],
        signal: AbortSignal,
        keep: Callable[[ChatMessage], Awaitable[None]],
    ) -> None:
        for index, call in enumerate(calls):
            if signal.aborted:
                await self._cancel(calls[index:], keep, signal.reason)
                signal.throw_if_aborted()
            try:
                result = await self._run_tool(call, signal)
            except AbortError as error:
                await self._cancel(calls[index:], keep, error)
                raise
            await keep(
                ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name)
            )
            if self._asked_to_stop() and index + 1 < len(calls):
                await self._cancel(calls[index + 1 :], keep)
                self._stop_if_asked()

    async def _run_tool(self, call: ToolCall, signal: AbortSignal) -> str:
        """One call through the gate, reported as it goes: its result, or why it did not run."""
        if (refusal := self.tools.refusal(call)) is not None:  # no one is asked for nothing
            log.info("tool refused turn=%s tool=%r: %s", self.turn_id, call.name, refusal)
            result = _fitted(f"Error: {refusal}")
            await self.report.tool(call, "error", self.depth, result)
            return result
        verdict = await self.gate.verdict(call, signal, self.report, self.depth)
        if verdict is not None:
            await self.report.tool(call, "declined", self.depth, verdict)
            return verdict
        await self.report.tool(call, "start", self.depth)
        try:
            result = _fitted(await self.tools.run(call, signal, self.depth))
        except AbortError:
            raise
        except Exception as error:  # a failing tool is the model's problem, not the turn's
            log.info("tool failed turn=%s tool=%r: %s", self.turn_id, call.name, error)
            result = _fitted(f"Error: {error}")
            await self.report.tool(call, "error", self.depth, result)
        else:
            await self.report.tool(call, "end", self.depth, result)
        return result

    async def _cancel(
        self,
        calls: list[ToolCall],
        keep: Callable[[ChatMessage], Awaitable[None]],
        why: AbortError | None = None,
    ) -> None:
        """Each call a result saying it did not run (to its end): cancelled by a person, or
        cut by the turn's end (its deadline, a stalled model, the drone out of touch)."""
        ended = why is not None and why.cause in ("deadline", "stall", "cut_off")
        result = TOOL_LOST if ended else TOOL_CANCELLED
        for call in calls:
            await self.report.tool(call, "cancelled", self.depth, result)
            await keep(
                ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name)
            )

    def _asked_to_stop(self) -> bool:
        return self.step_signal is not None and self.step_signal.aborted

    def _stop_if_asked(self) -> None:
        """End here for "stop after this step" (what was kept stays)."""
        if self.step_signal is not None:
            self.step_signal.throw_if_aborted()

    def _keeper(self, messages: list[ChatMessage]) -> Callable[[ChatMessage], Awaitable[None]]:
        async def keep(message: ChatMessage) -> None:
            messages.append(message)
            if self.depth == 0:
                await self.report.message(message)

        return keep


def _fitted(result: str) -> str:
    """A tool's result as the model gets it: whole characters, at most
    ``MAX_TOOL_RESULT_CHARS`` of them."""
    return cut(whole_text(result), MAX_TOOL_RESULT_CHARS, "\n")


def _wire_size(event: ChatEvent) -> int:
    """Bytes ``event`` adds to its message as the relay gets it (JSON, non-ASCII escaped)."""
    if isinstance(event, TextChunk):
        return len(json.dumps(event.text)) - 2
    if isinstance(event, ToolCallRequest):
        return len(json.dumps([event.id, event.name, event.arguments])) + 64  # and its keys
    return 0


class _StallWatch:
    """Aborts a model call (``cause="stall"``) once its stream has sent nothing for
    ``seconds``: one timer per call, moved on only when it comes due, not per chunk."""

    def __init__(self, call: AbortController, seconds: float | None) -> None:
        self.call = call
        self.seconds = seconds
        self.last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def heard(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def hold(self, seconds: float) -> None:
        """The stream waits ``seconds`` on purpose: its silence counts from the end of that."""
        self.last = asyncio.get_running_loop().time() + seconds

    def __enter__(self) -> _StallWatch:
        if self.seconds is not None:
            self.heard()
            self._timer = asyncio.get_running_loop().call_later(self.seconds, self._due)
        return self

    def _due(self) -> None:
        assert self.seconds is not None
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self.last
        if quiet >= self.seconds:
            self._timer = None
            self.call.abort(AbortError(STALLED, cause="stall"))
        else:
            self._timer = loop.call_later(self.seconds - quiet, self._due)

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
