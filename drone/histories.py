"""The histories of recent work orders, so the relay can send a session's next order only what
this drone lacks (``WorkOrder.history_base``, ``history_from``; docs/protocol.md).

Bounded by sessions and by characters: the least recently used are forgotten first, and an
order whose base was forgotten is answered ``HISTORY_MISS`` (the relay then sends it whole).

The drone's process keeps one, to answer the relay; each worker process keeps one too, for the
sessions whose orders it ran, so the drone sends a worker only what it lacks as well (``pool``).
"""

from __future__ import annotations

import itertools
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


MERGED_RUNS = 1024
"""Merged user messages remembered (``alternating``)."""
_merged: OrderedDict[tuple[int, ...], tuple[list[ChatMessage], ChatMessage]] = OrderedDict()


def alternating(messages: list[ChatMessage]) -> list[ChatMessage]:
    """``messages`` with each run of user messages in a row made one, their texts a blank line
    apart (a text the same as the one before it once: a prompt sent again by Retry), so that
    roles alternate as strict chat templates require (Mistral's and Gemma's, on vLLM or
    llama.cpp, refuse a conversation that does not).

    A turn that ended before the model said anything (aborted, or failed, before its first
    token) keeps only its user message (docs/architecture.md), so the next turn's prompt follows
    it. A merged run is the same object from one work order of a session to the next, so the
    request's JSON is still encoded only from what changed (``providers.message_json``).
    """
    result: list[ChatMessage] = []
    for user, group in itertools.groupby(messages, key=lambda message: message.role == "user"):
        run = list(group)
        result += [_merge(run)] if user and len(run) > 1 else run
    return result


def _merge(run: list[ChatMessage]) -> ChatMessage:
    key = tuple(id(message) for message in run)
    found = _merged.get(key)
    if found is None:
        texts = [run[0].content]
        for message in run[1:]:
            if message.content != texts[-1]:  # a prompt sent again by Retry: once is enough
                texts.append(message.content)
        text = "\n\n".join(texts)
        found = (run, ChatMessage.model_construct(role="user", content=text))
    _merged[key] = found  # kept with its run, so that no other message takes one of its ids
    _merged.move_to_end(key)
    while len(_merged) > MERGED_RUNS:
        _merged.popitem(last=False)
    return found[1]
