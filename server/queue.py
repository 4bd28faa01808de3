"""The queue of work orders: which queued turn starts next, on which drone, and where each
queued turn stands. The SQL is written once for both stores; each store runs the claim inside a
transaction of its own (see ``TurnStore.claim_queued``).

The order is fair between people: each person's queued turns are ranked (their first, second,
…), and every person's first goes before anyone's second; among equals, the person whose last
turn started longest ago (or never) goes first, then the oldest turn. So one person's fifty
orders do not hold up another's one: after each of theirs starts, the other's is next. A
session's turns run one at a time, in the order they were queued. A turn that names a drone
waits for that drone; any other goes to the drone with the most room (the lowest share of its
slots in use; ties at random), so load spreads.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from .live_state import LiveState
from .store import Database, TurnRecord

QUEUE_ORDER = """
    WITH queued AS (
        SELECT turn_id, session_id, owner, wanted_drone, created_at,
            CASE WHEN ROW_NUMBER() OVER (
                PARTITION BY session_id ORDER BY created_at, turn_id
            ) = 1 AND NOT EXISTS (
                SELECT 1 FROM turns running
                WHERE running.session_id = turns.session_id AND running.status = 'processing'
            ) THEN 1 ELSE 0 END AS ready
        FROM turns WHERE status = 'queued'
    ),
    ranked AS (
        SELECT queued.*, ROW_NUMBER() OVER (
            PARTITION BY owner ORDER BY ready DESC, created_at, turn_id
        ) AS owner_rank
        FROM queued
    ),
    served AS (
        SELECT owner, max(started_at) AS served_at FROM turns
        WHERE started_at IS NOT NULL AND owner IN (SELECT owner FROM queued) GROUP BY owner
    )
    SELECT ranked.turn_id, ranked.session_id, ranked.owner, ranked.wanted_drone, ranked.ready,
        COALESCE(served.served_at, 0) AS served_at, ranked.created_at
    FROM ranked LEFT JOIN served ON served.owner = ranked.owner
    ORDER BY ranked.ready DESC, owner_rank, COALESCE(served.served_at, 0), ranked.created_at,
        ranked.turn_id
"""
"""Every queued turn, in the order they start; ``ready`` when nothing in its session runs or
waits before it. A person's places are counted among their ready turns: follow-ups that wait
for their session cost nobody a place, and come last (they start as their session frees)."""

RUNNING_PER_DRONE = """
    SELECT drone_id, count(*) AS running FROM turns
    WHERE status = 'processing' AND drone_id IS NOT NULL GROUP BY drone_id
"""

CLAIM = """
    UPDATE turns SET status = 'processing', drone_id = ?, started_at = ?
    WHERE turn_id = ? AND status = 'queued' RETURNING *
