"""The relay's persistence interface: chat sessions and their turns.

Handlers never write SQL; they call a ``TurnStore``. The SQLite implementation is the embedded
default; any other database implements the same protocol. Turn status is a state machine
``queued -> processing -> finished | aborted | error`` (a queued turn may also end at once)
whose first terminal write wins; claiming queued turns for drones is atomic across relays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from hangar.shared.protocol import (
    ChatMessage,
    EndReason,
    SessionView,
    TurnStatus,
    TurnView,
    Usage,
)


@dataclass
class SessionRecord:
    session_id: str
    owner: str
    title: str
    created_at: float = field(default_factory=time.time)
    last_activity: float = 0.0
    """When its latest turn was created or ended, or it was renamed (the store keeps it);
    a new session's is its creation."""

    def __post_init__(self) -> None:
        self.last_activity = self.last_activity or self.created_at

    def view(
        self,
        processing_turn_id: str | None = None,
        owner_name: str | None = None,
        queued_turns: int = 0,
        approvals: int = 0,
    ) -> SessionView:
        return SessionView(
            session_id=self.session_id,
            title=self.title,
            created_at=self.created_at,
            last_activity=self.last_activity,
            processing_turn_id=processing_turn_id,
            queued_turns=queued_turns,
            approvals=approvals,
            owner_name=owner_name,
        )


@dataclass
class TurnRecord:
    turn_id: str
    session_id: str
    owner: str
    prompt: str
    status: TurnStatus = "processing"
    result: str | None = None
    text: str = ""
    drone_id: str | None = None
    created_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    text_seq: int = 0
    """Live only: how many text deltas ``text`` holds while the turn is processing."""
    wanted_drone: str | None = None
    """The drone the person picked (None: any)."""
    started_at: float | None = None
    reason: EndReason | None = None
    ended_by: str | None = None
    abort_requested_by: str | None = None
    """Who asked for an abort (kept, so a drone heard from later still gets it)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_estimated: int | None = None
    request_id: str | None = None
    """The client's key of the submit that made it (``SubmitWorkOrder.request_id``)."""

    @classmethod
    def of(cls, row: dict[str, Any], messages: list[ChatMessage] | None = None) -> TurnRecord:
        """A record from a stored row (columns it does not know, as a query's, are skipped)."""
        known = {f.name for f in fields(cls)}
        turn = cls(**{k: v for k, v in row.items() if k in known})
        turn.messages = messages if messages is not None else []
        return turn

    @property
    def usage(self) -> Usage | None:
        if self.prompt_tokens is None and self.completion_tokens is None:
            return None
        return Usage(
            prompt_tokens=self.prompt_tokens or 0,
            completion_tokens=self.completion_tokens or 0,
            estimated=bool(self.usage_estimated),
        )

    def view(self) -> TurnView:
        return TurnView(
            turn_id=self.turn_id,
            session_id=self.session_id,
            prompt=self.prompt,
            status=self.status,
            result=self.result,
            text=self.text,
            text_seq=self.text_seq,
            drone_id=self.drone_id,
            created_at=self.created_at,
            messages=self.messages,
            reason=self.reason,
            ended_by=self.ended_by,
            usage=self.usage,
            wanted_drone_id=self.wanted_drone if self.status == "queued" else None,
            stopping=self.status == "processing" and self.abort_requested_by is not None,
        )


@dataclass(frozen=True)
class Ending:
    """How a turn ends: the terminal write, whoever makes it."""

    status: TurnStatus
    result: str
    reason: EndReason
    text: str = ""
    ended_by: str | None = None
    usage: Usage | None = None
    messages: tuple[tuple[int, ChatMessage], ...] = ()
    """The drone's last messages, by number, that came with its completion: stored first, in
    the same write (each once)."""


TURN_COLUMNS = (
    "turn_id, session_id, owner, prompt, status, result, text, drone_id, created_at, ended_at,"
    " wanted_drone, started_at, request_id"
)
INSERT_TURN = f"INSERT INTO turns ({TURN_COLUMNS}) VALUES ({', '.join('?' * 13)})"
INSERT_QUEUED_TURN = (
    f"INSERT INTO turns ({TURN_COLUMNS}) SELECT {', '.join('?' * 13)}"
    " WHERE (SELECT count(*) FROM turns WHERE owner = ? AND status = 'queued') < ?"
)
"""``INSERT_TURN`` while the owner has fewer turns queued than the last value says."""


