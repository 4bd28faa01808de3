"""Searching sessions: how long ``listSessions {query}`` holds each store, and how long another
person's write waits behind four searches at once (SQLite runs every call on one thread).

One person owns ``--sessions`` sessions, each with a turn whose prompt is ``--chars`` characters
of ``a``; queries that make a ``LIKE '%…%'`` backtrack (``a…ab``), that make a skip search
compare most of the query at every place (``ba…a``), and an ordinary word. Both stores: SQLite
in a temporary folder, PostgreSQL in a database of its own (``HANGAR_BENCH_POSTGRES``, an
admin URL; created and dropped), skipped with a note when it does not answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg

from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.sqlite_store import SqliteTurnStore
from hangar.server.store import SessionRecord, TurnRecord, TurnStore

from .common import run_main, summary, table

POSTGRES = os.environ.get("HANGAR_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
DATABASE = "hangar_bench_search"
QUERIES = {
    "a…ab (200 characters)": "a" * 199 + "b",
    "ba…a (200 characters)": "b" + "a" * 199,
    "a word": "deploy",
}


async def measure(store: TurnStore, args: argparse.Namespace) -> list[list[object]]:
    await store.open()
    try:
        for index in range(args.sessions):
            session_id = f"s_{index:05}"
            await store.create_session(SessionRecord(session_id, "heavy", "A long one"))
            await store.create_turn(
                TurnRecord(f"t_{index:05}", session_id, "heavy", "a" * args.chars)
            )
        rows: list[list[object]] = []
        for label, query in QUERIES.items():
            took = []
            for _ in range(args.runs):
                started = time.perf_counter()
                await store.list_sessions("heavy", query)
                took.append(time.perf_counter() - started)
            rows.append([label, "alone", *summary(took)])
        waited = []
        for run in range(args.runs):
            searches = [
                asyncio.ensure_future(
                    store.list_sessions("heavy", QUERIES["a…ab (200 characters)"])
                )
                for _ in range(4)
            ]
            await asyncio.sleep(0)  # the searches are asked for first
            started = time.perf_counter()
            await store.create_session(SessionRecord(f"light_{run}", "light", "Quick"))
            waited.append(time.perf_counter() - started)
            await asyncio.gather(*searches)
        rows.append(["another person's write", "behind 4 searches (a…ab)", *summary(waited)])
        return rows
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def own_postgres(name: str) -> AsyncIterator[str | None]:
    """A PostgreSQL database of the benchmark's own, ``name``, made anew and dropped after: its
    URL, or None (said) when no server answers at ``POSTGRES``."""
    try:
        admin = await asyncpg.connect(POSTGRES, timeout=5)
    except (OSError, asyncpg.PostgresError) as error:
        print(f"PostgreSQL skipped: {error}")
        yield None
        return
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name}")
        yield POSTGRES.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--chars", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    headers = ["store", "query", "while", "p50 ms", "p99 ms", "max ms"]
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as folder:
        store = SqliteTurnStore(str(Path(folder) / "search.db"))
        rows += [["SQLite", *row] for row in await measure(store, args)]
    async with own_postgres(DATABASE) as url:
        if url:
            rows += [["PostgreSQL", *row] for row in await measure(PostgresTurnStore(url), args)]
    print(f"{args.sessions} sessions of one person, each prompt {args.chars:,} characters")
    print(table(headers, rows))


if __name__ == "__main__":
    run_main(main())
