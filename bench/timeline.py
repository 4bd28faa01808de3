"""The steps of an abort and where their ``time.monotonic()`` stamps come from: the browser
(emit, ack, completion), the relay's and drones' log lines (``bench.hangar_mono``) and the
upstream peer (``bench.peer``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .common import Proc, log_times, peer_requests, summary

# Steps of an abort, in order, each measured from the browser's emit.
STEPS = [
    ("relay → drone", "relay sent abortWorkOrder to the drone"),
    ("drone signaled", "drone fired the work order's abort signal (its log)"),
    ("relay ← drone ack", "relay got the drone's answer"),
    ("ack", "browser got (True, 'Abort signaled')"),
    ("drone done", "drone's agent unwound, about to send workOrderComplete"),
    ("relay ended", "relay stored the end, about to emit workOrderComplete"),
    ("complete", "browser got workOrderComplete(turnId, True, 'aborted')"),
    ("upstream closed", "upstream peer saw the HTTP stream closed"),
]
AFTER_DRONE = "upstream closed − drone signaled"
TARGETS = {  # (step, loaded) -> p99 target in ms
    ("ack", False): 3.0,
    ("complete", False): 10.0,
    ("ack", True): 50.0,
    ("complete", True): 50.0,
    (AFTER_DRONE, False): 5.0,
    (AFTER_DRONE, True): 5.0,
}


@dataclass
class Run:
    """One batch of aborts: per step, per turn, the monotonic stamp."""

    label: str
    loaded: bool
    prompts: dict[str, str] = field(default_factory=dict)  # turn id -> prompt
    emitted: dict[str, float] = field(default_factory=dict)
    stamps: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    note: str = ""
    cpu_per_turn: float | None = None  # ms of CPU, every process, per aborted turn

    def stamp(self, step: str, turn_id: str, at: float) -> None:
        self.stamps.setdefault(step, {})[turn_id] = at

    def rows(self, provider: str) -> list[list[str]]:
        series = [(step, self.emitted, self.stamps.get(step, {})) for step, _ in STEPS]
        series.append((AFTER_DRONE, self.stamps.get("drone signaled", {}), series[-1][2]))
        out = []
        for name, start, end in series:
            values = [end[t] - start[t] for t in self.emitted if t in start and t in end]
            target = TARGETS.get((name, self.loaded))
            verdict = ""
            if target is not None and values:
                met = float(summary(values)[1]) <= target
                verdict = f"≤ {target:g}: {'met' if met else '**missed**'}"
            out.append([provider, self.label, name, str(len(values)), *summary(values), verdict])
        return out


async def collect(run: Run, peer: str, relay: Proc, drones: list[Proc]) -> None:
    """The peer's disconnect stamps and the relay's and drones' log stamps of ``run``'s turns."""
    wanted = {prompt: turn for turn, prompt in run.prompts.items()}

    def mine(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r["prompt"] in wanted]

    rows = await peer_requests(peer, lambda rows: all(r["ended"] is not None for r in mine(rows)))
    for row in mine(rows):
        if row["disconnectedAt"] is not None:
            run.stamp("upstream closed", wanted[row["prompt"]], row["disconnectedAt"])
        else:
            run.failures.append(f"{wanted[row['prompt']]}: the peer saw no disconnect")
    text = relay.text()
    for turn, (at, match) in log_times(text, r"abort turn=(\S+) .* in ([\d.]+) ms").items():
        run.stamp("relay ← drone ack", turn, at)
        run.stamp("relay → drone", turn, at - float(match.group(2)) / 1000)
    for turn, (at, _) in log_times(text, r"turn ended turn=(\S+) .*status=aborted").items():
        run.stamp("relay ended", turn, at)
    first, last = min(run.emitted.values(), default=0), max(run.emitted.values(), default=0)
    for what in ("written", "read"):  # logged with HANGAR_BENCH_TRACE_ACKS=1 only
        since = [
            float(m.group(1)) - first
            for proc in [relay, *drones]
            for m in re.finditer(rf"^(\d+\.\d+) .*trace ack {what}", proc.text(), re.M)
            if first <= float(m.group(1)) <= last + 9
        ]
        if since and run.loaded:
            run.note += f"; acks {what}: p50 {summary(since)[0]} ms after the first emit"
    for drone in drones:
        text = drone.text()
        for turn, (at, _) in log_times(text, r"abort signaled turn=(\S+)").items():
            run.stamp("drone signaled", turn, at)
        for turn, (at, _) in log_times(text, r"hangar\.drone aborted turn=(\S+)").items():
            run.stamp("drone done", turn, at)
