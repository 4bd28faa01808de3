"""``Toolbox``: the tools a work order's agent may call, and ``spawn_subagent``.

A sub-agent is a child agent loop with its own controller linked to its parent's signal (an
operation tree): aborting the work order aborts every descendant; its progress is streamed with
its depth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hangar.shared.abort import AbortError, AbortSignal, linked_controller
from hangar.shared.protocol import TOOL_CANCELLED, ChatMessage, ToolCall

from ..agent import STALL, Agent, Gate, Open, Report, Tally
from ..providers import Provider, ToolSpec
from ..providers.base import call_arguments
from . import fetch, files, shell
from .errors import ToolError
from .sandbox import Sandbox

MAX_DEPTH = 3
SHELL_SECONDS = 300.0
FETCH_SECONDS = 60.0
SUBAGENT_PROMPT = (
    "You are a sub-agent of a coding agent. Do the task you are given with the tools you have, "
    "then answer with a short, complete report of the result."
)

STOPPED_AFTER_STEP = (
    "The person asked to stop after this step: the sub-agent stopped after its step."
)


def _spec(name: str, description: str, **properties: str) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {
                key: {"type": "string", "description": d} for key, d in properties.items()
            },
            "required": list(properties),
        },
    )


SPECS = [
    _spec("read_file", "Read a text file in the work directory.", path="relative path"),
    _spec("list_directory", "List a directory in the work directory.", path="relative path"),
    _spec(
        "write_file",
        "Write a text file in the work directory (parents are created).",
        path="relative path",
        content="the whole new content",
    ),
    _spec(
        "run_shell",
        "Run a shell command in the work directory; returns its exit code and output.",
        command="the command line",
    ),
    _spec("fetch_url", "Fetch a URL with HTTP GET; returns status and body.", url="http(s) URL"),
    _spec(
        "spawn_subagent",
        "Hand a self-contained task to a sub-agent with the same tools; returns its report.",
        task="what the sub-agent must do",
    ),
]


@dataclass
class Toolbox:
    workdir: Path
    provider: Provider
    report: Report
    depth: int = 0
    tally: Tally = field(default_factory=Tally)
    """Where sub-agents' token usage adds up (the work order's)."""
    step_signal: AbortSignal | None = None
    """The work order's "stop after this step": sub-agents stop after theirs too."""
    sandbox: Sandbox | None = None
    """Where ``run_shell`` confines commands (``sandbox.detect_sandbox()``); None: unconfined."""
    network: bool = False
    """Whether sandboxed commands may use the network."""
    allow_private_urls: bool = False
    """Whether ``fetch_url`` may reach private, loopback and link-local addresses."""
    gate: Gate = field(default_factory=Open)
    """What each call passes first (approvals); sub-agents' calls pass it too."""
    stall: float | None = STALL
    """The drone's ``--stall``: a sub-agent's model streams are watched as the work order's."""
    turn_id: str = "-"
    """The work order's turn, for its sub-agents' log lines."""

    @property
    def specs(self) -> list[ToolSpec]:
        if self.depth + 1 >= MAX_DEPTH:
            return [s for s in SPECS if s.name != "spawn_subagent"]
        return SPECS

    async def run(self, call: ToolCall, signal: AbortSignal, depth: int) -> str:
        """Run one call. A ``ToolError`` (the call failed; its message goes to the model) and
        ``AbortError`` propagate."""
        return await self._dispatch(call.name, _arguments(call.arguments), signal)

    def refusal(self, call: ToolCall) -> str | None:
        """A call no answer could make run: a tool this level has not (``spawn_subagent`` at
        the deepest), arguments that are not a JSON object, or a command that cannot be given
        to a process (a NUL in it, or too long)."""
        if all(spec.name != call.name for spec in self.specs):
            return no_such_tool(call.name)
        try:
            args = _arguments(call.arguments)
            if call.name == "run_shell":
                shell.check_command(_text(args, "command"))
        except ToolError as error:
            return str(error)
        return None

    async def _dispatch(self, name: str, args: dict[str, Any], signal: AbortSignal) -> str:
        signal.throw_if_aborted()
        if name == "read_file":
            return await files.read_file(self.workdir, _text(args, "path"), signal)
        if name == "list_directory":
            path = _text(args, "path") if args.get("path") else "."
            return await files.list_directory(self.workdir, path, signal)
        if name == "write_file":
            content = _text(args, "content", allow_empty=True)
            return await files.write_file(self.workdir, _text(args, "path"), content, signal)
        if name == "run_shell":
            return await shell.run_shell(
                self.workdir,
                _text(args, "command"),
                signal,
                SHELL_SECONDS,
                sandbox=self.sandbox,
                network=self.network,
            )
        if name == "fetch_url":
            return await fetch.fetch_url(
                _text(args, "url"), signal, FETCH_SECONDS, allow_private=self.allow_private_urls
            )
        if name == "spawn_subagent" and self.depth + 1 < MAX_DEPTH:
            return await self._spawn(_text(args, "task"), signal)
        raise ToolError(no_such_tool(name))

    async def _spawn(self, task: str, signal: AbortSignal) -> str:
        child_depth = self.depth + 1
        child = Agent(
            self.provider,
            replace(self, depth=child_depth),
            self.report,
            depth=child_depth,
            tally=self.tally,
            step_signal=self.step_signal,
            stall=self.stall,
            gate=self.gate,
            turn_id=self.turn_id,
        )
        messages = [
            ChatMessage(role="system", content=SUBAGENT_PROMPT),
            ChatMessage(role="user", content=task),
        ]
        with linked_controller(signal) as controller:
            try:
                return await child.run(messages, controller.signal)
            except AbortError as error:
                stopped = self.step_signal is not None and self.step_signal.aborted
                if stopped and not signal.aborted:  # "stop after this step": what it did stays
                    return _stopped_after_step(messages[2:])
                if error.cause != "stall" or signal.aborted:
                    raise
                # The sub-agent's model, not the work order, stopped: a failed tool, as when
                # that model's service fails otherwise; the work order goes on.
                silent = f"sent nothing for {self.stall:g} s"
                raise ToolError(f"The sub-agent stopped: its model service {silent}.") from None
            finally:
                # The sub-agent's operation tree ends with it, whatever happened.
                controller.abort(AbortError("The sub-agent ended.", cause="scope"))


