"""Each session's history sent to a drone once: later work orders carry only what it lacks.

A drone that keeps histories (``DroneRecord.history_cache``) remembers the history of each work
order it ran. The relay remembers, for each drone and session, the last order it sent and how
long that order's history was; the session's next order to that drone carries only the messages
of the turns since (``history_base``, ``history_from``). A session's history only grows, turn
by turn, and a turn's messages are final once it has ended, so that prefix is what the drone
has. A drone that lost it (it restarted) answers ``HISTORY_MISS`` and gets the whole history.
Another relay, or a relay that restarted, knows nothing yet and sends the whole history once.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from hangar.shared.protocol import ChatMessage, WorkOrder
from hangar.shared.wire import MAX_ORDER_BYTES

from .snapshots import json_size
from .store import Database, TurnRecord, TurnStore

REMEMBERED = 10_000
"""Drone-and-session pairs a relay remembers at most (the oldest are forgotten)."""

TURNS_SINCE = """
    SELECT turn_id FROM turns WHERE session_id = ? AND (
        created_at > (SELECT created_at FROM turns WHERE turn_id = ?)
        OR (created_at = (SELECT created_at FROM turns WHERE turn_id = ?) AND turn_id >= ?)
    ) AND status <> 'queued' AND NOT (status = 'aborted' AND started_at IS NULL
        AND (SELECT count(*) FROM messages WHERE messages.turn_id = turns.turn_id) <= 1)
    ORDER BY created_at, turn_id
"""
"""A session's turns from a base turn on, but those still queued or cancelled before they
started (``withdrawn``)."""


class Histories:
    def __init__(self, store: TurnStore) -> None:
        self.store = store
        self.sent: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()
        """(drone, session) -> (the last order's turn, the length of its history)."""

    async def order(
        self, turn: TurnRecord, drone_id: str, cached: bool, approved: list[str]
    ) -> WorkOrder:
        """The work order of ``turn`` for ``drone_id``: the history's end only when the drone
        keeps histories (``cached``) and this relay sent it the session's last order."""
        order = WorkOrder(
            turn_id=turn.turn_id,
            session_id=turn.session_id,
            prompt=turn.prompt,
            approved_tools=approved,
        )
        known = self.sent.get((drone_id, turn.session_id)) if cached else None
        if known is not None:
            base, length = known
            order.history_base, order.history_from = base, length
            order.history = await history_since(self.store, turn.session_id, base, turn)
        else:
            order.history = await session_history(self.store, turn.session_id, before=turn)
        return order

    def accepted(self, drone_id: str, order: WorkOrder) -> None:
        """The drone took ``order``: it now holds its history."""
        key = (drone_id, order.session_id)
        self.sent[key] = (order.turn_id, order.history_from + len(order.history))
        self.sent.move_to_end(key)
        while len(self.sent) > REMEMBERED:
            self.sent.popitem(last=False)

    def forget(self, drone_id: str, session_id: str) -> None:
        """The drone does not have the session's history (it answered ``HISTORY_MISS``)."""
        self.sent.pop((drone_id, session_id), None)


async def history_since(
    db: Database, session_id: str, base: str, before: TurnRecord
) -> list[ChatMessage]:
    """The messages of the session's turns from ``base`` (included) up to ``before``
    (excluded), in order: O(those turns), whatever the session's length."""
    rows = await db.fetch(TURNS_SINCE, session_id, base, base, base)
    turn_ids = [row["turn_id"] for row in rows]
    if before.turn_id in turn_ids:
        turn_ids = turn_ids[: turn_ids.index(before.turn_id)]
    if not turn_ids:
        return []
    marks = ", ".join("?" for _ in turn_ids)
    found = await db.fetch(
        f"SELECT turn_id, body FROM messages WHERE turn_id IN ({marks}) ORDER BY message_id",
        *turn_ids,
    )
    by_turn: dict[str, list[ChatMessage]] = {turn_id: [] for turn_id in turn_ids}
    for row in found:
        body = row["body"]
        by_turn[row["turn_id"]].append(
            ChatMessage.model_validate(json.loads(body) if isinstance(body, str) else body)
        )
    return [message for turn_id in turn_ids for message in by_turn[turn_id]]


def could_be_too_large(order: WorkOrder) -> bool:
    """Whether ``order`` might be larger as JSON than a drone takes: a bound from its length
    (twelve bytes a character at most, for one outside the BMP escaped as two)."""
    chars = len(order.prompt) + sum(message.chars() for message in order.history)
    return 12 * chars + 64 * len(order.history) >= MAX_ORDER_BYTES


def too_large(order: WorkOrder) -> str | None:
    """Why ``order`` cannot go to a drone (larger as JSON than a drone takes), or None; made
    only for an order that ``could_be_too_large`` (hundreds of MB to encode: off the loop)."""
    size = json_size(order.wire()) + len('42/drone,["workOrder",]')
    if size <= MAX_ORDER_BYTES:
        return None
    return (
        f"This session's history is too large to send to a drone ({size / 1e6:.1f} MB; a work "
        f"order may take at most {MAX_ORDER_BYTES / 1e6:.1f} MB). Start a new session."
    )


async def session_history(
    store: TurnStore, session_id: str, before: TurnRecord | None = None
) -> list[ChatMessage]:
    """The conversation so far, as the provider will see it: every turn's messages in order
    (only the turns before ``before``, when given), but those of turns that have not run: still
    queued (an interrupt stored dated before ``before`` as it started), or ``withdrawn``."""
    history: list[ChatMessage] = []
    for turn in await store.list_turns(session_id):
        if before is not None and turn.turn_id == before.turn_id:
            break
        if turn.status != "queued" and not withdrawn(turn):
            history.extend(turn.messages)
    return history


def withdrawn(turn: TurnRecord) -> bool:
    """Cancelled before it started: its prompt, withdrawn, is no part of the conversation."""
    return turn.status == "aborted" and turn.started_at is None and len(turn.messages) <= 1
