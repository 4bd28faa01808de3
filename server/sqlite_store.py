"""The embedded ``TurnStore``: one SQLite file, used from a thread of its own."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from hangar.shared.protocol import ChatMessage, TurnStatus

from . import closing
from .closing import DROP_LAST, DROP_PIECES, SHAPES, unstored
from .queue import CLAIM, QUEUE_ORDER, RUNNING_PER_DRONE, choose
from .schema import migrations
from .sqlite_file import finds, refuse_foreign, relay_lock
from .sqlite_writes import GroupCommit
from .store import (
    RECENT_TURNS,
    RENAME_SESSION,
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

T = TypeVar("T")
Numbers = Sequence[int | None]

MIGRATIONS = migrations("sqlite")


class SqliteTurnStore:
    """Every statement runs on one thread of the store's own, a write with its commit: no
    caller's commit can publish another's half-done change and nothing needs a lock on the
    event loop; writes that arrive while the thread is busy are committed together once it is
    free (``sqlite_writes``)."""

    def __init__(self, path: str | Path, *, relay: bool = False) -> None:
        self.path = str(path)
        self.relay = relay
        """A relay's store: the only relay on this file while it is open (``relay_lock``)."""
        self._lock: int | None = None
        self._conn: sqlite3.Connection | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._writes = GroupCommit(lambda: self.conn)

    async def open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            if self.relay:
                self._lock = relay_lock(self.path)
            else:  # made here (an account command), readable by its owner only, as a relay's
                os.close(os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hangar-sqlite")
        self._conn = await self._call(self._connect)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False)
        try:
            refuse_foreign(conn)
        except BaseException:
            conn.close()
            raise
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        # With WAL, NORMAL loses nothing when the process dies (only on power loss, the last
        # commits); FULL would fsync every commit, measured at 2.5 ms each here.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.create_function("hangar_finds", 2, finds, deterministic=True)
        _migrate(conn)
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    async def close(self) -> None:
        if self._thread is not None:
            conn, self._conn = self._conn, None
            if conn is not None:
                await self._call(conn.close)
            self._thread.shutdown(wait=False)
        if self._lock is not None:  # after SQLite's own descriptor: closing one drops its locks
            os.close(self._lock)
            self._lock = None
        self._thread = None

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("The store is not open.")
        return self._conn

    async def _call(self, work: Callable[[], T]) -> T:
        if self._thread is None:
            raise RuntimeError("The store is not open.")
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    async def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` and commit it, or roll it back if it fails, on the thread (committed
        with the writes that wait beside it: ``sqlite_writes``)."""
        if self._thread is None:
            raise RuntimeError("The store is not open.")
        return await self._writes.write(self._thread, work)

    async def _rows(self, sql: str, parameters: Sequence[Any] = ()) -> list[sqlite3.Row]:
        return await self._call(lambda: self.conn.execute(sql, parameters).fetchall())

    async def fetch(self, sql: str, *parameters: Any) -> list[dict[str, Any]]:
        return [dict(row) for row in await self._rows(sql, parameters)]

    async def execute(self, sql: str, *parameters: Any) -> int:
        return await self._write(lambda conn: conn.execute(sql, parameters).rowcount)

    async def create_session(self, session: SessionRecord) -> None:
        await self._write(
            lambda conn: conn.execute(
                "INSERT INTO sessions (session_id, owner, title, created_at, last_activity)"
                " VALUES (?, ?, ?, ?, ?)",
                (
                    session.session_id,
                    session.owner,
                    session.title,
                    session.created_at,
                    session.last_activity,
                ),
            )
        )

    async def get_session(self, session_id: str) -> SessionRecord | None:
        rows = await self._rows("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
        return SessionRecord(**dict(rows[0])) if rows else None

    async def list_sessions(
        self,
        owner: str | None,
        query: str = "",
        after: SessionCursor | None = None,
        limit: int | None = None,
    ) -> list[SessionRecord]:
        sql, values = list_sessions_sql(owner, query, after, limit, "hangar_finds({}, ?)".format)
        return [SessionRecord(**dict(row)) for row in await self._rows(sql, values)]

    async def rename_session(self, session_id: str, title: str, at: float) -> SessionRecord | None:
        def rename(conn: sqlite3.Connection) -> SessionRecord | None:
            row = conn.execute(RENAME_SESSION, (title, at, session_id)).fetchone()
            return SessionRecord(**dict(row)) if row is not None else None

        return await self._write(rename)

    async def delete_session(self, session_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            if conn.execute(
                "SELECT 1 FROM turns WHERE session_id = ? AND status IN ('queued', 'processing')",
                (session_id,),
            ).fetchone():
                raise SessionBusyError()
            conn.execute(
                "DELETE FROM messages WHERE turn_id IN"
                " (SELECT turn_id FROM turns WHERE session_id = ?)",
                (session_id,),
            )
            conn.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
            conn.execute("DELETE FROM session_tools WHERE session_id = ?", (session_id,))
            deleted = conn.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            return deleted.rowcount == 1

        return await self._write(delete)

    async def create_turn(self, turn: TurnRecord, queue_limit: int | None = None) -> None:
        def insert(conn: sqlite3.Connection) -> None:
            if not conn.execute(*insert_turn(turn, queue_limit)).rowcount:
                raise QueueFullError()
            _insert_messages(conn, turn.turn_id, turn.messages)

        try:
            await self._write(insert)
        except sqlite3.IntegrityError as error:
            if "turns.request_id" in str(error):
                raise RequestTakenError() from None
            if "turns.session_id" in str(error):
                raise SessionBusyError() from None
            if "FOREIGN KEY" in str(error):
                raise SessionGoneError() from None
            raise

    async def get_turn(self, turn_id: str, messages: bool = True) -> TurnRecord | None:
        def read() -> TurnRecord | None:
            row = self.conn.execute("SELECT * FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
            if row is None:
                return None
            return _with_messages(self.conn, [row])[0] if messages else TurnRecord.of(dict(row))

        return await self._call(read)

    async def turn_of_request(self, owner: str, request_id: str) -> TurnRecord | None:
        def read() -> TurnRecord | None:
            row = self.conn.execute(
                "SELECT * FROM turns WHERE owner = ? AND request_id = ?", (owner, request_id)
            ).fetchone()
            return None if row is None else TurnRecord.of(dict(row))

        return await self._call(read)

    async def list_turns(self, session_id: str) -> list[TurnRecord]:
        def read() -> list[TurnRecord]:
            rows = self.conn.execute(
                "SELECT * FROM turns WHERE session_id = ? ORDER BY created_at, turn_id",
                (session_id,),
            ).fetchall()
            return _with_messages(self.conn, rows)

        return await self._call(read)

    async def recent_turns(
        self, session_id: str, limit: int, before: str | None = None
    ) -> tuple[list[TurnRecord], bool]:
        def read() -> tuple[list[TurnRecord], bool]:
            values = (session_id, before, before, before, before, limit + 1)
            rows = self.conn.execute(RECENT_TURNS, values).fetchall()
            page = list(reversed(rows[:limit]))
            return _with_messages(self.conn, page), len(rows) > limit

        return await self._call(read)

    async def append_messages(self, turn_id: str, messages: list[ChatMessage]) -> None:
        await self._write(lambda conn: _insert_messages(conn, turn_id, messages))

    async def add_message(self, turn_id: str, message: ChatMessage, number: int | None) -> bool:
        def add(conn: sqlite3.Connection) -> bool:
            row = conn.execute("SELECT status FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
            if row is None or row["status"] != "processing":
                return False
            # One sent again after a lost ack is stored already; one out of place is refused.
            stored = conn.execute(SHAPES["sqlite"], (turn_id,)).fetchall()
            _insert_messages(conn, turn_id, *unstored(stored, [(number, message)]))
            return True

        return await self._write(add)

    async def fill_text(self, turn_id: str, text: str) -> bool:
        def fill(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "SELECT status, text FROM turns WHERE turn_id = ?", (turn_id,)
            ).fetchone()
            if row is None or row["status"] not in ("aborted", "error"):
                return False
            filled = closing.filled_text(_messages_of(conn, turn_id), row["text"] or "", text)
            if filled is None:
                return False
            grown, added, kept = filled
            conn.execute("UPDATE turns SET text = ? WHERE turn_id = ?", (kept, turn_id))
            if grown:
                conn.execute(DROP_LAST.format("?"), (turn_id,))
            _insert_messages(conn, turn_id, added)
            return True

        return await self._write(fill)

    async def end_turn(
        self,
        turn_id: str,
        ending: Ending,
        from_statuses: tuple[TurnStatus, ...] = ("queued", "processing"),
    ) -> TurnRecord | None:
        sql = end_turn_sql(from_statuses)

        def update(conn: sqlite3.Connection) -> TurnRecord | None:
            if ending.messages:  # a drone's: only a turn it runs (and may end here) takes them
                if "processing" not in from_statuses:
                    return None
                found = conn.execute(
                    "SELECT status FROM turns WHERE turn_id = ?", (turn_id,)
                ).fetchone()
                if found is None or found["status"] != "processing":
                    return None
            stored = conn.execute(SHAPES["sqlite"], (turn_id,)).fetchall()
            fresh, numbers = unstored(stored, ending.messages)  # once the ending may apply
            _insert_messages(conn, turn_id, fresh, numbers)
            messages = _messages_of(conn, turn_id)
            added, text, kept = closing.closing_messages(messages, ending.text, ending.status)
            written = conn.execute(sql, end_turn_values(turn_id, ending, from_statuses, kept))
            if (row := written.fetchone()) is None:
                return None
            _insert_messages(conn, turn_id, added)
            conn.execute(DROP_PIECES.format("?"), (turn_id,))
            return replace(TurnRecord.of(dict(row)), text=text)

        return await self._write(update)

    async def processing_turns(
        self, owner: str | None = None, session_id: str | None = None, drone_id: str | None = None
    ) -> list[TurnRecord]:
        rows = await self._rows(
            "SELECT * FROM turns WHERE status = 'processing'"
            " AND (? IS NULL OR owner = ?) AND (? IS NULL OR session_id = ?)"
            " AND (? IS NULL OR drone_id = ?) ORDER BY created_at",
            (owner, owner, session_id, session_id, drone_id, drone_id),
        )
        return [TurnRecord.of(dict(row)) for row in rows]

    async def claim_queued(self, capacity: dict[str, int]) -> list[TurnRecord]:
        # One call on the store's thread: nothing else reaches the file in between (a SQLite
        # file has one relay).
        def claim(conn: sqlite3.Connection) -> list[TurnRecord]:
            queue = [dict(row) for row in conn.execute(QUEUE_ORDER)]
            if not queue:
                return []
            running = {row[0]: row[1] for row in conn.execute(RUNNING_PER_DRONE)}
            now = time.time()
            claimed = []
            for turn_id, drone in choose(queue, capacity, running):
                row = conn.execute(CLAIM, (drone, now, turn_id)).fetchone()
                if row is not None:
                    claimed.append(TurnRecord.of(dict(row)))
            return claimed

        return await self._write(claim)


def _migrate(conn: sqlite3.Connection) -> None:
    """Apply the migrations this file lacks, all in one transaction that holds the write lock
    (another process opening the file meanwhile waits, then finds them done). Foreign keys are
    off meanwhile, as SQLite's table rebuilds need."""
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.isolation_level = None
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {number}")
            if conn.execute("PRAGMA foreign_key_check").fetchall():
                raise sqlite3.IntegrityError("The migrated database breaks a foreign key.")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.isolation_level = "DEFERRED"


def _statements(script: str) -> list[str]:
    """A migration's statements, one at a time (a trigger's body has semicolons of its own)."""
    found, pending = [], ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\n;"):
                found.append(pending)
            pending = ""
    return found


def _insert_messages(
    conn: sqlite3.Connection, turn_id: str, messages: list[ChatMessage], numbers: Numbers = ()
) -> None:
    """Store ``messages``; a drone's with their ``numbers``."""
    rows = zip(messages, numbers or [None] * len(messages), strict=True)
    conn.executemany(
        "INSERT INTO messages (turn_id, body, number, role, answers, calls)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        [(turn_id, json.dumps(m.wire()), n, *closing.shape_columns(m)) for m, n in rows],
    )


def _messages_of(conn: sqlite3.Connection, turn_id: str) -> list[ChatMessage]:
    rows = conn.execute(
        "SELECT body FROM messages WHERE turn_id = ? ORDER BY message_id", (turn_id,)
    ).fetchall()
    return [ChatMessage.model_validate(json.loads(row["body"])) for row in rows]


def _with_messages(conn: sqlite3.Connection, rows: list[sqlite3.Row]) -> list[TurnRecord]:
    turns = [TurnRecord.of(dict(row)) for row in rows]
    if not turns:
        return turns
    by_id = {turn.turn_id: turn for turn in turns}
    marks = ",".join("?" for _ in by_id)
    for row in conn.execute(
        f"SELECT turn_id, body FROM messages WHERE turn_id IN ({marks}) ORDER BY message_id",
        list(by_id),
    ):
        by_id[row["turn_id"]].messages.append(ChatMessage.model_validate(json.loads(row["body"])))
    return closing.with_texts(turns)