def _stopped_after_step(done: list[ChatMessage]) -> str:
    """A sub-agent's result when the person asked to stop after the step: what it said and
    what its tools returned, so the model is not told that nothing happened."""
    lines = [STOPPED_AFTER_STEP]
    for message in done:
        if message.role == "assistant" and message.content.strip():
            lines.append(f"It said: {message.content}")
        elif message.role == "tool" and message.content == TOOL_CANCELLED:
            lines.append(f"{message.name or 'A tool'} did not run.")
        elif message.role == "tool":
            lines.append(f"{message.name or 'A tool'} returned: {message.content}")
    return "\n".join(lines)


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = call_arguments(text or "{}")
    except json.JSONDecodeError as error:
        raise ToolError(f"The arguments are not valid JSON: {error.msg}.") from None
    except ValueError as error:  # NaN or Infinity
        raise ToolError(f"The arguments are not valid JSON: {error}.") from None
    except RecursionError:
        raise ToolError("The arguments are nested too deeply.") from None
    if not isinstance(value, dict):
        raise ToolError("The arguments must be a JSON object.")
    return value


def _text(args: dict[str, Any], key: str, *, allow_empty: bool = False) -> str:
    value = args.get(key)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ToolError(f"The argument {key!r} is required and must be a string.")
    if key != "content":  # write_file says so of its content itself, writing nothing
        try:
            value.encode()
        except UnicodeEncodeError:  # JSON escapes half of a surrogate pair; no name holds it
            message = (
                f"The argument {key!r} is not valid Unicode (it holds half of a surrogate pair)."
            )
            raise ToolError(message) from None
    return value


def no_such_tool(name: str) -> str:
    return f"There is no tool named {name!r}."
