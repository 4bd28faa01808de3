"""The relay under a long history and a heavy person: what one person waits for as their
sessions and turns grow, and what a light person's aborts cost beside a heavy one.

    .venv/bin/python -m bench.relay_load history [--samples 20] [--runs 3] [--provider ollama]
    .venv/bin/python -m bench.relay_load heavy [--aborts 200] [--runs 3]

- ``history``: submit to first token (the first ``workOrderProgress`` at the browser) in a new
  session and in sessions with 10, 100 and 1,000 finished turns before it; one person.
- ``heavy``: a heavy person owns 10,000 sessions and runs turn after turn in a 1,000-turn
  session (its page open, its list asked for a page at a time), while a light person aborts
  a streaming turn of theirs 200 times, one after another; the same light run alone first.

Prior turns are written into the relay's SQLite file (a prompt and a ~400-character answer
each, as stored turns are). Processes: relay, drone and upstream peer as in ``bench.common``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import (
    IDE,
    RELAY_DATABASES,
    Browser,
    Proc,
    Stack,
    cpu_load,
    log_times,
    quantile,
    run_main,
    table,
    wait_drones,
    wait_quiet,
    with_children,
)
from .profiling import py_spy, top_frames

ANSWER = ("The relay keeps this answer as a finished turn of the session's history. " * 6)[:400]


class TimedBrowser(Browser):
    """A ``bench.common.Browser`` that stamps each turn's first progress event."""

    def __init__(self, url: str, token: str | None = None) -> None:
        super().__init__(url, token)
        self.first_at: dict[str, float] = {}

    async def _on_progress(self, data: dict[str, Any]) -> None:
        self.first_at.setdefault(data["turnId"], time.monotonic())
        await super()._on_progress(data)

    async def connect(self) -> TimedBrowser:
        await super().connect()
        return self

    async def submit_to(self, session_id: str | None, prompt: str) -> tuple[float, str]:
        """Submit (into ``session_id``, or a new session); returns when it was sent and the
        turn's id."""
        payload = {"prompt": prompt, **({"sessionId": session_id} if session_id else {})}
        sent = time.monotonic()
        ack = await self.sio.call("submitWorkOrder", payload, namespace=IDE, timeout=60)
        return sent, self._submitted(ack)


async def person(url: str, name: str) -> tuple[str, str]:
    """A new person of the relay at ``url``: their API token and user id."""
    from hangar.server.accounts import Accounts
    from hangar.server.app import open_store

    store = open_store(RELAY_DATABASES[url])
    await store.open()
    try:
        accounts = Accounts(store)
        user = await accounts.add_user(f"{name}-{os.urandom(4).hex()}", None)
        return await accounts.create_api_token(user.name, "benchmark"), user.user_id
    finally:
        await store.close()


def seed(database: str, owner: str, sessions: int, turns: int, tag: str) -> list[str]:
    """Write ``sessions`` sessions of ``turns`` finished turns each for ``owner`` into the
    relay's SQLite file; returns the sessions' ids."""
    start = time.time() - 86_400
    ids = [f"s_{tag}_{i}" for i in range(sessions)]
    user = json.dumps({"role": "user", "content": "A question of the history"})
    answer = json.dumps({"role": "assistant", "content": ANSWER})
    with sqlite3.connect(database, timeout=60) as conn:
        conn.executemany(
            "INSERT INTO sessions (session_id, owner, title, created_at, last_activity)"
            " VALUES (?, ?, ?, ?, ?)",
            [(s, owner, f"Seeded {i}", start, start) for i, s in enumerate(ids)],
        )
        rows = [
            (f"t_{s}_{n}", s, owner, start + n, start + n + 1) for s in ids for n in range(turns)
        ]
        conn.executemany(
            "INSERT INTO turns (turn_id, session_id, owner, prompt, status, result, text,"
            " drone_id, created_at, ended_at, started_at, reason)"
            " VALUES (?, ?, ?, 'A question of the history', 'finished', 'done', '', 'seed',"
            " ?, ?, NULL, 'finished')",
            rows,
        )
        conn.executemany(
            "INSERT INTO messages (turn_id, body) VALUES (?, ?)",
            [(row[0], body) for row in rows for body in (user, answer)],
        )
    return ids


