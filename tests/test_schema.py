"""Both stores migrate to the same schema (one definition in ``hangar.server.schema``), and a
database made by an earlier version upgrades to it."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from hangar.server import queue
from hangar.server.accounts import AccountError, Accounts
from hangar.server.closing import MessageRefused
from hangar.server.pg_guard import ForeignDatabase
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.schema import migrations
from hangar.server.sqlite_store import MIGRATIONS, SqliteTurnStore
from hangar.shared.protocol import ChatMessage


@dataclass(frozen=True)
class Index:
    table: str
    columns: tuple[str, ...]
    unique: bool
    where: str | None


@dataclass(frozen=True)
class Schema:
    columns: dict[str, list[tuple[str, bool]]]
    """Each table's columns in order, with whether they may be NULL."""
    indexes: dict[str, Index]
    """Named indexes (not the ones primary keys and UNIQUE constraints make)."""
    unique: set[tuple[str, tuple[str, ...]]]
    """UNIQUE constraints: table and columns."""


def _predicate(sql: str | None) -> str | None:
    """An index's WHERE clause, spelled the same for both databases."""
    if not sql or " WHERE " not in sql.upper():
        return None
    clause = re.split(r"\bWHERE\b", sql, flags=re.IGNORECASE)[1]
    clause = clause.replace("::text", "").replace("(", "").replace(")", "")
    return " ".join(clause.split()).lower()


