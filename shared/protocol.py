"""The wire protocol: namespaces, event names and payload models both ends import.

Payloads travel as JSON with camelCase keys (``turnId``); the models accept and emit exactly that.
Every model forbids unknown keys, so a malformed payload is refused instead of half-read.
``docs/protocol.md`` documents every event with an example; keep the two in step.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel

IDE_NAMESPACE = "/ide"
DRONE_NAMESPACE = "/drone"

# browser -> relay (all acknowledged)
SUBMIT_WORK_ORDER = "submitWorkOrder"
ABORT_WORK_ORDER = "abortWorkOrder"  # also relay -> drone
LIST_SESSIONS = "listSessions"
OPEN_SESSION = "openSession"
LIST_DRONES = "listDrones"
# relay -> browser
HELLO = "hello"
LOGGED_OUT = "loggedOut"
TURN_QUEUED = "turnQueued"
TURN_ENDED = "turnEnded"
TURN_STARTED = "turnStarted"
WORK_ORDER_PROGRESS = "workOrderProgress"  # also drone -> relay
WORK_ORDER_COMPLETE = "workOrderComplete"  # also drone -> relay
DRONES = "drones"
SESSIONS = "sessions"
# relay -> drone
WORK_ORDER = "workOrder"
DISMISSED = "dismissed"
"""``{reason}``: the relay drops this drone for good (its token was revoked, say)."""

ABORTED = "aborted"
"""The message of ``workOrderComplete(turnId, True, "aborted")``."""

NOT_LOGGED_IN = "Log in to continue."
"""Why a browser connection is refused at connect (the page goes to ``/login``)."""
ABORT_SIGNALED = "Abort signaled"
STOP_AFTER_STEP = "Stopping after this step"
"""The ack of ``abortWorkOrder {mode: "after_step"}``: the step in progress finishes first."""
NO_ACTIVE_WORK_ORDER = "No active work order to abort"
DRONE_OFFLINE = "Drone is offline"
UNKNOWN_TURN = "Unknown turn"
TOOL_CANCELLED = "Tool execution was cancelled by user."

MAX_PROMPT_CHARS = 100_000
DRONE_TOKEN_PREFIX = "hgd."
"""A drone token names its drone: ``hgd.<drone name>.<secret>``."""
DRONE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"

TurnStatus = Literal["queued", "processing", "finished", "aborted", "error"]
TERMINAL_STATUSES: tuple[TurnStatus, ...] = ("finished", "aborted", "error")

EndReason = Literal[
    "finished",
    "aborted",
    "operator",
    "shutdown",
    "unanswered",
    "deadline",
    "stalled",
    "model_failed",
    "drone_lost",
    "relay_restarted",
    "drone_failed",
]
"""Why a turn ended: finished; aborted by a person (``by`` says who), by the drone's operator
(Ctrl-C), by a shutdown, or by the relay after the drone did not answer an abort (all four end
``aborted``); timed out (its deadline), the model service stalled or failed, the drone was lost,
the relay restarted, or the drone could not run it (all end ``error``)."""
ABORT_REASONS: tuple[EndReason, ...] = ("aborted", "operator", "shutdown", "unanswered")


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


Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]


class ToolCall(Wire):
    id: Id
    name: str = Field(min_length=1, max_length=128)
    arguments: str = Field(default="{}", max_length=1_000_000)
    """The arguments as the model produced them: a JSON object in a string."""


class ChatMessage(Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(default="", max_length=10_000_000)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Id | None = None
    name: str | None = None
    aborted: bool | None = None
    """Set on an assistant message cut short by an abort: its content is partial."""


class Usage(Wire):
    """Tokens a turn used; ``estimated`` when the service did not say (an aborted stream)."""

    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    estimated: bool = False

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            estimated=self.estimated or other.estimated,
        )


class Ending(Wire):
    """The optional fourth argument of a drone's ``workOrderComplete``: why, and the usage."""

    reason: EndReason
    usage: Usage | None = None


# ---- browser -> relay


class SubmitWorkOrder(Wire):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    session_id: Id | None = None
    """Omit to start a new chat session."""
    drone_id: Id | None = None
    """Omit to let the relay pick a drone (the first free one)."""
    mode: Literal["queue", "interrupt"] = "queue"
    """In a session with a running turn: ``queue`` runs this prompt after it ends; ``interrupt``
    aborts it and runs this prompt once the abort has landed."""


class AbortWorkOrderRequest(Wire):
    turn_id: Id | None = None
    """Omit to abort the processing turn of ``session_id`` (or of the person's sessions)."""
    session_id: Id | None = None
    mode: Literal["now", "after_step"] = "now"
    """``after_step``: let the model call or tool in progress finish and keep its result, then
    end the turn aborted. A later ``now`` abort (a second press) still stops it at once."""


class OpenSession(Wire):
    session_id: Id


class ListSessions(Wire):
    everyone: bool = False
    """Admins only: every person's sessions, not just their own."""


# ---- relay <-> browser views


class DroneRecord(Wire):
    """What a drone is: the one description of a drone, which the hello and the view extend."""

    drone_id: Id
    name: str = Field(min_length=1, max_length=128)
    provider: str = Field(min_length=1, max_length=64)
    model: str = Field(min_length=1, max_length=256)
    concurrency: int = Field(default=1, ge=1, le=1024)


