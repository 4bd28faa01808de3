"""The embedded ``TurnStore``: one SQLite file, written through aiosqlite."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiosqlite

from shared.protocol import ChatMessage, TurnStatus

from .store import SessionBusyError, SessionRecord, TurnRecord

MIGRATIONS = [
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        title TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX sessions_owner ON sessions (owner, created_at);
    CREATE TABLE turns (
        turn_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions (session_id),
        owner TEXT NOT NULL,
        prompt TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('processing', 'finished', 'aborted', 'error')),
        result TEXT,
        text TEXT NOT NULL DEFAULT '',
        drone_id TEXT,
        created_at REAL NOT NULL,
        ended_at REAL
    );
    CREATE INDEX turns_session ON turns (session_id, created_at);
    CREATE INDEX turns_status ON turns (status);
    CREATE TABLE messages (
        message_id INTEGER PRIMARY KEY AUTOINCREMENT,
        turn_id TEXT NOT NULL REFERENCES turns (turn_id),
        body TEXT NOT NULL
    );
    CREATE INDEX messages_turn ON messages (turn_id, message_id);
    """,
    """
    CREATE UNIQUE INDEX one_processing_turn ON turns (session_id) WHERE status = 'processing';
    """,
]


class SqliteTurnStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db: aiosqlite.Connection | None = None
        # One connection serves every caller: a write and its commit go together, so one
        # caller's commit never publishes another's half-done change.
        self._writing = asyncio.Lock()

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("The store is not open.")
        return self._db

    async def open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = await aiosqlite.connect(self.path)
        self._db.row_factory = aiosqlite.Row
        await self._db.execute("PRAGMA journal_mode=WAL")
        # With WAL, NORMAL loses nothing when the process dies (only on power loss, the last
        # commits); FULL would fsync every commit, measured at 2.5 ms each here.
        await self._db.execute("PRAGMA synchronous=NORMAL")
        await self._db.execute("PRAGMA foreign_keys=ON")
        async with self._db.execute("PRAGMA user_version") as cursor:
            row = await cursor.fetchone()
        version = int(row[0]) if row else 0
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            await self._db.executescript(script)
            await self._db.execute(f"PRAGMA user_version = {number}")
        await self._db.commit()

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def create_session(self, session: SessionRecord) -> None:
        async with self._writing:
            await self._run(
                "INSERT INTO sessions (session_id, owner, title, created_at) VALUES (?, ?, ?, ?)",
                (session.session_id, session.owner, session.title, session.created_at),
            )
            await self.db.commit()

    async def get_session(self, session_id: str) -> SessionRecord | None:
        async with self.db.execute(
            "SELECT * FROM sessions WHERE session_id = ?", (session_id,)
        ) as cursor:
            row = await cursor.fetchone()
        return _session(row) if row else None

    async def list_sessions(self, owner: str) -> list[SessionRecord]:
        async with self.db.execute(
            "SELECT * FROM sessions WHERE owner = ? ORDER BY created_at DESC", (owner,)
        ) as cursor:
            return [_session(row) for row in await cursor.fetchall()]

    async def create_turn(self, turn: TurnRecord) -> None:
        async with self._writing:
            try:
                await self._insert_turn(turn)
            except sqlite3.IntegrityError as error:
                # Only the failed INSERT is undone; no rollback, which would also undo
                # other callers' pending writes on this shared connection.
                if "turns.session_id" in str(error):
                    raise SessionBusyError() from None
                raise
            await self._insert_messages(turn.turn_id, turn.messages)
            await self.db.commit()

    async def _insert_turn(self, turn: TurnRecord) -> None:
        await self._run(
            "INSERT INTO turns (turn_id, session_id, owner, prompt, status, result, text,"
            " drone_id, created_at, ended_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
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
            ),
        )

    async def get_turn(self, turn_id: str, messages: bool = True) -> TurnRecord | None:
        async with self.db.execute("SELECT * FROM turns WHERE turn_id = ?", (turn_id,)) as cursor:
            row = await cursor.fetchone()
        if row is None:
            return None
        return (await self._with_messages([row]))[0] if messages else _turn(row)

    async def list_turns(self, session_id: str) -> list[TurnRecord]:
        async with self.db.execute(
            "SELECT * FROM turns WHERE session_id = ? ORDER BY created_at, rowid", (session_id,)
        ) as cursor:
            rows = list(await cursor.fetchall())
        return await self._with_messages(rows)

    async def append_messages(self, turn_id: str, messages: list[ChatMessage]) -> None:
        async with self._writing:
            await self._insert_messages(turn_id, messages)
            await self.db.commit()

    async def end_turn(self, turn_id: str, status: TurnStatus, result: str, text: str) -> bool:
        async with self._writing:
            changed = await self._run(
                "UPDATE turns SET status = ?, result = ?, text = ?, ended_at = ?"
                " WHERE turn_id = ? AND status = 'processing'",
                (status, result, text, time.time(), turn_id),
            )
            await self.db.commit()
        return changed == 1

    async def processing_turns(
        self, owner: str | None = None, session_id: str | None = None
    ) -> list[TurnRecord]:
        async with self.db.execute(
            "SELECT * FROM turns WHERE status = 'processing'"
            " AND (? IS NULL OR owner = ?) AND (? IS NULL OR session_id = ?)"
            " ORDER BY created_at",
            (owner, owner, session_id, session_id),
        ) as cursor:
            return [_turn(row) for row in await cursor.fetchall()]

    async def _insert_messages(self, turn_id: str, messages: list[ChatMessage]) -> None:
        if messages:
            cursor = await self.db.executemany(
                "INSERT INTO messages (turn_id, body) VALUES (?, ?)",
                [(turn_id, json.dumps(m.wire())) for m in messages],
            )
            await cursor.close()

    async def _run(self, sql: str, parameters: tuple[Any, ...]) -> int:
        """Execute one statement and close its cursor; returns the rows it changed."""
        async with self.db.execute(sql, parameters) as cursor:
            return cursor.rowcount

    async def _with_messages(self, rows: list[Any]) -> list[TurnRecord]:
        turns = [_turn(row) for row in rows]
        if not turns:
            return turns
        by_id = {turn.turn_id: turn for turn in turns}
        marks = ",".join("?" for _ in by_id)
        async with self.db.execute(
            f"SELECT turn_id, body FROM messages WHERE turn_id IN ({marks}) ORDER BY message_id",
            list(by_id),
        ) as cursor:
            for row in await cursor.fetchall():
                by_id[row["turn_id"]].messages.append(
                    ChatMessage.model_validate(json.loads(row["body"]))
                )
        return turns


def _session(row: Any) -> SessionRecord:
    return SessionRecord(
        session_id=row["session_id"],
        owner=row["owner"],
        title=row["title"],
        created_at=row["created_at"],
    )


def _turn(row: Any) -> TurnRecord:
    return TurnRecord(
        turn_id=row["turn_id"],
        session_id=row["session_id"],
        owner=row["owner"],
        prompt=row["prompt"],
        status=row["status"],
        result=row["result"],
        text=row["text"],
        drone_id=row["drone_id"],
        created_at=row["created_at"],
        ended_at=row["ended_at"],
        messages=[],
    )