async def first_token(
    browser: TimedBrowser, session_id: str | None, tag: str
) -> tuple[str, float, float]:
    """A turn's id, when it was submitted and when its first progress event came; the turn
    runs to its end."""
    sent, turn_id = await browser.submit_to(session_id, f"bench {tag}")
    await asyncio.wait_for(browser.done[turn_id].wait(), 60)
    return turn_id, sent, browser.first_at[turn_id]


STAGES = ("submit → order sent", "order sent → drone accepted", "accepted → first token")


def stages(relay: Proc, drone: Proc, turns: dict[str, tuple[float, float]]) -> list[list[float]]:
    """Per stage (``STAGES``), each turn's seconds, from the relay's and drone's log stamps."""
    sent = log_times(relay.text(), r"work order sent turn=(\S+)")
    accepted = log_times(drone.text(), r"work order turn=(\S+) accepted=True")
    found: list[list[float]] = [[], [], []]
    for turn_id, (submitted, first) in turns.items():
        if turn_id in sent and turn_id in accepted:
            marks = [submitted, sent[turn_id][0], accepted[turn_id][0], first]
            for i in range(3):
                found[i].append(marks[i + 1] - marks[i])
    return found


async def start(
    stack: Stack, chunks: int, interval: float, provider: str = "openai"
) -> tuple[str, Proc, Proc]:
    relay, relay_proc = await stack.relay()
    peer, _ = await stack.peer(provider, interval, chunks)
    drone = stack.drone(relay, provider, peer, 8, "drone-0")
    await wait_drones(relay, 1)
    return relay, relay_proc, drone


async def history_run(args: argparse.Namespace, workdir: Path, run: int) -> dict[int, Any]:
    """Per number of prior turns: each sample's seconds to the first token, and per stage."""
    stack = Stack(workdir / f"history-{run}")
    browsers: list[TimedBrowser] = []
    try:
        relay, relay_proc, drone = await start(
            stack, chunks=3, interval=0.005, provider=args.provider
        )
        token, user_id = await person(relay, "history")
        sessions = {
            n: seed(RELAY_DATABASES[relay], user_id, 1, n, f"h{n}")[0] for n in args.sizes[1:]
        }
        browsers = [await TimedBrowser(relay, token).connect() for _ in range(4)]
        for i in range(3):  # warm-up: connections, the drone's first requests
            await first_token(browsers[i], None, f"warm {i}")
            await first_token(browsers[i], sessions.get(args.sizes[-1]), f"warm long {i}")
        await wait_quiet()
        samples: dict[int, dict[str, tuple[float, float]]] = {n: {} for n in args.sizes}
        for i in range(args.samples):
            for n in args.sizes:  # interleaved, so drift hits every size alike
                browser = browsers[i % len(browsers)]
                turn_id, sent, first = await first_token(browser, sessions.get(n), f"{n} {i}")
                samples[n][turn_id] = (sent, first)
                await asyncio.sleep(0.25)  # under the relay's submit rate per connection
        found = {
            n: ([b - a for a, b in turns.values()], stages(relay_proc, drone, turns))
            for n, turns in samples.items()
        }
        if args.profile and run == args.runs - 1:  # the longest history only, sampled
            spies = [py_spy(stack, p, 8, "history", True) for p in (relay_proc, drone)]
            await asyncio.sleep(0.5)
            for i in range(20):
                await first_token(browsers[i % 4], sessions.get(args.sizes[-1]), f"prof {i}")
            for spy, path in spies:
                await asyncio.to_thread(spy.popen.wait, 30)
                print(top_frames(path))
        return found
    finally:
        for browser in browsers:
            await browser.close()
        stack.stop()


