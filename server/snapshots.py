"""A session's snapshot (``openSession``) within what any client can read: a page holds the
session's latest turns up to ``SNAPSHOT_BYTES`` of JSON, not only up to its count, and a turn too
large for a page by itself has its long strings cut, saying how much was left out (the store
keeps it all; docs/protocol.md, ``openSession``).

A default python-socketio client reads at most 4 MiB a message; a session of large answers made
snapshots of tens of MB (each answer is in a turn's ``text`` and in its messages), which such a
client never got, and which the relay built whole for every browser that opened the session.
A running turn's calls waiting for approval and its sub-agents' output are cut to fit as well
(500,000 emoji from a sub-agent took 6 MB, four waiting calls of 600,000 "é" 14 MB); only its
text is not.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
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
MARK_BYTES = 64
"""The most a cut's note takes as JSON (``"\\n\\n[… N more characters not shown]\\n\\n"``)."""
ENDED = ("finished", "aborted", "error")


def json_size(value: Any) -> int:
    """Bytes ``value`` takes in a socket.io packet (compact JSON, non-ASCII escaped)."""
    return len(json.dumps(value, separators=(",", ":")))


def string_size(text: str) -> int:
    """``json_size`` of a string, faster."""
    return len(encode_basestring_ascii(text))


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

    def add(self, turn: dict[str, Any], ahead: bool = False) -> bool:
        """Add a turn's view (wire form) if it fits; the first always goes in, cut to fit if
        it must, and so does a running turn (a page without it would show its session idle),
        and a turn ``ahead`` of it (queued after it: its prompt cut to ``SHORT_CHARS``, so
        that the running turn still finds room). False once the page is full."""
        size = json_size(turn)
        if self.used + size > self.budget:
            if self.turns and not ahead and turn.get("status") != "processing":
                return False
            if ahead and turn.get("status") != "processing":
                turn = {**turn, "prompt": cut(turn.get("prompt", ""), SHORT_CHARS)}
            turn = fitted(turn, max(self.budget - self.used, 0))
            size = json_size(turn)
        self.turns.append(turn)
        self.used += size
        return True


