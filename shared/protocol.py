"""The wire protocol: namespaces, event names and payload models both ends import.

Payloads travel as JSON with camelCase keys (``turnId``); the models accept and emit exactly that.
Every model forbids unknown keys, so a malformed payload is refused instead of half-read.
``docs/protocol.md`` documents every event with an example; keep the two in step.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, TypeAdapter, ValidationError

# The base types of every payload live in ``wire``; they are part of this module's surface.
from .wire import (
    ABORT_REASONS,
    ID_PATTERN,
    MAX_BUNDLED,
    MAX_MESSAGE_BYTES,
    TERMINAL_STATUSES,
    ChatMessage,
    Ending,
    EndReason,
    Id,
    MessageNumber,
    NumberedMessage,
    Title,
    ToolCall,
    TurnStatus,
    Usage,
    Wire,
    cut,
    status_of,
    whole_text,
)

__all__ = [
    "ABORT_REASONS",
    "ID_PATTERN",
    "MAX_BUNDLED",
    "MAX_MESSAGE_BYTES",
    "TERMINAL_STATUSES",
    "ChatMessage",
    "EndReason",
    "Ending",
    "Id",
    "NumberedMessage",
    "ToolCall",
    "TurnStatus",
    "Usage",
    "Wire",
    "cut",
    "status_of",
    "whole_text",
]

IDE_NAMESPACE = "/ide"
DRONE_NAMESPACE = "/drone"

# browser -> relay (all acknowledged)
SUBMIT_WORK_ORDER = "submitWorkOrder"
ABORT_WORK_ORDER = "abortWorkOrder"  # also relay -> drone
APPROVE_TOOL_CALL = "approveToolCall"  # also relay -> drone
LIST_SESSIONS = "listSessions"
OPEN_SESSION = "openSession"
RENAME_SESSION = "renameSession"
DELETE_SESSION = "deleteSession"
LIST_DRONES = "listDrones"
# relay -> browser
HELLO = "hello"
LOGGED_OUT = "loggedOut"
TURN_QUEUED = "turnQueued"
TURN_ENDED = "turnEnded"
TURN_STARTED = "turnStarted"
TURN_STOPPING = "turnStopping"
WORK_ORDER_PROGRESS = "workOrderProgress"  # also drone -> relay
WORK_ORDER_COMPLETE = "workOrderComplete"  # also drone -> relay
DRONES = "drones"
SESSION_CHANGED = "sessionChanged"
SESSION_REMOVED = "sessionRemoved"
RESYNC = "resync"
"""``{}``: this browser missed events (it fell behind, or the relays lost Redis for a while):
open the session again for a fresh snapshot."""
# relay -> drone
WORK_ORDER = "workOrder"
DISMISSED = "dismissed"  # {reason}: the relay drops this drone for good (its token was revoked)
ALREADY_CONNECTED = "A drone with this id is connected already."  # another instance has it

ABORTED = "aborted"  # the message of workOrderComplete(turnId, True, "aborted")

NOT_LOGGED_IN = "Log in to continue."  # a browser refused at connect (the page goes to /login)
ABORT_SIGNALED = "Abort signaled"
STOP_AFTER_STEP = "Stopping after this step"  # the ack of abortWorkOrder {mode: "after_step"}
NO_ACTIVE_WORK_ORDER = "No active work order to abort"
DRONE_OFFLINE = "Drone is offline"
UNKNOWN_TURN = "Unknown turn"
UNKNOWN_SESSION = "Unknown session."
"""A session that does not exist, or one the person may not see (a refusal tells nothing)."""
TOOL_CANCELLED = "Tool execution was cancelled by user."
TOOL_LOST = "The turn ended before this tool finished."
"""The result the relay gives a tool call left open by an ending it decided (not an abort)."""
TOOL_NOT_RUN = "; it did not run."
"""How the result of a tool call that did not run (declined, refused, unanswered) ends."""
NO_SUCH_CALL = "No such tool call is waiting for approval."
HISTORY_MISS = "The drone does not have this session's history."
RAN_ALREADY = "This work order has run on this drone already."
"""A drone's answer to a work order sent again after its first answer was lost."""
DRONE_BUSY = "The drone is busy."
"""A drone's answer to a work order while it runs as many as it may: back in line."""
DRONE_STOPPING = "The drone is stopping."
"""A drone's answer to a work order once it is shutting down: back in line, for another."""
STALLED = "The model service stopped responding."
CUT_OFF = "The drone was out of touch with every relay, so it stopped."
"""The result of a turn its drone stopped after ``--cut-off`` without a relay (``drone_lost``)."""
ANSWER_TOO_LONG = "The model's answer is longer than a message may be; the drone stopped it."
RETRY_LATER = "The relay could not store this now; send it again."
"""A drone's event the relay could not handle for a reason of its own (its database is down,
say): the ack says ``{ok: false, error, retry: true}`` and the drone sends it again later."""

MAX_PROMPT_CHARS = 100_000
DRONE_TOKEN_PREFIX = "hgd."  # a drone token names its drone: hgd.<drone name>.<secret>
DRONE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
SHOWN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # none that reads as another's

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
    request_id: Id | None = None
    """A key the client makes once per prompt it sends: the same submit sent again with it (its
    answer was lost) is answered as the first was, never stored as a second turn."""