"""


def choose(
    queue: list[dict[str, Any]],
    capacity: dict[str, int],
    running: dict[str, int],
    rng: random.Random | None = None,
) -> list[tuple[str, str]]:
    """Which ready turns (``QUEUE_ORDER`` rows) start, on which drone: ``(turn_id, drone_id)``.
    A turn that names a drone that is away or full takes no place in its person's line: their
    next turn that can start has it."""
    rng = rng or random.Random()
    used = {drone: running.get(drone, 0) for drone in capacity}

    def may_start(row: dict[str, Any]) -> bool:
        wanted = row["wanted_drone"]
        return wanted is None or used.get(wanted, 1) < capacity.get(wanted, 0)

    chosen: list[tuple[str, str]] = []
    for row in _in_line([row for row in queue if row["ready"] and may_start(row)]):
        wanted = row["wanted_drone"]
        if wanted is not None:
            candidates = [wanted] if used[wanted] < capacity[wanted] else []
        else:
            free = [drone for drone, slots in capacity.items() if used[drone] < slots]
            least = min((used[d] / capacity[d] for d in free), default=None)
            candidates = [d for d in free if used[d] / capacity[d] == least]
        if candidates:
            drone = rng.choice(candidates)
            used[drone] += 1
            chosen.append((row["turn_id"], drone))
    return chosen


@dataclass(frozen=True)
class Place:
    """Where a queued turn stands."""

    turn_id: str
    session_id: str
    position: int
    """1 for the next to start (for its drone); 0 while the turn before it in its session runs."""
    drone_id: str | None


def places(queue: list[dict[str, Any]], online: Collection[str] | None) -> list[Place]:
    """Each queued turn's place in line: ready turns ahead of it that could take its slot (for
    a turn that takes any drone, those for any drone and those waiting for a drone ``online``
    with a free slot; for one that waits for a drone, those waiting for it or for any).
    ``None``: which drones are online is not known now, and every drone named counts as
    online."""
    ahead_any = 0
    ahead_for: Counter[str] = Counter()
    found = []
    for row in _in_turn(queue, online):
        wanted = row["wanted_drone"]
        if not row["ready"]:
            found.append(Place(row["turn_id"], row["session_id"], 0, wanted))
            continue
        if wanted is None:
            named = sum(n for drone, n in ahead_for.items() if online is None or drone in online)
            position = ahead_any + named + 1
            ahead_any += 1
        else:
            position = ahead_any + ahead_for[wanted] + 1
            ahead_for[wanted] += 1
        found.append(Place(row["turn_id"], row["session_id"], position, wanted))
    return found


def _in_turn(queue: list[dict[str, Any]], online: Collection[str] | None) -> list[dict[str, Any]]:
    """The queue in the order its turns start, as ``choose`` takes them: a turn waiting for a
    drone that is away takes no place in its person's line (their next turn has it), and
    comes after the rest, as do turns not ready."""

    def away(row: dict[str, Any]) -> bool:
        wanted = row["wanted_drone"]
        return wanted is not None and online is not None and wanted not in online

    ready = [row for row in queue if row["ready"]]
    return [
        *_in_line(row for row in ready if not away(row)),
        *(row for row in ready if away(row)),
        *(row for row in queue if not row["ready"]),
    ]


def _in_line(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ready turns (``QUEUE_ORDER`` rows, in its order) in the order they start: each person's
    first, then each one's second, …; within a rank, who was served longest ago first."""
    ranks: Counter[str] = Counter()
    line = []
    for row in rows:
        ranks[row["owner"]] += 1
        line.append((ranks[row["owner"]], row["served_at"], row["created_at"], row["turn_id"], row))
    line.sort(key=lambda entry: entry[:4])
    return [entry[-1] for entry in line]


async def queue_order(db: Database) -> list[dict[str, Any]]:
    """Every queued turn in the order they start (``QUEUE_ORDER`` rows)."""
    return await db.fetch(QUEUE_ORDER)


async def where_queued(db: Database, live: LiveState) -> list[Place]:
    """Every queued turn's place in line now. A drone with no free slot counts as away, as in
    ``choose``: a turn waiting for it takes no place in its person's line."""
    order = await queue_order(db)
    try:
        routes = await live.drones()
    except Exception:  # Redis cannot say now: every drone named counts
        return places(order, None)
    running = {row["drone_id"]: row["running"] for row in await db.fetch(RUNNING_PER_DRONE)}
    return places(order, {r.drone_id for r in routes if running.get(r.drone_id, 0) < r.concurrency})


async def waiting_for(db: Database, drone_id: str) -> list[str]:
    """The queued turns sent to ``drone_id`` by name."""
    rows = await db.fetch(
        "SELECT turn_id FROM turns WHERE status = 'queued' AND wanted_drone = ?", drone_id
    )
    return [row["turn_id"] for row in rows]


async def queued_count(db: Database, owner: str) -> int:
    rows = await db.fetch(
        "SELECT count(*) AS queued FROM turns WHERE owner = ? AND status = 'queued'", owner
    )
    return int(rows[0]["queued"])


async def dated_after(db: Database, session_id: str, at: float) -> float:
    """A new turn's date in its session: ``at`` (this relay's clock), or just after the
    session's latest turn if that is dated later (another relay's clock running ahead): its
    turns run, and its history grows, in the order they were taken."""
    rows = await db.fetch(
        "SELECT max(created_at) AS last FROM turns WHERE session_id = ?", session_id
    )
    last = rows[0]["last"]
    return at if last is None or last < at else float(last) + 0.001