def fitted(turn: dict[str, Any], budget: int) -> dict[str, Any]:
    """A turn's view cut to ``budget`` bytes where it can be: its messages' long strings (to
    their first 20,000 characters, or to a few hundred if that is not enough), then an ended
    turn's text, or a running turn's calls waiting for approval and its sub-agents' output,
    the largest parts first (a running turn's text stays whole: later deltas build on it)."""
    messages = turn.get("messages", [])
    turn = {**turn, "messages": [shown(m) for m in messages]}
    text, waiting = turn.get("text", ""), turn.get("waiting", [])
    running = turn.get("status") == "processing"
    live = {"text": "", "waiting": [], "subAgents": []}
    rest = json_size({**turn, **live})
    # Hundreds of tool calls: what fits of the answer, and of the calls waiting, comes first.
    if rest > budget // 2 or (running and rest + json_size(text) + json_size(waiting) > budget):
        turn["messages"] = [shown(m, SHORT_CHARS) for m in messages]
        rest = json_size({**turn, **live})
    if running:
        room = budget - rest + 6 - json_size(text)  # for the calls waiting and the sub-agents
        turn["waiting"] = fitted_calls(waiting, room - 2)
        turn["subAgents"] = fitted_runs(
            turn.get("subAgents", []), room - json_size(turn["waiting"])
        )
    elif turn.get("status") in ENDED and text and rest + json_size(text) > budget:
        keep = len(text)
        for _ in range(8):  # the share of the text that fits, shrunk until it does
            if rest + json_size(cut(text, keep)) <= budget or keep == 0:
                break
            keep = max(0, min(keep - 1, keep * (budget - rest) // json_size(text[:keep]) - 64))
        turn["text"] = cut(text, keep, "\n\n")
    return turn


def fitted_calls(calls: list[dict[str, Any]], room: int) -> list[dict[str, Any]]:
    """Calls waiting for approval in ``room`` bytes: the longest arguments cut first, each
    saying how much was left out (the page then offers only to decline the call: it cannot
    show it whole). The live state keeps them whole, and answers reach the drone as ever."""
    if json_size(calls) <= room:
        return calls
    sizes = [string_size(call["arguments"]) if call.get("arguments") else 0 for call in calls]
    most = share(sizes, room - json_size(calls) + sum(sizes))
    return [
        {**call, "arguments": within(call["arguments"], most)} if size > most else call
        for call, size in zip(calls, sizes, strict=True)
    ]


def fitted_runs(runs: list[dict[str, Any]], room: int) -> list[dict[str, Any]]:
    """Sub-agents' output (``sub_agents.runs``) in ``room`` bytes: its longest texts, arguments
    and results cut first, each saying how much was left out; the last parts left out if they
    do not fit even so (thousands of tool calls), a text part saying how many; none if not
    even that fits."""
    size = json_size(runs)
    if size <= room:
        return runs
    total = keep = sum(len(run["parts"]) for run in runs)
    for _ in range(16):  # fewer parts until they fit: a few rounds, each shrinks to the share
        if keep <= 0:
            break
        if keep == total:
            kept, size = cut_strings(runs, size, room)
        else:
            kept = first_parts(runs, keep)
            note = f"[… {total - keep} more parts not shown]"
            kept, size = cut_strings(kept, json_size(kept), room - json_size(note) - MARK_BYTES)
            size += noted(kept, note)
        if size <= room:
            return kept
        keep = min(keep - 1, keep * (room - 2 * MARK_BYTES) // size)  # room for the note
    return []


def first_parts(runs: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """The runs with their first ``keep`` parts only."""
    kept: list[dict[str, Any]] = []
    for run in runs:
        if keep <= 0:
            break
        kept.append({**run, "parts": run["parts"][:keep]})
        keep -= len(kept[-1]["parts"])
    return kept


def noted(runs: list[dict[str, Any]], note: str) -> int:
    """Say at the end of the runs (a list of their own) that parts were left out; returns the
    bytes that adds."""
    run = runs[-1]
    *parts, last = run["parts"]
    if "text" in last:
        grown = {**last, "text": f"{last['text']}\n\n{note}\n\n"}
        runs[-1] = {**run, "parts": [*parts, grown]}
        return string_size(grown["text"]) - string_size(last["text"])
    added = {"text": note + "\n\n", "depth": last["tool"].get("depth", 1)}
    runs[-1] = {**run, "parts": [*parts, last, added]}
    return json_size(added) + 1


def cut_strings(
    runs: list[dict[str, Any]], size: int, room: int
) -> tuple[list[dict[str, Any]], int]:
    """The runs (of ``size`` bytes) with their longest strings cut for them to take ``room``
    bytes, and the bytes they take then: a text's note on lines of its own (later text goes on
    after it), a call's at its end. Only the parts cut are copied."""
    found = [
        (part, key, string_size(value))
        for run in runs
        for part in run["parts"]
        for key, value in strings_of(part)
    ]
    most = share([length for *_, length in found], room - size + sum(f[2] for f in found))
    copies: dict[int, dict[str, Any]] = {}
    for part, key, length in found:
        if length <= most:
            continue
        if id(part) not in copies:
            copies[id(part)] = {**part, "tool": {**part["tool"]}} if "tool" in part else {**part}
        copy = copies[id(part)]
        holder, around = (copy, "\n\n") if key == "text" else (copy["tool"], "")
        holder[key] = within(holder[key], most, around, around)
        size += string_size(holder[key]) - length
    if not copies:
        return runs, size
    return [{**run, "parts": [copies.get(id(p), p) for p in run["parts"]]} for run in runs], size


def strings_of(part: dict[str, Any]) -> list[tuple[str, str]]:
    """A part's strings that may be cut, by key: a text's, or a call's arguments and result."""
    if "text" in part:
        return [("text", part["text"])]
    call = part["tool"]
    return [(key, call[key]) for key in ("arguments", "result") if isinstance(call.get(key), str)]


def share(sizes: list[int], total: int) -> int:
    """The most each of ``sizes`` may keep for them to take ``total`` at most together: the
    largest are cut first, all to the same size."""
    left, count = total, len(sizes)
    for size in sorted(sizes):
        if size * count > left:
            return max(left // count, 0)
        left, count = left - size, count - 1
    return max(sizes, default=0)


def within(text: str, size: int, between: str = "", after: str = "") -> str:
    """``text`` whole if it takes at most ``size`` bytes as JSON, else the head of it that does
    with how much was left out (``cut``), about the longest; the note alone if none fits."""
    if string_size(text) <= size:
        return text
    # A character takes 1 to 12 bytes escaped (an emoji, a surrogate pair): a head of
    # ``fits`` characters does with its note, one longer than ``over`` does not.
    fits, over = max(0, (size - MARK_BYTES) // 12), min(len(text), size)
    while over - fits > max(16, over // 128):
        middle = (fits + over) // 2
        if string_size(cut(text, middle, between) + after) <= size:
            fits = middle
        else:
            over = middle
    return cut(text, fits, between) + after