async def bench_history(args: argparse.Namespace, workdir: Path) -> None:
    runs = [await history_run(args, workdir, run) for run in range(args.runs)]

    def median_ms(values: list[list[float]], q: float) -> float:
        return statistics.median(quantile(v, q) for v in values if v) * 1000

    rows = []
    empty = median_ms([run[args.sizes[0]][0] for run in runs], 0.5)
    for n in args.sizes:
        p50 = median_ms([run[n][0] for run in runs], 0.5)
        p99 = median_ms([run[n][0] for run in runs], 0.99)
        ratio = p50 / empty
        verdict = "" if n < 1000 else f"≤ 2x: {'met' if ratio <= 2 else '**missed**'}"
        rows.append([f"{n:,}", len(runs[0][n][0]), f"{p50:.1f}", f"{p99:.1f}"])
        rows[-1] += [f"{median_ms([run[n][1][i] for run in runs], 0.5):.1f}" for i in range(3)]
        rows[-1] += [f"{ratio:.2f}x", verdict]
    load = os.getloadavg()[0]
    print(f"submit → first token ({args.provider}), medians of {args.runs} runs; load {load:.2f}")
    headers = ["prior turns", "n per run", "p50 ms", "p99 ms"]
    headers += [f"{stage} p50 ms" for stage in STAGES]
    print(table([*headers, "p50 vs empty", "target"], rows))


async def light_aborts(
    browsers: list[TimedBrowser], count: int, tag: str
) -> dict[str, tuple[float, float, float]]:
    """``count`` aborts one after another, each of a streaming turn 0-40 ms after its first
    token; per turn, when the abort was emitted, acknowledged and the turn's end arrived."""
    found: dict[str, tuple[float, float, float]] = {}
    for i in range(count):
        browser = browsers[i % len(browsers)]
        _, turn_id = await browser.submit_to(None, f"bench light {tag} {i}")
        await asyncio.wait_for(browser.first_progress[turn_id].wait(), 30)
        await asyncio.sleep(random.uniform(0, 0.04))
        emitted, acked, success, _ = await browser.abort(turn_id)
        await asyncio.wait_for(browser.done[turn_id].wait(), 30)
        found[turn_id] = (emitted, acked, browser.completed[turn_id][0])
        if not success:
            raise RuntimeError(f"abort of {turn_id} refused")
    return found


LIGHT_STEPS = ("ack", "drone done", "relay ended", "complete")


def light_steps(
    aborts: dict[str, tuple[float, float, float]], relay: Proc, drone: Proc
) -> list[list[float]]:
    """Per step (``LIGHT_STEPS``), seconds from each abort's emit: the browser's stamps, the
    drone's log (its agent unwound) and the relay's (the end stored)."""
    done = log_times(drone.text(), r"hangar\.drone aborted turn=(\S+)")
    ended = log_times(relay.text(), r"turn ended turn=(\S+) .*status=aborted")
    steps: list[list[float]] = [[], [], [], []]
    for turn_id, (emitted, acked, completed) in aborts.items():
        steps[0].append(acked - emitted)
        steps[3].append(completed - emitted)
        if turn_id in done and turn_id in ended:
            steps[1].append(done[turn_id][0] - emitted)
            steps[2].append(ended[turn_id][0] - emitted)
    return steps


async def heavy_work(browser: TimedBrowser, session_id: str, stop: asyncio.Event) -> int:
    """Turn after turn in the 1,000-turn session, each streaming ~1 s then aborted, with a page
    of the sessions list asked for between turns; returns how many turns ran."""
    opened = await browser.sio.call("openSession", {"sessionId": session_id}, namespace=IDE)
    if not opened.get("ok"):
        raise RuntimeError(f"openSession refused: {opened}")
    count = 0
    while not stop.is_set():
        _, turn_id = await browser.submit_to(session_id, f"bench heavy {count}")
        await asyncio.wait_for(browser.first_progress[turn_id].wait(), 60)
        await asyncio.sleep(1.0)
        await browser.abort(turn_id)
        await asyncio.wait_for(browser.done[turn_id].wait(), 60)
        await browser.sio.call("listSessions", {"limit": 50}, namespace=IDE)
        count += 1
    return count


