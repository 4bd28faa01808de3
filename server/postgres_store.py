"""``TurnStore`` on PostgreSQL (asyncpg), for several relays sharing one database.

The schema is created and migrated here; the terminal-status rule is a conditional UPDATE, so two
relays can never both end a turn, and a partial unique index keeps one processing turn a session.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import asyncpg

from hangar.shared.protocol import ChatMessage, TurnStatus

from . import closing
from .closing import DROP_LAST, DROP_PIECES, SHAPES, shape_columns, unstored
from .pg_guard import RelayGuard, refuse_foreign
from .queue import CLAIM, QUEUE_ORDER, RUNNING_PER_DRONE, choose
from .schema import migrations
from .store import (
    RECENT_TURNS,
    RENAME_SESSION,
    SEARCHED_CHARS,
    Ending,
    QueueFullError,
    RequestTakenError,
    SessionBusyError,
    SessionCursor,
    SessionGoneError,
    SessionRecord,
    TurnRecord,
    end_turn_sql,
    end_turn_values,
    insert_turn,
    list_sessions_sql,
)

CLAIM_LOCK = 726542
"""The advisory lock relays take turns on to claim queued turns (726541 is the migrations')."""

QUEUE_LOCK = 726543
"""With a person's name hashed: the lock a new turn's count of their queued turns is taken in."""

MIGRATIONS = migrations("postgresql")

STALLED_TRANSACTION = 3.0
"""Seconds PostgreSQL lets a transaction wait on its relay before it ends the relay's session:
a relay frozen in a transaction (stopped, its machine paused or gone) held its locks for as long,
and one frozen in its claim of queued turns held up every relay's queue (``CLAIM_LOCK``). No
transaction of a relay waits on anything but the database."""


class PostgresTurnStore:
    def __init__(self, url: str, *, relay: bool = False, deployment: str | None = None) -> None:
        """``relay``: a relay's store, held with its ``deployment`` (its Redis channel; None
        without Redis) for as long as it is open (``pg_guard``)."""
        self.url = url
        self._pool: asyncpg.Pool | None = None
        self._guard = RelayGuard(url, deployment) if relay else None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("The store is not open.")
        return self._pool

    def _settings(self) -> dict[str, str]:
        """Each connection's settings: its name in ``pg_stat_activity`` says which process it
        is (``hangar relay 4242``)."""
        return {
            "application_name": f"hangar {'relay ' if self._guard else ''}{os.getpid()}",
            "idle_in_transaction_session_timeout": str(int(STALLED_TRANSACTION * 1000)),
        }

    async def open(self) -> None:
        # No standing connections: asyncpg would otherwise try to restore them while the
        # database is down, logging a traceback each time.
        self._pool = await asyncpg.create_pool(
            self.url, min_size=0, max_size=10, server_settings=self._settings()
        )
        async with self.pool.acquire() as db, db.transaction():
            # One relay migrates at a time; the others wait on the lock, then find it done.
            await db.execute("SELECT pg_advisory_xact_lock(726541)")
            await refuse_foreign(db, len(MIGRATIONS))
            await db.execute("CREATE TABLE IF NOT EXISTS hangar_schema (version INTEGER NOT NULL)")
            version = await db.fetchval("SELECT max(version) FROM hangar_schema") or 0
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                await db.execute(script)
                await db.execute("INSERT INTO hangar_schema (version) VALUES ($1)", number)
        if self._guard is not None:
            await self._guard.take()

    async def close(self) -> None:
        if self._guard is not None:
            await self._guard.release()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def fetch(self, sql: str, *parameters: Any) -> list[dict[str, Any]]:
        return [dict(row) for row in await self.pool.fetch(_numbered(sql), *parameters)]

    async def execute(self, sql: str, *parameters: Any) -> int:
        status = await self.pool.execute(_numbered(sql), *_texts(parameters))
        count = status.rsplit(" ", 1)[-1]
        return int(count) if count.isdigit() else 0

    async def create_session(self, session: SessionRecord) -> None:
        await self.pool.execute(
            "INSERT INTO sessions (session_id, owner, title, created_at, last_activity)"
            " VALUES ($1, $2, $3, $4, $5)",
            session.session_id,
            session.owner,
            _pg(session.title),
            session.created_at,
            session.last_activity,
        )

    async def get_session(self, session_id: str) -> SessionRecord | None:
        row = await self.pool.fetchrow("SELECT * FROM sessions WHERE session_id = $1", session_id)
        return SessionRecord(**dict(row)) if row else None

    async def list_sessions(
        self,
        owner: str | None,
        query: str = "",
        after: SessionCursor | None = None,
        limit: int | None = None,
    ) -> list[SessionRecord]:
        sql, values = list_sessions_sql(
            owner,
            query,
            after,
            limit,
            lambda column: (
                f"strpos(translate(lower(left({column}, {SEARCHED_CHARS})), 'ς', 'σ'),"
                " translate(lower(?), 'ς', 'σ')) > 0"
            ),
        )
        rows = await self.pool.fetch(_numbered(sql), *_texts(tuple(values)))
        return [SessionRecord(**dict(row)) for row in rows]

    async def rename_session(self, session_id: str, title: str, at: float) -> SessionRecord | None:
        row = await self.pool.fetchrow(_numbered(RENAME_SESSION), _pg(title), at, session_id)
        return SessionRecord(**dict(row)) if row is not None else None

    async def delete_session(self, session_id: str) -> bool:
        async with self.pool.acquire() as db, db.transaction():
            # The session's row lock holds back a turn being added to it meanwhile.
            if not await db.fetchval(
                "SELECT 1 FROM sessions WHERE session_id = $1 FOR UPDATE", session_id
            ):
                return False
            if await db.fetchval(
                "SELECT 1 FROM turns WHERE session_id = $1 AND status IN ('queued', 'processing')",
                session_id,
            ):
                raise SessionBusyError()
            await db.execute(
                "DELETE FROM messages WHERE turn_id IN"
                " (SELECT turn_id FROM turns WHERE session_id = $1)",
                session_id,
            )
            await db.execute("DELETE FROM turns WHERE session_id = $1", session_id)
            await db.execute("DELETE FROM session_tools WHERE session_id = $1", session_id)
            await db.execute("DELETE FROM sessions WHERE session_id = $1", session_id)
            return True

    async def create_turn(self, turn: TurnRecord, queue_limit: int | None = None) -> None:
        async with self.pool.acquire() as db, db.transaction():
            if queue_limit is not None:  # one count at a time per person, whichever relay
                await db.execute(
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))", QUEUE_LOCK, turn.owner
                )
            try:
                sql, values = insert_turn(turn, queue_limit)
                if (await db.execute(_numbered(sql), *_texts(values))).endswith(" 0"):
                    raise QueueFullError()
            except asyncpg.UniqueViolationError as error:
                if error.constraint_name == "one_processing_turn":
                    raise SessionBusyError() from None
                if error.constraint_name == "turns_request":
                    raise RequestTakenError() from None
                raise
            except asyncpg.ForeignKeyViolationError:
                raise SessionGoneError() from None
            await _insert_messages(db, turn.turn_id, turn.messages)

    async def get_turn(self, turn_id: str, messages: bool = True) -> TurnRecord | None:
        row = await self.pool.fetchrow("SELECT * FROM turns WHERE turn_id = $1", turn_id)
        if row is None:
            return None
        if not messages:
            return TurnRecord.of(dict(row))
        return (await self._with_messages([row]))[0]

    async def turn_of_request(self, owner: str, request_id: str) -> TurnRecord | None:
        row = await self.pool.fetchrow(
            "SELECT * FROM turns WHERE owner = $1 AND request_id = $2", owner, request_id
        )
        return None if row is None else TurnRecord.of(dict(row))

    async def list_turns(self, session_id: str) -> list[TurnRecord]:
        rows = await self.pool.fetch(
            "SELECT * FROM turns WHERE session_id = $1 ORDER BY created_at, turn_id", session_id
        )
        return await self._with_messages(list(rows))

    async def recent_turns(
        self, session_id: str, limit: int, before: str | None = None
    ) -> tuple[list[TurnRecord], bool]:
        values = (session_id, before, before, before, before, limit + 1)
        rows = await self.pool.fetch(_numbered(RECENT_TURNS), *values)
        page = list(reversed(rows[:limit]))
        return await self._with_messages(page), len(rows) > limit

    async def append_messages(self, turn_id: str, messages: list[ChatMessage]) -> None:
        async with self.pool.acquire() as db:
            await _insert_messages(db, turn_id, messages)

    async def add_message(self, turn_id: str, message: ChatMessage, number: int | None) -> bool:
        async with self.pool.acquire() as db, db.transaction():
            # The turn's row lock orders this against its ending and its other messages.
            status = await db.fetchval(
                "SELECT status FROM turns WHERE turn_id = $1 FOR UPDATE", turn_id
            )
            if status != "processing":
                return False
            # One sent again after a lost ack is stored already; one out of place is refused.
            stored = [tuple(row) for row in await db.fetch(SHAPES["postgres"], turn_id)]
            await _insert_messages(db, turn_id, *unstored(stored, [(number, message)]))
            return True

    async def fill_text(self, turn_id: str, text: str) -> bool:
        async with self.pool.acquire() as db, db.transaction():
            row = await db.fetchrow(
                "SELECT status, text FROM turns WHERE turn_id = $1 FOR UPDATE", turn_id
            )
            if row is None or row["status"] not in ("aborted", "error"):
                return False
            found = await db.fetch(
                "SELECT body FROM messages WHERE turn_id = $1 ORDER BY message_id", turn_id
            )
            messages = [ChatMessage.model_validate(json.loads(r["body"])) for r in found]
            filled = closing.filled_text(messages, row["text"] or "", _pg(text) or "")
            if filled is None:
                return False
            grown, added, kept = filled
            await db.execute("UPDATE turns SET text = $1 WHERE turn_id = $2", kept, turn_id)
            if grown:
                await db.execute(DROP_LAST.format("$1"), turn_id)
            await _insert_messages(db, turn_id, added)
            return True

    async def end_turn(
        self,
        turn_id: str,
        ending: Ending,
        from_statuses: tuple[TurnStatus, ...] = ("queued", "processing"),
    ) -> TurnRecord | None:
        async with self.pool.acquire() as db, db.transaction():
            status = await db.fetchval(
                "SELECT status FROM turns WHERE turn_id = $1 FOR UPDATE", turn_id
            )
            if status not in from_statuses:
                return None
            found = await db.fetch(
                "SELECT body FROM messages WHERE turn_id = $1 ORDER BY message_id", turn_id
            )
            messages = [ChatMessage.model_validate(json.loads(r["body"])) for r in found]
            if ending.messages:  # a drone's: only a turn it runs takes them
                if status != "processing":
                    return None
                stored = [tuple(row) for row in await db.fetch(SHAPES["postgres"], turn_id)]
                fresh, numbers = unstored(stored, ending.messages)
                await _insert_messages(db, turn_id, fresh, numbers)
                messages += fresh
            added, text, kept = closing.closing_messages(
                messages, _pg(ending.text) or "", ending.status
            )
            values = _texts(end_turn_values(turn_id, ending, from_statuses, kept))
            row = await db.fetchrow(_numbered(end_turn_sql(from_statuses)), *values)
            if row is None:
                return None
            await _insert_messages(db, turn_id, added)
            await db.execute(DROP_PIECES.format("$1"), turn_id)
            return replace(TurnRecord.of(dict(row)), text=_pg(text) or "")

    async def processing_turns(
        self, owner: str | None = None, session_id: str | None = None, drone_id: str | None = None
    ) -> list[TurnRecord]:
        rows = await self.pool.fetch(
            "SELECT * FROM turns WHERE status = 'processing'"
            " AND ($1::text IS NULL OR owner = $1) AND ($2::text IS NULL OR session_id = $2)"
            " AND ($3::text IS NULL OR drone_id = $3) ORDER BY created_at",
            owner,
            session_id,
            drone_id,
        )
        return [TurnRecord.of(dict(row)) for row in rows]

    async def claim_queued(self, capacity: dict[str, int]) -> list[TurnRecord]:
        async with self.pool.acquire() as db, db.transaction():
            # One claim at a time across relays: the lock is the transaction's, released at its
            # end. Each claim is a few queries, so relays take turns for milliseconds.
            await db.execute("SELECT pg_advisory_xact_lock($1)", CLAIM_LOCK)
            queue = [dict(row) for row in await db.fetch(QUEUE_ORDER)]
            if not queue:
                return []
            running = {row[0]: row[1] for row in await db.fetch(RUNNING_PER_DRONE)}
            now = time.time()
            claimed = []
            for turn_id, drone in choose(queue, capacity, running):
                row = await db.fetchrow(_numbered(CLAIM), drone, now, turn_id)
                if row is not None:
                    claimed.append(TurnRecord.of(dict(row)))
            return claimed

    async def _with_messages(self, rows: list[Any]) -> list[TurnRecord]:
        turns = [TurnRecord.of(dict(row)) for row in rows]
        if not turns:
            return turns
        by_id = {turn.turn_id: turn for turn in turns}
        found = await self.pool.fetch(
            "SELECT turn_id, body FROM messages WHERE turn_id = ANY($1::text[])"
            " ORDER BY message_id",
            list(by_id),
        )
        for row in found:
            by_id[row["turn_id"]].messages.append(
                ChatMessage.model_validate(json.loads(row["body"]))
            )
        return closing.with_texts(turns)


