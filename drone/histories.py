"""The histories of recent work orders, so the relay can send a session's next order only what
this drone lacks (``WorkOrder.history_base``, ``history_from``; docs/protocol.md).

Bounded by sessions and by characters: the least recently used are forgotten first, and an
order whose base was forgotten is answered ``HISTORY_MISS`` (the relay then sends it whole).

The drone's process keeps one, to answer the relay; each worker process keeps one too, for the
sessions whose orders it ran, so the drone sends a worker only what it lacks as well (``pool``).
"""

from __future__ import annotations

from collections import OrderedDict

from hangar.shared.protocol import ChatMessage, WorkOrder

MAX_SESSIONS = 256
MAX_CHARS = 32_000_000
"""Characters of message content and tool calls' arguments kept in all (about that many bytes,
and some more)."""


class HistoryKeeper:
    def __init__(self, max_sessions: int = MAX_SESSIONS, max_chars: int = MAX_CHARS) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self._kept: OrderedDict[str, tuple[str, list[ChatMessage], int]] = OrderedDict()
        """session -> (the turn whose order it was, that order's whole history, its size)."""
        self._chars = 0

    def complete(self, order: WorkOrder) -> WorkOrder | None:
        """``order`` with its whole history, or None if it builds on a history not kept here."""
        if order.history_base is None:
            return order
        kept = self._kept.get(order.session_id)
        if kept is None or kept[0] != order.history_base or len(kept[1]) < order.history_from:
            return None
        whole = [*kept[1][: order.history_from], *order.history]
        return order.model_copy(update={"history": whole, "history_base": None, "history_from": 0})

    def keep(self, order: WorkOrder) -> None:
        """Remember the history of an order this drone took (``order`` made whole)."""
        previous = self._kept.pop(order.session_id, None)
        if previous is not None:
            self._chars -= previous[2]
        size = sum(message.chars() for message in order.history)
        self._kept[order.session_id] = (order.turn_id, order.history, size)
        self._chars += size
        while self._kept and (len(self._kept) > self.max_sessions or self._chars > self.max_chars):
            _, (_, _, dropped) = self._kept.popitem(last=False)
            self._chars -= dropped

    def forget(self, session_id: str) -> None:
        """Drop a session's history (another process of the drone keeps it now)."""
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            self._chars -= kept[2]
