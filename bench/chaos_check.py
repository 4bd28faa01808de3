"""The chaos benchmark's verdict: what the store, the model service and the browsers say about
every turn once the run has settled, as Markdown tables whose rows state their conditions."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.store import TurnRecord
from hangar.shared.protocol import ChatMessage

from .chaos_peer import PROMPT, full_text
from .chaos_people import TERMINAL, Person
from .common import table
from .peers.openai_peer import validate_messages

SLOW = 30.0
"""Seconds processing past which a turn is reported: the longest reply (about 8 s) plus the
longest fault (12 s) plus the abort grace (10 s)."""


@dataclass
class Order:
    number: int
    marker: str
    kind: str
    person: Person
    plan: str
    """When it is to be aborted: none, early, stream, tool, after (the end)."""
    session_id: str | None = None
    mode: str = "queue"
    turn_id: str = ""
    submitted: float = 0.0
    abort_at: float | None = None
    abort_stage: str = ""
    ack_seconds: float = 0.0
    ack: Any = None
    abort_tries: int = 0


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    until: float = 0.0


@dataclass
class Verdict:
    text: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """One line per failed turn or session, with its id: the evidence to look up in the logs."""


def _wire(message: ChatMessage) -> dict[str, Any]:
    calls = [{"id": c.id} for c in message.tool_calls or []]
    return {"role": message.role, "tool_call_id": message.tool_call_id, "tool_calls": calls}


def _text_lost(turn: TurnRecord) -> bool:
    found = PROMPT.match(turn.prompt)
    if found is None:
        return False
    expected = full_text(found.group(1), found.group(2))
    said = "".join(m.content for m in turn.messages if m.role == "assistant")
    if turn.status == "finished":
        return turn.text != expected or said != expected
    return not expected.startswith(turn.text) or not expected.startswith(said)


def _requeued(logs: Sequence[Path]) -> set[str]:
    found: set[str] = set()
    for log in logs:
        found |= set(re.findall(r"back in line turn=(\S+)", log.read_text(errors="replace")))
    return found


def log_trouble(logs: Sequence[Path]) -> list[str]:
    """Each process's tracebacks and ERROR lines (counted; the first of each shown)."""
    rows = []
    for log in sorted(logs):
        text = log.read_text(errors="replace")
        errors = [line for line in text.splitlines() if " ERROR " in line]
        tracebacks = text.count("Traceback (most recent call last)")
        if errors or tracebacks:
            first = errors[0][:200] if errors else ""
            rows.append(f"- `{log.name}`: {len(errors)} ERROR lines, {tracebacks} tracebacks; "
                        f"first: `{first}`")  # fmt: skip
    return rows