async def interrupt_place(db: Database, session_id: str, turn: TurnRecord) -> float:
    """Where an interrupting turn goes in its session (its ``created_at``): next, a millisecond
    before the follow-ups queued there (between them and the last turn that started, if closer),
    after every turn that started or ended; a session's turns run, and its history grows, in
    that order."""
    rows = await db.fetch(
        "SELECT min(created_at) AS first FROM turns WHERE session_id = ? AND status = 'queued'",
        session_id,
    )
    first = rows[0]["first"]
    if first is None or first >= turn.created_at:
        return turn.created_at
    rows = await db.fetch(
        "SELECT max(created_at) AS last FROM turns"
        " WHERE session_id = ? AND status <> 'queued' AND created_at < ?",
        session_id,
        first,
    )
    last = rows[0]["last"]
    place = first - 0.001 if last is None or last < first - 0.001 else (last + first) / 2
    return place if (last is None or last < place) and place < first else turn.created_at


async def interrupt_placed(db: Database, turn: TurnRecord) -> None:
    """After an interrupting turn was stored: if a follow-up it was dated before started
    meanwhile (its place was chosen a moment before), it goes after everything instead, as
    any prompt (the interrupt then stops that follow-up); its session's activity is now."""
    now = time.time()
    started = await db.fetch(
        "SELECT turn_id FROM turns WHERE session_id = ? AND started_at IS NOT NULL"
        " AND created_at > ?",
        turn.session_id,
        turn.created_at,
    )
    if started:
        turn.created_at = await dated_after(db, turn.session_id, now)
        await db.execute(
            "UPDATE turns SET created_at = ? WHERE turn_id = ? AND status = 'queued'",
            turn.created_at,
            turn.turn_id,
        )
    await db.execute(
        "UPDATE sessions SET last_activity = ? WHERE session_id = ? AND last_activity < ?",
        now,
        turn.session_id,
        now,
    )


async def request_abort(db: Database, turn_id: str, by: str) -> None:
    """Keep that ``by`` asked to abort the turn (its ending names them; a drone heard from later
    is still told)."""
    await db.execute(
        "UPDATE turns SET abort_requested_by = ?"
        " WHERE turn_id = ? AND status IN ('queued', 'processing')",
        by,
        turn_id,
    )


UNACCEPTED = """
    SELECT * FROM turns WHERE status = 'processing' AND accepted_at IS NULL AND started_at < ?
"""
"""Turns claimed longer ago than a sending takes whose drone was never seen to take them: their
relay died between the claim and the order's sending, say (an index holds just these)."""


async def accepted(db: Database, drone_id: str, turn_ids: list[str]) -> None:
    """Note that ``drone_id`` took the turns' orders (while they are processing on it)."""
    for turn_id in turn_ids:
        await db.execute(
            "UPDATE turns SET accepted_at = ? WHERE turn_id = ? AND drone_id = ?"
            " AND status = 'processing' AND accepted_at IS NULL",
            time.time(),
            turn_id,
            drone_id,
        )


async def requeue(db: Database, turn_id: str) -> bool:
    """Put a claimed turn back in line (its drone would not take it); not one whose abort was
    asked, which is to end aborted instead."""
    changed = await db.execute(
        "UPDATE turns SET status = 'queued', drone_id = NULL, started_at = NULL,"
        " accepted_at = NULL"
        " WHERE turn_id = ? AND status = 'processing' AND abort_requested_by IS NULL",
        turn_id,
    )
    return changed == 1


async def running_counts(db: Database) -> dict[str, int]:
    """How many turns each drone runs, by the store."""
    return {row["drone_id"]: int(row["running"]) for row in await db.fetch(RUNNING_PER_DRONE)}


async def queued_per_session(db: Database, owner: str | None) -> dict[str, int]:
    """How many turns wait in each of the owner's sessions (everyone's for None)."""
    rows = await db.fetch(
        "SELECT session_id, count(*) AS waiting FROM turns WHERE status = 'queued'"
        " AND (CAST(? AS TEXT) IS NULL OR owner = ?) GROUP BY session_id",
        owner,
        owner,
    )
    return {row["session_id"]: int(row["waiting"]) for row in rows}
