"""A relay without Redis writes its running turns' text to its database as it streams.

Such a relay keeps a running turn's text in memory (``LocalLiveState``), and its drone sends the
text whole again when it reconnects. Killed together with its drone, the relay lost it: the
turn ended holding its prompt only, and a page opened on the restarted relay showed none of it.
Now what streamed since the last write is written every second, as pieces by offset (a long
answer is not written again each time), and a restarted relay starts from it: its snapshots
show it, the drone's text sent again carries on from it, and a turn whose drone does not come
back ends holding it. An ending drops the pieces in its own transaction (``DROP_PIECES``): an
answer is stored once, in the turn's messages.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import groupby

from .limits import QuietLog
from .live_state import LocalLiveState
from .store import Database

log = logging.getLogger("hangar.relay")
failures = QuietLog(log)

WRITE_EVERY = 1.0
"""Seconds between writes: at most this much of a running turn's text is lost with its relay
and its drone."""
ROWS_PER_STATEMENT = 100

WRITTEN = (
    "SELECT p.turn_id, p.at, p.piece FROM turn_pieces p"
    " JOIN turns t ON t.turn_id = p.turn_id AND t.status = 'processing'"
    " ORDER BY p.turn_id, p.at"
)
STRAYS = (
    "DELETE FROM turn_pieces"
    " WHERE turn_id NOT IN (SELECT turn_id FROM turns WHERE status = 'processing')"
)
"""Pieces of turns that ended: an ending drops them, but one written in the same instant on
PostgreSQL may land after it."""


def insert_sql(rows: int) -> str:
    """Insert ``rows`` pieces, of turns still running only."""
    values = ", ".join("(?, CAST(? AS INTEGER), ?)" for _ in range(rows))
    return (
        "INSERT INTO turn_pieces (turn_id, at, piece)"
        f" SELECT v.column1, v.column2, v.column3 FROM (VALUES {values}) AS v"
        " JOIN turns t ON t.turn_id = v.column1 AND t.status = 'processing'"
    )


async def restore(store: Database, live: LocalLiveState) -> int:
    """Give ``live`` the text the database holds of the running turns; returns how many."""
    await store.execute(STRAYS)
    rows = await store.fetch(WRITTEN)
    for turn_id, pieces in groupby(rows, key=lambda row: str(row["turn_id"])):
        text = ""
        for row in pieces:  # in order; one written twice (its write's answer was lost) once
            at, piece = int(row["at"]), str(row["piece"])
            if at > len(text):
                break  # a gap: what came after it is not the turn's text
            text += piece[len(text) - at :]
        live.restore(turn_id, text)
    return len(live.written)


async def write(store: Database, live: LocalLiveState) -> None:
    """Write what the running turns streamed since the last write."""
    pieces = live.to_write()
    for start in range(0, len(pieces), ROWS_PER_STATEMENT):
        chunk = pieces[start : start + ROWS_PER_STATEMENT]
        try:
            await store.execute(insert_sql(len(chunk)), *(v for piece in chunk for v in piece))
        except Exception as error:  # the database is down or slow: the next write tries again
            live.not_written(pieces[start:])
            failures.warning(
                "running text not written (%s: %s)", type(error).__name__, str(error)[:200]
            )
            return


async def write_forever(store: Database, live: LocalLiveState) -> None:
    while True:
        await asyncio.sleep(WRITE_EVERY)
        await write(store, live)