async def verdict(
    store: PostgresTurnStore,
    orders: Sequence[Order],
    follow_ups: Sequence[Order],
    faults: Sequence[Fault],
    requests: list[dict[str, Any]],
    logs: Sequence[Path],
    settle: float,
    t0: float,
) -> Verdict:
    out = Verdict()

    def about(turn: TurnRecord) -> str:
        when = [f"{x - t0:.1f}" if x else "-" for x in (turn.started_at, turn.ended_at)]
        return (f"{turn.turn_id} {turn.status}/{turn.reason} drone={turn.drone_id} "
                f"started {when[0]} s ended {when[1]} s into the run")  # fmt: skip

    sessions = [r["session_id"] for r in await store.fetch("SELECT DISTINCT session_id FROM turns")]
    turns: dict[str, TurnRecord] = {}
    invalid_sessions, settled = [], 0
    for session_id in sessions:
        listed = await store.list_turns(session_id)
        turns.update((t.turn_id, t) for t in listed)
        if any(t.status not in TERMINAL for t in listed):
            continue  # a running turn's tool call has no result yet: see stuck
        settled += 1
        history = [_wire(m) for t in listed for m in t.messages]
        if validate_messages(history) is not None:
            invalid_sessions.append(session_id)
            out.failures.append(f"invalid stored history: session {session_id}")
    acked = [o for o in orders if o.turn_id]
    mine = {o.turn_id for o in [*acked, *follow_ups]}
    stray = [t for t in turns.values() if t.turn_id not in mine]

    once = away = untold = twice = disagree = 0
    for order in acked:
        turn, seen = turns.get(order.turn_id), order.person.turns[order.turn_id]
        status = turn.status if turn else "missing"
        told = len(seen.completions)
        if status in TERMINAL and told == 1:
            once += 1
            if seen.completions[0][1] != (status != "error"):
                disagree += 1
                out.failures.append(f"completion disagrees with store: {order.turn_id} {status}")
        elif status in TERMINAL and told == 0 and seen.from_snapshot == status:
            away += 1
        elif told > 1:
            twice += 1
            out.failures.append(f"told {told} times: {order.turn_id} {seen.completions}")
        elif status in TERMINAL:
            untold += 1
            reason = turn.reason if turn else None
            out.failures.append(f"browser never told: {order.turn_id} ({status}, {reason})")
    stuck = [t for t in turns.values() if t.status not in TERMINAL]
    out.failures += [f"stuck: {about(t)}" for t in stuck]
    slow = [
        t for t in turns.values() if t.started_at and (t.ended_at or 1e20) - t.started_at > SLOW
    ]
    out.failures += [f"processing over {SLOW:.0f} s: {about(t)}" for t in slow]
    lost = [t for t in turns.values() if t.status in TERMINAL and _text_lost(t)]
    out.failures += [f"lost text: {about(t)}" for t in lost]

    # A prompt sent again after a lost ack is a second turn with the same marker: each turn may
    # reach the model once per round.
    calls: Counter[tuple[str, int]] = Counter((r["marker"], r["round"]) for r in requests)
    marker_of = {t.turn_id: m.group(1) for t in turns.values() if (m := PROMPT.match(t.prompt))}
    per_marker = Counter(marker_of.values())
    requeued = _requeued(logs)
    twice_called = {marker for (marker, _), n in calls.items() if n > per_marker[marker]}
    doubled = [t for t, m in marker_of.items() if m in twice_called and t not in requeued]
    out.failures += [f"doubled run: {t} ({marker_of[t]})" for t in doubled]
    refused = [r for r in requests if r["rejected"]]
    out.failures += [f"model refused {r['marker']} round {r['round']}: {r['rejected'][:120]}"
                     for r in refused]  # fmt: skip
    refused_markers = {r["marker"] for r in refused}
    follow_refused = [f for f in follow_ups if f.marker in refused_markers]
    follow_bad = [f for f in follow_ups if turns.get(f.turn_id) is None
                  or turns[f.turn_id].status != "finished"]  # fmt: skip
    out.failures += [f"follow-up did not finish: {f.turn_id or f.marker} in {f.session_id} "
                     f"({(t := turns.get(f.turn_id)) and (t.status, t.reason, t.result)})"
                     for f in follow_bad]  # fmt: skip

    n = len(acked)
    rows: list[list[object]] = [
        ["work orders submitted and acknowledged (`{ok: true, turnId}`)", n],
        ["submits never answered within 30 s of tries (the turn may exist: see stray)",
         len(orders) - n],
        ["stray turns: in the store, but no browser got their id (a submit that landed, none "
         "of whose tries got an answer; a try sent again gets the first one's turn)", len(stray)],
        ["**ended exactly once**: terminal in the store, one `workOrderComplete` to the submitting "
         "browser", f"{once} / {n}"],
        ["ended while the browser was away (its relay died) or while Redis could not carry the "
         "ending (the browser was told to `resync`): terminal in the store and in the session "
         "the browser opened again, no `workOrderComplete`", away],
        ["ended, but the browser was never told (it stayed connected, or reopened before the end)",
         untold],
        ["`workOrderComplete` sent to the browser more than once", twice],
        ["`workOrderComplete` success disagrees with the stored status", disagree],
        [f"**stuck**: queued or processing in the store {settle:.0f} s after the last submit and "
         "fault (every turn, strays and follow-ups included)", len(stuck)],
        [f"processing for over {SLOW:.0f} s (the longest reply takes about 8 s; a fault may add "
         "its own length)", len(slow)],
        ["**lost text**: finished, stored text (and assistant messages) not the model's full "
         "reply; or aborted/error, not a prefix of it", f"{len(lost)} / {len(turns)}"],
        ["**invalid history**: a session's stored messages have an assistant tool call without "
         "its result (every session whose turns all ended)",
         f"{len(invalid_sessions)} / {settled}"],
        ["**invalid history**: the follow-up sent to each session at the end was refused by the "
         "model service (the OpenAI peer answers 400 to an invalid history, as the real one "
         "does)", f"{len(follow_refused)} / {len(follow_ups)}"],
        ["follow-up did not finish within the wait (queued behind a stuck turn, or failed)",
         f"{len(follow_bad)} / {len(follow_ups)}"],
        ["model requests refused with 400 (invalid history), whole run", len(refused)],
        ["**doubled runs**: a turn whose model call (same round) reached the model twice, "
         "not put back in line", len(doubled)],
    ]  # fmt: skip
    out.text.append(table(["condition", "count"], rows))
    out.text.append(_endings(turns.values()))
    out.text.append(_aborts(acked, turns))
    told_at = {o.turn_id: o.person.turns[o.turn_id].completions[0][0]
               for o in acked if o.person.turns[o.turn_id].completions}  # fmt: skip
    if faults:
        out.text.append(_faults(faults, turns.values(), t0, told_at))
    return out


