"""The base types of every payload: turn statuses and end reasons, the ``Wire`` model (camelCase,
unknown keys refused), chat messages and tool calls, token usage and a turn's ending.

``hangar.shared.protocol`` re-exports all of them; import them from there.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

TurnStatus = Literal["queued", "processing", "finished", "aborted", "error"]
TERMINAL_STATUSES: tuple[TurnStatus, ...] = ("finished", "aborted", "error")

EndReason = Literal[
    "finished",
    "aborted",
    "operator",
    "shutdown",
    "unanswered",
    "removed",
    "deadline",
    "stalled",
    "model_failed",
    "drone_lost",
    "relay_restarted",
    "drone_failed",
]
"""Why a turn ended: finished; aborted by a person (``by`` says who), by the drone's operator
(Ctrl-C), by a shutdown, by the relay after the drone did not answer an abort, or as its person
was removed (all five end ``aborted``); timed out (its deadline), the model service stalled or
failed, the drone was lost, the relay restarted, or the drone could not run it (all end
``error``)."""
ABORT_REASONS: tuple[EndReason, ...] = ("aborted", "operator", "shutdown", "unanswered", "removed")


def status_of(reason: EndReason) -> TurnStatus:
    """The status a turn ending for ``reason`` has."""
    if reason == "finished":
        return "finished"
    return "aborted" if reason in ABORT_REASONS else "error"


class Wire(BaseModel):
    """Base of every payload: camelCase on the wire, unknown keys refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False
    )

    def wire(self) -> dict[str, Any]:
        """The JSON-ready dict to emit."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _one_line(text: Any) -> Any:
    return " ".join(text.split()) if isinstance(text, str) else text


Title = Annotated[str, StringConstraints(max_length=200), BeforeValidator(_one_line)]
"""A title, kept on one line: runs of white space (line breaks too) become one space, and none
is left at either end; its bound of 200 characters counts what is kept (the constraint stands
before the validator that runs first, so its refusal speaks of characters)."""

ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
"""What an id (of a turn, a session, a tool call) looks like."""
Id = Annotated[str, Field(pattern=ID_PATTERN)]


MAX_MESSAGE_BYTES = 3_000_000
"""The most a finished message (its content and tool calls, as JSON) may take: a drone sends it
to the relay in one event, and the relay takes no event over 4,000,000 bytes."""

MAX_ORDER_BYTES = 256 * 1024 * 1024
"""The largest message from a relay a drone takes (a work order with its whole history)."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def whole_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD: half of a UTF-16 pair (JSON's
    ``"\\ud83d"`` alone) or a file name's undecodable byte is no character, and has no UTF-8."""
    return text if text.isascii() else _LONE_SURROGATE.sub("\ufffd", text)


def cut(text: str, limit: int, between: str = "") -> str:
    """``text``'s first ``limit`` characters and how many more there were, or all of it."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}{between}[… {len(text) - limit} more characters not shown]"


class ToolCall(Wire):
    id: Id
    name: str = Field(min_length=1, max_length=128)
    arguments: str = Field(default="{}", max_length=MAX_MESSAGE_BYTES)
    """The arguments as the model produced them: a JSON object in a string."""


class ChatMessage(Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(default="", max_length=10_000_000)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Id | None = None
    name: str | None = None
    aborted: bool | None = None
    """Set on an assistant message cut short by an abort: its content is partial."""

    def chars(self) -> int:
        """Its size in characters: its content, its calls' arguments, and 64 for each call's
        id and name (what a drone's kept histories, and a work order's size, count)."""
        return len(self.content) + sum(64 + len(call.arguments) for call in self.tool_calls or ())


MOST_TOKENS = 2**31 - 1
"""The most tokens a turn's count holds (the store's INTEGER); sums stop there."""


class Usage(Wire):
    """Tokens a turn used; ``estimated`` when the service did not say (an aborted stream)."""

    prompt_tokens: int = Field(default=0, ge=0, le=MOST_TOKENS)
    completion_tokens: int = Field(default=0, ge=0, le=MOST_TOKENS)
    estimated: bool = False

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=min(self.prompt_tokens + other.prompt_tokens, MOST_TOKENS),
            completion_tokens=min(self.completion_tokens + other.completion_tokens, MOST_TOKENS),
            estimated=self.estimated or other.estimated,
        )


MAX_BUNDLED = 64
"""Most finished messages a completion carries with it (``Ending.messages``)."""


MOST_MESSAGES = 2**31 - 1
"""A message's number (its place in its turn) is at most this: what a database integer holds."""
MessageNumber = Annotated[int, Field(ge=0, le=MOST_MESSAGES)]


class NumberedMessage(Wire):
    """A finished message with its place among the turn's messages (0 for the first)."""

    number: MessageNumber
    message: ChatMessage


class Ending(Wire):
    """The optional fourth argument of a drone's ``workOrderComplete``: why, the usage, and the
    turn's last finished messages, stored before the ending (one event instead of several)."""

    reason: EndReason
    usage: Usage | None = None
    messages: list[NumberedMessage] | None = Field(default=None, max_length=MAX_BUNDLED)


UNSEEN_KINDS = frozenset({"Cc", "Cf"})
"""Unicode's categories of characters drawn as nothing: controls and format characters."""
BLANK_LETTERS = frozenset("\u115f\u1160\u2800\u3164\uffa0")
"""Letters drawn as nothing: the Hangul fillers and the blank Braille pattern."""


def shows(text: str) -> bool:
    """Whether ``text`` holds a character a person can see: not only white space, control
    characters (NUL, DEL…), invisible format characters (zero-width spaces and joiners,
    direction marks) and blank letters."""
    return any(
        not (c.isspace() or c in BLANK_LETTERS or unicodedata.category(c) in UNSEEN_KINDS)
        for c in text
    )