def insert_turn(turn: TurnRecord, queue_limit: int | None) -> tuple[str, tuple[Any, ...]]:
    """The statement that stores a new turn, and its values: with ``queue_limit``, only while
    its owner has fewer turns queued (it then changes no row)."""
    if queue_limit is None:
        return INSERT_TURN, turn_values(turn)
    return INSERT_QUEUED_TURN, (*turn_values(turn), turn.owner, queue_limit)


def turn_values(turn: TurnRecord) -> tuple[Any, ...]:
    """The values of ``INSERT_TURN`` for a new turn."""
    return (
        turn.turn_id,
        turn.session_id,
        turn.owner,
        turn.prompt,
        turn.status,
        turn.result,
        turn.text,
        turn.drone_id,
        turn.created_at,
        turn.ended_at,
        turn.wanted_drone,
        turn.started_at,
        turn.request_id,
    )


BEFORE = "(SELECT created_at FROM turns AS b WHERE b.turn_id = ? AND b.session_id = t.session_id)"
RECENT_TURNS = f"""
    SELECT * FROM turns AS t WHERE session_id = ? AND (
        CAST(? AS TEXT) IS NULL OR created_at < {BEFORE}
        OR (created_at = {BEFORE} AND turn_id < ?)
    ) ORDER BY created_at DESC, turn_id DESC LIMIT ?
"""
"""A page of a session's turns, newest first, before a turn of that session (none before a
turn of another: that says nothing of it) (``?`` five times: session, then the ``before`` turn
id four times, then the limit + 1)."""


def end_turn_sql(from_statuses: tuple[TurnStatus, ...]) -> str:
    """The terminal write: first write wins. An ending on a person's abort names who asked."""
    marks = ", ".join("?" for _ in from_statuses)
    return (
        "UPDATE turns SET status = ?, result = ?, text = ?, ended_at = ?, reason = ?,"
        " ended_by = COALESCE(?, CASE WHEN ? IN ('aborted', 'unanswered')"
        " THEN abort_requested_by END),"
        " prompt_tokens = ?, completion_tokens = ?, usage_estimated = ?"
        f" WHERE turn_id = ? AND status IN ({marks}) RETURNING *"
    )


def end_turn_values(
    turn_id: str, ending: Ending, from_statuses: tuple[TurnStatus, ...], kept: str
) -> tuple[Any, ...]:
    """The values of ``end_turn_sql``; ``kept``: the text the turn stores (``kept_text``)."""
    usage = ending.usage
    return (
        ending.status,
        ending.result,
        kept,
        time.time(),
        ending.reason,
        ending.ended_by,
        ending.reason,
        usage.prompt_tokens if usage else None,
        usage.completion_tokens if usage else None,
        int(usage.estimated) if usage else None,
        turn_id,
        *from_statuses,
    )


class Database(Protocol):
    """Statements written once for both databases: ``?`` marks each parameter."""

    async def fetch(self, sql: str, *parameters: Any) -> list[dict[str, Any]]:
        """The rows a query returns, as dicts."""

    async def execute(self, sql: str, *parameters: Any) -> int:
        """Run one statement (committed on its own); returns how many rows it changed."""


class SessionGoneError(Exception):
    """The session of a new turn does not exist (it was deleted meanwhile)."""


class RequestTakenError(Exception):
    """The person already has a turn made by a submit with this ``request_id``."""


class QueueFullError(Exception):
    """The person has as many turns queued as they may (``create_turn``'s ``queue_limit``)."""


class SessionBusyError(Exception):
    """The session already has a processing turn (one turn at a time per session), or, for a
    deletion, a queued or processing one."""


@dataclass(frozen=True)
class SessionCursor:
    """Where a page of sessions ended: the last one's activity and id (the list's order)."""

    last_activity: float
    session_id: str


SEARCHED_CHARS = 10_000
"""Characters at the start of each prompt a search looks in."""


def list_sessions_sql(
    owner: str | None,
    query: str,
    after: SessionCursor | None,
    limit: int | None,
    finds: Callable[[str], str],
) -> tuple[str, list[Any]]:
    """The statement of ``TurnStore.list_sessions`` and its values; ``finds(column)`` tests
    that the query, folded, is in the column's first ``SEARCHED_CHARS``, folded the same way
    by the same database (lowered, a final sigma as any other), in linear time
    (``LIKE '%…%'`` backtracks: seconds over long prompts). A page walks its order's index."""
    where: list[str] = []
    values: list[Any] = []
    if owner is not None:
        where.append("owner = ?")
        values.append(owner)
    if after is not None:
        where.append("(last_activity, session_id) < (?, ?)")
        values += [after.last_activity, after.session_id]
    if query:  # a session's turns are its owner's: found by the session's index alone
        where.append(
            f"({finds('title')} OR EXISTS (SELECT 1 FROM turns"
            f" WHERE turns.session_id = sessions.session_id AND {finds('turns.prompt')}))"
        )
        values += [query, query]
    sql = "SELECT * FROM sessions" + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY last_activity DESC, session_id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        values.append(limit)
    return sql, values