class DroneView(DroneRecord):
    """A drone as browsers see it."""

    running: int
    """How many turns the drone runs now (which ones is their owners' business)."""
    busy: bool


class SessionView(Wire):
    session_id: str
    title: str
    created_at: float
    processing_turn_id: str | None = None
    queued_turns: int = 0
    """How many of its turns wait in line."""
    owner_name: str | None = None
    """Whose session it is, when it is not the viewer's own (an admin's view)."""


class TurnView(Wire):
    turn_id: str
    session_id: str
    prompt: str
    status: TurnStatus
    result: str | None = None
    """The ``workOrderComplete`` message once the turn has ended."""
    text: str = ""
    """The assistant text streamed so far (partial if aborted)."""
    text_seq: int = 0
    """How many text deltas ``text`` holds; browsers skip progress with ``seq`` up to it."""
    drone_id: str | None = None
    created_at: float
    messages: list[ChatMessage] = Field(default_factory=list)
    reason: EndReason | None = None
    """Why it ended (see ``EndReason``)."""
    ended_by: str | None = None
    """Who aborted it, when a person did."""
    usage: Usage | None = None
    wanted_drone_id: str | None = None
    """The drone the person picked, while it waits for it."""
    position: int | None = None
    """While queued: its place in line (as ``TurnQueued.position``)."""


class TurnQueued(Wire):
    """``turnQueued``: where a queued turn stands."""

    turn_id: str
    session_id: str
    position: int
    """1 for the next to start; 0 while it waits for the turn before it in its session."""
    drone_id: str | None = None
    """The drone it waits for; None for any."""


class TurnEnded(Wire):
    """``turnEnded``: sent right after ``workOrderComplete``, with why the turn ended."""

    turn_id: str
    session_id: str
    status: TurnStatus
    reason: EndReason
    result: str
    ended_by: str | None = None
    usage: Usage | None = None


# ---- relay -> drone


class WorkOrder(Wire):
    turn_id: Id
    session_id: Id
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    history: list[ChatMessage] = Field(default_factory=list)


class AbortOrder(Wire):
    turn_id: Id
    mode: Literal["now", "after_step"] = "now"


# ---- drone -> relay progress (discriminated by ``kind``)


class TextDelta(Wire):
    kind: Literal["text"] = "text"
    turn_id: Id
    text: str = Field(max_length=1_000_000)
    depth: int = Field(default=0, ge=0, le=16)
    """0 for the work order's own agent, n for a sub-agent n levels down."""


class MessageAdded(Wire):
    """A finished message to append to the session's history (the relay persists it)."""

    kind: Literal["message"] = "message"
    turn_id: Id
    message: ChatMessage


class ToolActivity(Wire):
    kind: Literal["tool"] = "tool"
    turn_id: Id
    call_id: Id
    name: str = Field(min_length=1, max_length=128)
    state: Literal["start", "end", "cancelled", "error"]
    arguments: str | None = Field(default=None, max_length=1_000_000)
    result: str | None = Field(default=None, max_length=1_000_000)
    depth: int = Field(default=0, ge=0, le=16)


Progress = Annotated[TextDelta | MessageAdded | ToolActivity, Field(discriminator="kind")]
PROGRESS = TypeAdapter(Progress)


class DroneHello(DroneRecord):
    """The socket.io ``auth`` a drone connects with."""

    token: str = Field(min_length=1, max_length=512)
    instance: str = Field(min_length=16, max_length=128)
    """A secret of the drone's process: a connection claiming a connected drone's id must
    present the same one (a reconnect), or it is refused."""
    running: list[Id] = Field(default_factory=list)
    """Turns the drone is still running (non-empty after a reconnect)."""

    def record(self) -> DroneRecord:
        return DroneRecord.model_validate(self.model_dump(include=set(DroneRecord.model_fields)))


class Completion(Wire):
    """The positional arguments of a drone's ``workOrderComplete`` as one checked value: the
    turn, success, message and, from drones that send it, the ``Ending``."""

    turn_id: Id
    success: StrictBool
    message: str = Field(max_length=100_000)
    ending: Ending | None = None

    @property
    def status(self) -> TurnStatus:
        return completion_status(self.success, self.message)


def drone_name_of(token: str) -> str | None:
    """The drone a drone token belongs to, or None if it is not one."""
    parts = token.split(".")
    if len(parts) == 3 and f"{parts[0]}." == DRONE_TOKEN_PREFIX:
        return parts[1] if re.match(DRONE_NAME_PATTERN, parts[1]) else None
    return None


def session_title(prompt: str) -> str:
    """A new session's title: the first line of its first prompt, at most 60 characters."""
    stripped = prompt.strip()
    line = stripped.splitlines()[0] if stripped else "New session"
    return line[:60] + ("…" if len(line) > 60 else "")


def completion_status(success: bool, message: str) -> TurnStatus:
    """The status a ``workOrderComplete(turnId, success, message)`` ends a turn with."""
    if not success:
        return "error"
    return "aborted" if message == ABORTED else "finished"


def describe(error: ValidationError) -> str:
    """A one-line, person-readable summary of why a payload was refused."""
    parts = []
    for item in error.errors()[:3]:
        where = ".".join(str(p) for p in item["loc"]) or "payload"
        parts.append(f"{where}: {item['msg']}")
    return "Invalid payload (" + "; ".join(parts) + ")."