async def _insert_messages(
    db: Any, turn_id: str, messages: list[ChatMessage], numbers: Sequence[int | None] = ()
) -> None:
    """Store ``messages``; a drone's with their ``numbers``."""
    if messages:
        rows = zip(messages, numbers or [None] * len(messages), strict=True)
        await db.executemany(
            "INSERT INTO messages (turn_id, body, number, role, answers, calls)"
            " VALUES ($1, $2::jsonb, $3, $4, $5, $6)",
            [
                (turn_id, json.dumps(_without_nul(m.wire())), n, *_texts(shape_columns(m)))
                for m, n in rows
            ],
        )


@functools.lru_cache(maxsize=256)
def _numbered(sql: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1``, ``$2``, …"""
    parts = sql.split("?")
    return "".join(f"{part}${n}" for n, part in enumerate(parts[:-1], start=1)) + parts[-1]


def _texts(values: tuple[Any, ...]) -> list[Any]:
    return [_pg(value) if isinstance(value, str) else value for value in values]


def _pg(text: str | None) -> str | None:
    """PostgreSQL text cannot hold NUL; it is stored as U+FFFD (the replacement character)."""
    return text.replace("\x00", "\ufffd") if text else text


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return _pg(value)
    if isinstance(value, list):
        return [_without_nul(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_nul(item) for key, item in value.items()}
    return value