class AbortWorkOrderRequest(Wire):
    turn_id: Id | None = None
    """Omit to abort the processing turn of ``session_id`` (or of the person's sessions)."""
    session_id: Id | None = None
    mode: Literal["now", "after_step"] = "now"
    """``after_step``: let the model call or tool in progress finish and keep its result, then
    end the turn aborted. A later ``now`` abort (a second press) still stops it at once."""


class SessionRef(Wire):
    """A payload naming one session (``deleteSession``)."""

    session_id: Id


TURNS_PER_PAGE = 30
"""Turns ``openSession`` returns at most at once (the latest first; older ones on request)."""


class OpenSession(SessionRef):
    before: Id | None = None
    """Only turns older than this one (the next page back)."""
    limit: int = Field(default=TURNS_PER_PAGE, ge=1, le=200)


class ListSessions(Wire):
    everyone: bool = False
    """Admins only: every person's sessions, not just their own."""
    query: str = Field(default="", max_length=200)
    """Only sessions whose title or a turn's prompt holds this, in any case."""
    cursor: str | None = Field(default=None, pattern=r"^[0-9.e+-]{1,32}~[A-Za-z0-9_.:-]{1,128}$")
    limit: int = Field(default=50, ge=1, le=100)


class RenameSession(SessionRef):
    title: Title


# ---- relay <-> browser views


class DroneRecord(Wire):
    """What a drone is: the one description of a drone, which the hello and the view extend."""

    drone_id: Id
    name: str = Field(pattern=SHOWN_NAME_PATTERN)
    provider: str = Field(min_length=1, max_length=64)
    model: str = Field(min_length=1, max_length=256)
    concurrency: int = Field(default=1, ge=1, le=1024)
    history_cache: bool = False
    """The drone keeps sessions' histories: work orders may send only what it lacks."""


class DroneView(DroneRecord):
    """A drone as browsers see it."""

    running: int
    """How many turns the drone runs now (which ones is their owners' business)."""
    busy: bool


class SessionView(Wire):
    session_id: str
    title: str
    created_at: float
    last_activity: float
    """When its latest turn was created or ended, or it was renamed: the list's order."""
    processing_turn_id: str | None = None
    approvals: int = 0  # its running turn's tool calls waiting for the person's approval
    queued_turns: int = 0  # how many of its turns wait in line
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
    waiting: list[ToolActivity] = Field(default_factory=list)
    """While processing: its tool calls waiting for the person's approval."""
    stopping: bool = False
    """While processing: someone asked it to stop (after this step, or now)."""
    sub_agents: list[dict[str, Any]] = Field(default_factory=list)
    """While processing: what its sub-agents streamed, after each call that started them."""
    sub_agent_seq: int = 0
    """How many kept events ``sub_agents`` holds: browsers skip progress with ``subSeq`` to it."""


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
    text_chars: int = 0
    """The stored answer's length in UTF-16 units (``TurnView.text``, as JavaScript counts it):
    a page that shows less missed some and opens the session again."""


# ---- relay -> drone


class WorkOrder(Wire):
    turn_id: Id
    session_id: Id
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    history: list[ChatMessage] = Field(default_factory=list)
    approved_tools: list[str] = Field(default_factory=list)
    """Tools the person approved "always for this session": they run without asking."""
    history_base: Id | None = None
    """Set when ``history`` is only the end of the conversation: the drone takes the first
    ``history_from`` messages from the history of this turn's order (one it ran in this
    session), then ``history``. A drone that no longer has it answers ``HISTORY_MISS``."""
    history_from: int = Field(default=0, ge=0)
    resent: bool = False
    """Sent again after no answer came: a drone that has run this turn already says so
    (``RAN_ALREADY``) instead of running it again."""


class ToolApproval(Wire):
    """``approveToolCall``: a person's answer to a tool call waiting for approval."""

    turn_id: Id
    call_id: Id
    approve: StrictBool
    always: StrictBool = False
    """Also run this tool without asking for the rest of the session."""


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
    at: int | None = Field(default=None, ge=0)
    """Where ``text`` starts in the turn's text (depth 0): from a drone, in characters; to a
    browser, in UTF-16 code units (as JavaScript counts). A drone sends a turn's whole text
    again after a reconnect; the relay keeps what it lacks and passes on only that."""


class MessageAdded(Wire):
    """A finished message to append to the session's history (the relay persists it)."""

    kind: Literal["message"] = "message"
    turn_id: Id
    message: ChatMessage
    number: MessageNumber
    """Its place among the turn's messages (0 first): one sent again (ack lost) is stored once."""


class ToolActivity(Wire):
    kind: Literal["tool"] = "tool"
    turn_id: Id
    call_id: Id
    name: str = Field(min_length=1, max_length=128)
    state: Literal["waiting", "declined", "start", "end", "cancelled", "error"]
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
    running: list[Id] = Field(default_factory=list, max_length=4096)
    """Turns the drone still runs (after a reconnect): its concurrency's, and those unwinding."""

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
        return parts[1] if re.fullmatch(DRONE_NAME_PATTERN, parts[1]) else None
    return None


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
