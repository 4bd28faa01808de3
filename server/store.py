"""The relay's persistence interface: chat sessions and their turns.

Handlers never write SQL; they call a ``TurnStore``. The SQLite implementation is the embedded
default; any other database implements the same protocol. Turn status is a state machine
``processing -> finished | aborted | error`` whose first terminal write wins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from hangar.shared.protocol import ChatMessage, SessionView, TurnStatus, TurnView


@dataclass
class SessionRecord:
    session_id: str
    owner: str
    title: str
    created_at: float = field(default_factory=time.time)

    def view(
        self, processing_turn_id: str | None = None, owner_name: str | None = None
    ) -> SessionView:
        return SessionView(
            session_id=self.session_id,
            title=self.title,
            created_at=self.created_at,
            processing_turn_id=processing_turn_id,
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
        )


class Database(Protocol):
    """Statements written once for both databases: ``?`` marks each parameter."""

    async def fetch(self, sql: str, *parameters: Any) -> list[dict[str, Any]]:
        """The rows a query returns, as dicts."""

    async def execute(self, sql: str, *parameters: Any) -> int:
        """Run one statement (committed on its own); returns how many rows it changed."""


class SessionBusyError(Exception):
    """The session already has a processing turn (one turn at a time per session)."""


class TurnStore(Database, Protocol):
    async def open(self) -> None:
        """Connect and create or migrate the schema."""

    async def close(self) -> None: ...

    async def create_session(self, session: SessionRecord) -> None: ...

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def list_sessions(self, owner: str | None) -> list[SessionRecord]:
        """The owner's sessions (everyone's for None), newest first."""

    async def create_turn(self, turn: TurnRecord) -> None:
        """Store a new turn (status ``processing``) with its first messages.

        Raises ``SessionBusyError`` if the session already has a processing turn.
        """

    async def get_turn(self, turn_id: str, messages: bool = True) -> TurnRecord | None:
        """The turn, with its messages unless ``messages`` is False."""

    async def list_turns(self, session_id: str) -> list[TurnRecord]:
        """The session's turns, oldest first."""

    async def append_messages(self, turn_id: str, messages: list[ChatMessage]) -> None:
        """Append finished messages to a turn's part of the conversation."""

    async def end_turn(self, turn_id: str, status: TurnStatus, result: str, text: str) -> bool:
        """Move a ``processing`` turn to a terminal status.

        Returns False (and changes nothing) if the turn had already ended: first write wins.
        """

    async def processing_turns(
        self, owner: str | None = None, session_id: str | None = None
    ) -> list[TurnRecord]:
        """Processing turns (without their messages), oldest first, optionally filtered."""


async def session_history(store: TurnStore, session_id: str) -> list[ChatMessage]:
    """The conversation so far, as the provider will see it: every turn's messages in order."""
    history: list[ChatMessage] = []
    for turn in await store.list_turns(session_id):
        history.extend(turn.messages)
    return history