async def heavy_run(args: argparse.Namespace, workdir: Path, run: int) -> dict[str, Any]:
    stack = Stack(workdir / f"heavy-{run}")
    browsers: list[TimedBrowser] = []
    try:
        relay, relay_proc, drone = await start(stack, chunks=1_000_000, interval=0.02)
        database = RELAY_DATABASES[relay]
        heavy_token, heavy_id = await person(relay, "heavy")
        light_token, _ = await person(relay, "light")
        (long_session,) = seed(database, heavy_id, 1, 1000, "long")
        seed(database, heavy_id, args.sessions, 1, "many")
        # The relay takes a burst of 10 submits per connection, then one a second.
        light = [await TimedBrowser(relay, light_token).connect() for _ in range(25)]
        heavy = await TimedBrowser(relay, heavy_token).connect()
        browsers = [*light, heavy]
        await light_aborts(light, 3, "warm")
        pids = {"relay": [relay_proc.pid], "drone": with_children(drone.pid)}
        pids["bench"] = [os.getpid()]
        result: dict[str, Any] = {"load": [], "cpu": []}
        for case in ("alone", "beside heavy"):
            result["load"].append(await wait_quiet())
            stop = asyncio.Event()
            work = None
            if case != "alone":
                work = asyncio.ensure_future(heavy_work(heavy, long_session, stop))
                await asyncio.sleep(3.0)
            with cpu_load(pids) as cpu:
                aborts = await light_aborts(light, args.aborts, f"{run} {case}")
            result[case] = light_steps(aborts, relay_proc, drone)
            result["cpu"].append(", ".join(f"{k} {v:.0%}" for k, v in cpu.items()))
            if work is not None:
                stop.set()
                result["heavy turns"] = await work
        return result
    finally:
        for browser in browsers:
            await browser.close()
        stack.stop()


async def bench_heavy(args: argparse.Namespace, workdir: Path) -> None:
    runs = [await heavy_run(args, workdir, run) for run in range(args.runs)]
    rows = []
    for case in ("alone", "beside heavy"):
        for step, name in enumerate(LIGHT_STEPS):
            values = [run[case][step] for run in runs]
            p50, p99 = (
                statistics.median(quantile(v, q) for v in values) * 1000 for q in (0.5, 0.99)
            )
            verdict = f"≤ 10: {'met' if p99 <= 10 else '**missed**'}"
            row = [case, name, len(values[0]), f"{p50:.1f}", f"{p99:.1f}"]
            rows.append([*row, verdict if (case, name) == ("beside heavy", "ack") else ""])
    print(
        f"a light person's aborts, medians of {args.runs} runs; the heavy person owns "
        f"{args.sessions:,} sessions and ran {[r['heavy turns'] for r in runs]} turns in a "
        "1,000-turn session meanwhile"
    )
    headers = ["light person", "emit → step", "n per run", "p50 ms", "p99 ms", "p99 target"]
    print(table(headers, rows))
    for i, run in enumerate(runs):
        print(f"- run {i + 1}: {'; '.join(run['load'])}; CPU (1 = a core): {run['cpu']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("case", choices=("history", "heavy"))
    parser.add_argument("--runs", type=int, default=3, help="whole runs; medians are reported")
    parser.add_argument("--samples", type=int, default=20, help="history: submits per size")
    parser.add_argument("--sizes", default="0,10,100,1000", help="history: prior turns")
    parser.add_argument("--aborts", type=int, default=200, help="heavy: the light one's aborts")
    parser.add_argument("--sessions", type=int, default=10_000, help="heavy: sessions owned")
    parser.add_argument("--profile", action="store_true", help="history: py-spy the last run")
    parser.add_argument("--provider", choices=("openai", "ollama"), default="openai")
    parser.add_argument("--logs", help="keep the processes' logs here")
    args = parser.parse_args()
    args.sizes = [int(n) for n in args.sizes.split(",")]

    async def chosen() -> None:
        with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
            workdir = Path(args.logs or tmp)
            await (bench_history if args.case == "history" else bench_heavy)(args, workdir)

    run_main(chosen())


if __name__ == "__main__":
    main()