def sqlite_schema(path: Path) -> Schema:
    db = sqlite3.connect(path)
    try:
        tables = [
            row[0]
            for row in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'"
                " AND name NOT LIKE 'sqlite_%' ORDER BY name"
            )
        ]
        columns = {
            table: [(row[1], not row[3] and not row[5]) for row in db.execute(
                f"PRAGMA table_info({table})"
            )]
            for table in tables
        }  # fmt: skip
        indexes = {}
        for name, table, sql in db.execute(
            "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        ):
            cols = tuple(row[2] for row in db.execute(f"PRAGMA index_info({name})"))
            unique = bool(re.match(r"\s*CREATE\s+UNIQUE", sql, re.IGNORECASE))
            indexes[name] = Index(table, cols, unique, _predicate(sql))
        constraints = set()
        for table in tables:
            for _, name, _, origin, _ in db.execute(f"PRAGMA index_list({table})"):
                if origin == "u":
                    cols = tuple(row[2] for row in db.execute(f"PRAGMA index_info({name})"))
                    constraints.add((table, cols))
        return Schema(columns, indexes, constraints)
    finally:
        db.close()


async def postgres_schema(url: str) -> Schema:
    db = await asyncpg.connect(url)
    try:
        columns: dict[str, list[tuple[str, bool]]] = {}
        for row in await db.fetch(
            "SELECT table_name, column_name, is_nullable FROM information_schema.columns"
            " WHERE table_schema = 'public' AND table_name <> 'hangar_schema'"
            " ORDER BY table_name, ordinal_position"
        ):
            columns.setdefault(row["table_name"], []).append(
                (row["column_name"], row["is_nullable"] == "YES")
            )
        indexes = {}
        for row in await db.fetch(
            "SELECT i.relname AS name, t.relname AS table, ix.indisunique AS unique,"
            " pg_get_indexdef(ix.indexrelid) AS sql,"
            " array(SELECT a.attname FROM unnest(ix.indkey) WITH ORDINALITY AS k(n, o)"
            "       JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.n"
            "       ORDER BY k.o) AS cols"
            " FROM pg_index ix JOIN pg_class i ON i.oid = ix.indexrelid"
            " JOIN pg_class t ON t.oid = ix.indrelid JOIN pg_namespace s ON s.oid = t.relnamespace"
            " WHERE s.nspname = 'public' AND t.relname <> 'hangar_schema'"
            " AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = ix.indexrelid)"
        ):
            indexes[row["name"]] = Index(
                row["table"], tuple(row["cols"]), row["unique"], _predicate(row["sql"])
            )
        constraints = {
            (row["table"], tuple(row["cols"]))
            for row in await db.fetch(
                "SELECT t.relname AS table, array(SELECT a.attname FROM unnest(c.conkey)"
                " WITH ORDINALITY AS k(n, o) JOIN pg_attribute a ON a.attrelid = t.oid"
                " AND a.attnum = k.n ORDER BY k.o) AS cols"
                " FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid"
                " JOIN pg_namespace s ON s.oid = t.relnamespace"
                " WHERE c.contype = 'u' AND s.nspname = 'public'"
            )
        }
        return Schema(columns, indexes, constraints)
    finally:
        await db.close()


async def test_both_stores_migrate_to_the_same_schema(tmp_path: Path, postgres_url: str) -> None:
    sqlite = SqliteTurnStore(tmp_path / "store.db")
    postgres = PostgresTurnStore(postgres_url)
    await sqlite.open()
    await postgres.open()
    await sqlite.close()
    await postgres.close()

    lite, pg = sqlite_schema(tmp_path / "store.db"), await postgres_schema(postgres_url)

    assert lite.columns == pg.columns
    assert lite.indexes == pg.indexes
    assert lite.unique == pg.unique == {("users", ("name",))}
    assert "turns_processing" in lite.indexes and "one_processing_turn" in lite.indexes


async def test_a_sqlite_file_of_the_first_release_upgrades(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    # As the first release left it: its two migrations, and the index it had then.
    db.executescript(migrations("sqlite")[0] + migrations("sqlite")[1])
    db.executescript("CREATE INDEX turns_status ON turns (status); PRAGMA user_version = 2;")
    db.close()

    store = SqliteTurnStore(path)
    await store.open()
    await store.close()

    indexes = sqlite_schema(path).indexes
    assert "turns_status" not in indexes
    assert indexes["turns_processing"].where == "status = 'processing'"


REFUSED = {
    "another program": "it holds another program's tables, not Hangar's.",
    "a newer Hangar": "a newer release of Hangar made it; this one cannot use it.",
}
"""Why a database that is not this Hangar's is refused, by who made it."""


@pytest.mark.parametrize("made_by", ["another program", "a newer Hangar"])
async def test_a_sqlite_file_that_is_not_this_hangars_is_refused_and_left_as_it_was(
    tmp_path: Path, made_by: str
) -> None:
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    if made_by == "another program":
        db.executescript("CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('mine');")
    else:
        db.executescript(f"CREATE TABLE future (x); PRAGMA user_version = {len(MIGRATIONS) + 1};")
    db.close()
    before = path.read_bytes()

    store = SqliteTurnStore(path)
    with pytest.raises(sqlite3.DatabaseError) as refused:
        await store.open()
    await store.close()

    assert str(refused.value) == REFUSED[made_by]
    assert path.read_bytes() == before


@pytest.mark.parametrize("made_by", ["another program", "a newer Hangar"])
async def test_a_postgres_database_that_is_not_this_hangars_is_refused_and_left_as_it_was(
    postgres_url: str, made_by: str
) -> None:
    """A database of another program's got Hangar's tables beside its own (from a command
    that only lists people, too), as a SQLite file of another program's does not."""
    db = await asyncpg.connect(postgres_url)
    if made_by == "another program":
        await db.execute("CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('mine');")
    else:
        await db.execute(
            "CREATE TABLE hangar_schema (version INTEGER NOT NULL);"
            f"INSERT INTO hangar_schema VALUES ({len(MIGRATIONS) + 1});"
        )
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1"
    before = await db.fetch(tables)

    store = PostgresTurnStore(postgres_url)
    with pytest.raises(ForeignDatabase) as refused:
        await store.open()
    await store.close()

    assert str(refused.value) == REFUSED[made_by]
    assert await db.fetch(tables) == before
    await db.close()


async def test_a_postgres_database_of_the_first_release_upgrades(postgres_url: str) -> None:
    db = await asyncpg.connect(postgres_url)
    # As the first release left it: one migration that already held both processing indexes.
    await db.execute(
        migrations("postgresql")[0]
        + "CREATE INDEX turns_processing ON turns (status) WHERE status = 'processing';"
        + migrations("postgresql")[1]
        + "CREATE TABLE hangar_schema (version INTEGER NOT NULL);"
        + "INSERT INTO hangar_schema (version) VALUES (1);"
    )
    await db.close()

    store = PostgresTurnStore(postgres_url)
    await store.open()
    await store.close()

    schema = await postgres_schema(postgres_url)
    assert schema.indexes["turns_processing"].where == "status = 'processing'"
    assert schema.indexes["one_processing_turn"].unique


TWICE = [
    # turn, status, its text as an earlier version stored it, its messages, the text it keeps
    ("t_1", "finished", "Hello there", ["Hello", " there"], ""),
    ("t_2", "aborted", "Cut sho", ["Cut sho"], ""),
    ("t_3", "finished", "More than said", ["More"], "More than said"),
    ("t_4", "processing", "", ["Live"], ""),
]
"""Turns stored before an answer was stored once: each answer in the turn's text and again in
its messages."""
ANSWERS_ONCE = next(
    number for number, script in enumerate(MIGRATIONS, 1) if "group_concat(said" in script
)
"""The migration that stores answers once."""


Inserts = list[tuple[str, list[tuple[Any, ...]]]]


async def old_store(
    kind: str, tmp_path: Path, postgres_url: str, before: int, inserts: Inserts
) -> SqliteTurnStore | PostgresTurnStore:
    """A store of ``kind`` as version ``before`` left it, holding ``inserts`` (not opened)."""
    if kind == "sqlite":
        path = tmp_path / "old.db"
        db = sqlite3.connect(path)
        db.executescript("".join(migrations("sqlite")[:before]) + f"PRAGMA user_version={before};")
        for sql, rows in inserts:
            db.executemany(sql, rows)
        db.commit()
        db.close()
        return SqliteTurnStore(path)
    pg = await asyncpg.connect(postgres_url)
    for script in migrations("postgresql")[:before]:
        await pg.execute(script)
    await pg.execute("CREATE TABLE hangar_schema (version INTEGER NOT NULL)")
    await pg.execute("INSERT INTO hangar_schema (version) VALUES ($1)", before)
    for sql, rows in inserts:
        *parts, last = sql.split("?")
        numbered = "".join(f"{part}${n}" for n, part in enumerate(parts, 1)) + last
        await pg.executemany(numbered.replace("$2)", "$2::jsonb)"), rows)
    await pg.close()
    return PostgresTurnStore(postgres_url)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_answers_stored_twice_by_an_earlier_version_are_kept_once_and_read_the_same(
    tmp_path: Path, postgres_url: str, kind: str
) -> None:
    before = ANSWERS_ONCE - 1  # the version before answers were stored once
    inserts: Inserts = [
        ("INSERT INTO sessions (session_id, owner, title, created_at) VALUES (?, ?, ?, ?)",
         [("s_1", "alice", "Old", 1.0)]),
        ("INSERT INTO turns (turn_id, session_id, owner, prompt, status, text, created_at)"
         " VALUES (?, ?, ?, ?, ?, ?, ?)",
         [(turn, "s_1", "alice", "Hi", status, text, 2.0)
          for turn, status, text, _, _ in TWICE]),
        ("INSERT INTO messages (turn_id, body) VALUES (?, ?)",
         [(turn, json.dumps({"role": role, "content": content}))
          for turn, _, _, said, _ in TWICE
          for role, content in [("user", "Hi"), *(("assistant", s) for s in said)]]),
    ]  # fmt: skip
    store = await old_store(kind, tmp_path, postgres_url, before, inserts)
    await store.open()
    try:
        [turns, kept] = [
            await store.list_turns("s_1"),
            await store.fetch("SELECT turn_id, text FROM turns ORDER BY turn_id"),
        ]
    finally:
        await store.close()

    assert [(t.turn_id, t.text) for t in turns if t.status != "processing"] == [
        (turn, text) for turn, status, text, _, _ in TWICE if status != "processing"
    ]
    assert [(row["turn_id"], row["text"]) for row in kept] == [
        (turn, keeps) for turn, _, _, _, keeps in TWICE
    ]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_turn_running_across_the_upgrade_that_stores_message_shapes_goes_on(
    tmp_path: Path, postgres_url: str, kind: str
) -> None:
    """Each message's role, the call it answers and the calls it makes are stored beside it
    (read from its body, a reply of 900 calls was parsed whole for each result): the messages
    stored before get them too, so the running turn's next result is checked as before."""
    before = next(n for n, script in enumerate(migrations("sqlite")) if "ADD COLUMN role" in script)
    calls = [{"id": f"c{n}", "name": "read_file", "arguments": "{}"} for n in (1, 2)]
    bodies = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "toolCalls": calls},
        {"role": "tool", "content": "one", "toolCallId": "c1", "name": "read_file"},
    ]
    inserts: Inserts = [
        ("INSERT INTO sessions (session_id, owner, title, created_at) VALUES (?, ?, ?, ?)",
         [("s_1", "alice", "Old", 1.0)]),
        ("INSERT INTO turns (turn_id, session_id, owner, prompt, status, created_at)"
         " VALUES (?, ?, ?, ?, ?, ?)", [("t_1", "s_1", "alice", "Hi", "processing", 2.0)]),
        ("INSERT INTO messages (turn_id, body, number) VALUES (?, ?, ?)",
         [("t_1", json.dumps(body), number) for number, body in enumerate(bodies)]),
    ]  # fmt: skip
    store = await old_store(kind, tmp_path, postgres_url, before, inserts)
    await store.open()
    try:
        with pytest.raises(MessageRefused, match="answers no call"):
            await store.add_message("t_1", tool_result("c1"), 3)  # answered already
        with pytest.raises(MessageRefused, match="need their results"):
            await store.add_message("t_1", ChatMessage(role="assistant", content="Done."), 3)
        assert await store.add_message("t_1", tool_result("c2"), 3)
        assert await store.add_message("t_1", ChatMessage(role="assistant", content="Done."), 4)
        turn = await store.get_turn("t_1")
    finally:
        await store.close()

    assert turn is not None
    assert [m.role for m in turn.messages] == ["user", "assistant", "tool", "tool", "assistant"]


