"""A session's snapshot (``openSession``) within what any client can read: a page holds the
session's latest turns up to ``SNAPSHOT_BYTES`` of JSON, not only up to its count, and a turn too
large for a page by itself has its long strings cut, saying how much was left out (the store
keeps it all; docs/protocol.md, ``openSession``).

A default python-socketio client reads at most 4 MiB a message; a session of large answers made
snapshots of tens of MB (each answer is in a turn's ``text`` and in its messages), which such a
client never got, and which the relay built whole for every browser that opened the session.
"""

from __future__ import annotations

import json
from typing import Any

from hangar.shared.protocol import cut

SNAPSHOT_BYTES = 3_000_000
"""The most a snapshot's turns take as JSON (the rest of the answer is a few hundred bytes)."""
SHOWN_MESSAGE_CHARS = 20_000
"""The most of a message's text, and of each of its calls' arguments, browsers get in its
``message`` event, and in a turn too large for a snapshot page: the page shows neither (the text
streamed, the calls have ``tool`` events), and the store keeps them whole."""
SHORT_CHARS = 500
"""What is kept of each message's strings in a turn still too large with them cut as above."""
ENDED = ("finished", "aborted", "error")


def json_size(value: Any) -> int:
    """Bytes ``value`` takes in a socket.io packet (compact JSON, non-ASCII escaped)."""
    return len(json.dumps(value, separators=(",", ":")))


def shown(message: dict[str, Any], limit: int = SHOWN_MESSAGE_CHARS) -> dict[str, Any]:
    """A message as browsers get it: its content and each call's arguments cut, saying so."""
    message = {**message, "content": cut(message.get("content", ""), limit)}
    if message.get("toolCalls"):
        message["toolCalls"] = [
            {**call, "arguments": cut(call["arguments"], limit)} for call in message["toolCalls"]
        ]
    return message


class Page:
    """The turns of a snapshot page, added newest first while they fit."""

    def __init__(self, budget: int = SNAPSHOT_BYTES) -> None:
        self.budget = budget
        self.used = 0
        self.turns: list[dict[str, Any]] = []
        """Newest first."""

    def add(self, turn: dict[str, Any]) -> bool:
        """Add a turn's view (wire form) if it fits; the first always goes in, cut to fit if
        it must, and so does a running turn (a page without it would show its session idle).
        False once the page is full."""
        size = json_size(turn)
        if self.used + size > self.budget:
            if self.turns and turn.get("status") != "processing":
                return False
            turn = fitted(turn, max(self.budget - self.used, 0))
            size = json_size(turn)
        self.turns.append(turn)
        self.used += size
        return True


def fitted(turn: dict[str, Any], budget: int) -> dict[str, Any]:
    """A turn's view cut to ``budget`` bytes where it can be: its messages' long strings (to
    their first 20,000 characters, or to a few hundred if that is not enough), then an ended
    turn's text (a running turn's text stays whole: later deltas build on it)."""
    messages = turn.get("messages", [])
    turn = {**turn, "messages": [shown(m) for m in messages]}
    text = turn.get("text", "")
    rest = json_size({**turn, "text": ""})
    if rest > budget // 2:  # hundreds of tool calls: what fits of the answer comes first
        turn["messages"] = [shown(m, SHORT_CHARS) for m in messages]
        rest = json_size({**turn, "text": ""})
    if turn.get("status") in ENDED and text and rest + json_size(text) > budget:
        keep = len(text)
        for _ in range(8):  # the share of the text that fits, shrunk until it does
            if rest + json_size(cut(text, keep)) <= budget or keep == 0:
                break
            keep = max(0, min(keep - 1, keep * (budget - rest) // json_size(text[:keep]) - 64))
        turn["text"] = cut(text, keep, "\n\n")
    return turn
