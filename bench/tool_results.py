"""Storing the tool results of one reply that makes many calls: how many results a second each
store takes, through its own calls (no relay).

A turn's reply makes ``calls`` calls, each with arguments of ``chars`` characters; its results
are then stored one at a time, as a drone delivers them, each checked against the turn's stored
messages (``closing.unstored``). SQLite in a temporary folder, PostgreSQL in a database of its
own (``HANGAR_BENCH_POSTGRES``, an admin URL; created and dropped), skipped with a note when it
does not answer.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.sqlite_store import SqliteTurnStore
from hangar.server.store import SessionRecord, TurnRecord, TurnStore
from hangar.shared.protocol import ChatMessage, ToolCall

from .common import run_main, table
from .search import own_postgres

DATABASE = "hangar_bench_tool_results"
SHAPES = ((900, 3_000), (2_000, 20), (5_000, 20))
"""Calls in the reply, and characters of each call's arguments."""


async def measure(store: TurnStore, calls: int, chars: int) -> float:
    """Seconds to store the results of a reply making ``calls`` calls."""
    turn_id = f"t_{calls}_{chars}"
    await store.create_session(SessionRecord(f"s_{turn_id}", "heavy", "Many calls"))
    first = ChatMessage(role="user", content="Read them all")
    await store.create_turn(TurnRecord(turn_id, f"s_{turn_id}", "heavy", "p", messages=[first]))
    arguments = '{"path": "' + "x" * chars + '"}'
    made = [ToolCall(id=f"c{n}", name="read_file", arguments=arguments) for n in range(calls)]
    reply = ChatMessage(role="assistant", content="", tool_calls=made)
    assert await store.add_message(turn_id, reply, 1)
    started = time.perf_counter()
    for n in range(calls):
        result = ChatMessage(role="tool", content="ok", tool_call_id=f"c{n}", name="read_file")
        assert await store.add_message(turn_id, result, n + 2)
    return time.perf_counter() - started


async def rows_of(kind: str, store: TurnStore) -> list[list[object]]:
    await store.open()
    try:
        rows: list[list[object]] = []
        for calls, chars in SHAPES:
            took = await measure(store, calls, chars)
            rows.append([kind, f"{calls:,}", f"{chars:,}", f"{calls / took:,.0f}", f"{took:.2f}"])
        return rows
    finally:
        await store.close()


async def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0]).parse_args()
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as folder:
        rows += await rows_of("SQLite", SqliteTurnStore(str(Path(folder) / "results.db")))
    async with own_postgres(DATABASE) as url:
        if url:
            rows += await rows_of("PostgreSQL", PostgresTurnStore(url))
    headers = ["store", "calls in the reply", "characters a call", "results/s", "seconds"]
    print(table(headers, rows))


if __name__ == "__main__":
    run_main(main())