def tool_result(call_id: str) -> ChatMessage:
    return ChatMessage(role="tool", content="two", tool_call_id=call_id, name="read_file")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_turn_running_across_the_upgrade_that_notes_acceptance_is_not_sent_again(
    tmp_path: Path, postgres_url: str, kind: str
) -> None:
    """A relay sends again the orders of turns claimed long ago that no drone was seen to take
    (``queue.UNACCEPTED``): those running when the store learnt to note it count as taken."""
    before = next(n for n, script in enumerate(migrations("sqlite")) if "accepted_at" in script)
    inserts: Inserts = [
        ("INSERT INTO sessions (session_id, owner, title, created_at) VALUES (?, ?, ?, ?)",
         [("s_1", "alice", "Old", 1.0)]),
        ("INSERT INTO turns (turn_id, session_id, owner, prompt, status, created_at, drone_id,"
         " started_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
         [("t_1", "s_1", "alice", "Hi", "processing", 2.0, "d1", 3.0)]),
    ]  # fmt: skip
    store = await old_store(kind, tmp_path, postgres_url, before, inserts)
    await store.open()
    try:
        unaccepted = await store.fetch(queue.UNACCEPTED, time.time())
        [running] = await store.fetch("SELECT accepted_at FROM turns")
    finally:
        await store.close()

    assert unaccepted == [] and running["accepted_at"] == 3.0


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_names_that_differ_only_in_case_from_before_they_were_refused_keep_working(
    tmp_path: Path, postgres_url: str, kind: str
) -> None:
    """One name per person and per drone token in any case is now kept by the store itself
    (``name_key``); people and tokens added before such names were refused keep theirs, and a
    third spelling is still refused."""
    before = next(n for n, script in enumerate(migrations("sqlite")) if "name_key" in script)
    inserts: Inserts = [
        ("INSERT INTO users (user_id, name, role, created_at) VALUES (?, ?, ?, ?)",
         [("u_1", "ALICE", "member", 1.0), ("u_2", "alice", "member", 2.0),
          ("u_3", "bob", "member", 3.0)]),
        ("INSERT INTO drone_tokens (name, token_hash, created_at) VALUES (?, ?, ?)",
         [("laptop", "h1", 1.0), ("Laptop", "h2", 2.0)]),
    ]  # fmt: skip
    store = await old_store(kind, tmp_path, postgres_url, before, inserts)
    await store.open()
    accounts = Accounts(store)
    try:
        people = [user.name for user in await accounts.users()]
        with pytest.raises(AccountError, match="already exists"):
            await accounts.add_user("Alice", None)
        with pytest.raises(AccountError, match="already exists"):
            await accounts.add_user("BOB", None)
        with pytest.raises(AccountError, match="has a token already"):
            await accounts.create_drone_token("LAPTOP")
        await accounts.revoke_drone_token("laptop")
        await accounts.revoke_drone_token("Laptop")
        token = await accounts.create_drone_token("LapTop")
        drone = await accounts.drone_of(token)
    finally:
        await store.close()

    assert sorted(people) == ["ALICE", "alice", "bob"]
    assert drone == "LapTop"