def _endings(turns: Any) -> str:
    counted = Counter((t.status, t.reason) for t in turns)
    rows = [[s, r, n] for (s, r), n in sorted(counted.items(), key=lambda x: (str(x[0]), -x[1]))]
    return table(["status", "reason", "turns"], rows)


def _aborts(orders: Sequence[Order], turns: dict[str, TurnRecord]) -> str:
    """Per stage the browser saw when it aborted: the acks, and when the turn ended."""
    by: dict[str, list[Order]] = defaultdict(list)
    for order in orders:
        if order.abort_at is not None:
            by[order.abort_stage].append(order)
    rows = []
    for stage, group in sorted(by.items()):
        ended = [turns[o.turn_id] for o in group if o.turn_id in turns]
        statuses = Counter(t.status for t in ended)
        acks = Counter(str(tuple(o.ack)) if isinstance(o.ack, list) else str(o.ack) for o in group)
        to_end = [t.ended_at - o.abort_at for o, t in zip(group, ended, strict=False)
                  if t.ended_at and o.abort_at and t.ended_at > o.abort_at]  # fmt: skip
        rows.append([
            stage, len(group), "; ".join(f"{a} ×{k}" for a, k in acks.most_common()),
            f"{max(o.ack_seconds for o in group):.2f}",
            sum(1 for o in group if o.abort_tries > 1),
            ", ".join(f"{s} {k}" for s, k in statuses.most_common()),
            f"{max(to_end):.2f}" if to_end else "n/a",
        ])  # fmt: skip
    headers = ["abort sent when the browser saw the turn", "aborts", "acks", "max s to ack",
               "sent again (no ack in 15 s, or relay away)", "ended",
               "max s abort → stored end"]  # fmt: skip
    return table(headers, rows)


def _faults(faults: Sequence[Fault], turns: Any, t0: float, told_at: dict[str, float]) -> str:
    """Per fault: the turns running when it struck (on the killed drone, for a drone), how
    they ended and how long after the fault the last of them did (its ``workOrderComplete`` at
    the browser; the stored end where the browser missed it)."""
    rows = []
    for fault in faults:
        hit = [t for t in turns if t.started_at and t.started_at < fault.at
               and (t.ended_at or 1e20) > fault.at
               and (fault.kind != "kill -9 drone" or t.drone_id == fault.target)]  # fmt: skip
        ends = [told_at.get(t.turn_id, t.ended_at) - fault.at for t in hit if t.ended_at]
        statuses = Counter(f"{t.status}/{t.reason}" for t in hit)
        rows.append([
            f"{fault.at - t0:.0f}", fault.kind, fault.target, f"{fault.until - fault.at:.1f}",
            len(hit), ", ".join(f"{s} {k}" for s, k in statuses.most_common()) or "-",
            f"{max(ends):.1f}" if ends else "n/a",
        ])  # fmt: skip
    headers = ["s into the run", "fault", "target", "lasted s",
               "turns running then (for a drone: on it)", "how they ended",
               "max s fault → workOrderComplete"]  # fmt: skip
    return table(headers, rows)