RENAME_SESSION = "UPDATE sessions SET title = ?, last_activity = ? WHERE session_id = ? RETURNING *"


class TurnStore(Database, Protocol):
    async def open(self) -> None:
        """Connect and create or migrate the schema."""

    async def close(self) -> None: ...

    async def create_session(self, session: SessionRecord) -> None: ...

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def list_sessions(
        self,
        owner: str | None,
        query: str = "",
        after: SessionCursor | None = None,
        limit: int | None = None,
    ) -> list[SessionRecord]:
        """The owner's sessions (everyone's for None), latest activity first: those whose
        title or a turn's prompt holds ``query`` (any case), after ``after``, at most ``limit``."""

    async def rename_session(self, session_id: str, title: str, at: float) -> SessionRecord | None:
        """Retitle a session (its last activity becomes ``at``); None if there is no such one."""

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session with its turns and their messages, in one transaction; False if
        there is no such one. Raises ``SessionBusyError`` (deleting nothing) while one of its
        turns is queued or processing."""

    async def create_turn(self, turn: TurnRecord, queue_limit: int | None = None) -> None:
        """Store a new turn (``queued``, or ``processing`` with its drone) with its first
        messages. Raises ``SessionBusyError`` for a second processing turn in a session,
        ``RequestTakenError`` (storing nothing) when the owner has a turn of its request id, and
        ``QueueFullError`` (storing nothing) when the owner has ``queue_limit`` turns queued."""

    async def get_turn(self, turn_id: str, messages: bool = True) -> TurnRecord | None:
        """The turn, with its messages unless ``messages`` is False (then an ended turn's
        ``text`` is empty when its messages hold it: ``closing.kept_text``)."""

    async def turn_of_request(self, owner: str, request_id: str) -> TurnRecord | None:
        """The owner's turn made by the submit with ``request_id`` (without its messages, so
        without the text they hold, as ``get_turn`` without them)."""

    async def list_turns(self, session_id: str) -> list[TurnRecord]:
        """The session's turns, oldest first."""

    async def recent_turns(
        self, session_id: str, limit: int, before: str | None = None
    ) -> tuple[list[TurnRecord], bool]:
        """The session's latest ``limit`` turns (older than the turn ``before``, when given),
        oldest first, and whether older ones exist."""

    async def append_messages(self, turn_id: str, messages: list[ChatMessage]) -> None:
        """Append finished messages to a turn's part of the conversation."""

    async def fill_text(self, turn_id: str, text: str) -> bool:
        """Give a turn that ended aborted or in error the text a relay kept of it, where it
        extends what the ending stored (``filled_text``)."""
        ...

    async def add_message(self, turn_id: str, message: ChatMessage, number: int | None) -> bool:
        """Append a drone's message to a processing turn; False (and nothing stored) once the
        turn has ended. ``number`` is its place among the drone's messages of the turn (a turn
        starts with one message, its prompt): a message stored already is not stored again,
        one that does not follow the turn's conversation raises ``MessageRefused``."""

    async def end_turn(
        self,
        turn_id: str,
        ending: Ending,
        from_statuses: tuple[TurnStatus, ...] = ("queued", "processing"),
    ) -> TurnRecord | None:
        """Move a turn in one of ``from_statuses`` to its ending's terminal status; returns it
        as ended (without its messages). In the same transaction the turn's messages are made a
        valid conversation (``closing_messages``).

        Returns None (and changes nothing) if the turn had already ended: first write wins.
        """

    async def processing_turns(
        self, owner: str | None = None, session_id: str | None = None, drone_id: str | None = None
    ) -> list[TurnRecord]:
        """Processing turns (without their messages), oldest first, optionally filtered."""

    async def claim_queued(self, capacity: dict[str, int]) -> list[TurnRecord]:
        """Start the queued turns the drones can take now, in the queue's fair order.

        ``capacity`` is each online drone's concurrency; its free slots are that minus the
        turns processing on it. Atomic across relays: each turn is claimed once, and no drone
        gets more than its slots. Returns the claimed turns (now ``processing``, ``drone_id``
        set).
        """
