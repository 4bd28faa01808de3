"""Aborts at real token rates: many streams at a model's pace (50 tokens/s each by default)
over a few drones, each abort met by all of them, one at a time; and what the load did to the
drones (disconnects), the turns (errors) and the streams (tokens/s a person got).

    .venv/bin/python -m bench.token_rates [--streams 50] [--rate 50] [--drones 4] [--runs 3]
    .venv/bin/python -m bench.token_rates --drone-from 3846121   # the drone of that commit

Each run starts its own relay, peer and drones. The streams are submitted, every one waits for
its first text, the streams run ``--steady`` seconds (their rate and the CPU are measured), then
``--streams`` sequential aborts follow, each at a random moment 0-40 ms after the previous one
ended and each aborted stream replaced by a new one (``bench.abort_latency``'s sequential case).
The table gives the median over the runs of each run's p50, p99 and max. A run in which the
rest of the machine used more than ``--redo-above`` of a core (while streaming or aborting) is
done again, up to ``--attempts`` times.

``--drone-from REV`` runs the drones of commit ``REV`` (``git archive``, read only) with this
checkout's relay, shared protocol and benchmark, for a before/after comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .abort_latency import abort_one, shares
from .common import (
    ROOT,
    TOKEN,
    Browser,
    Proc,
    Stack,
    cpu_load,
    people,
    run_main,
    summary,
    table,
    wait_drones,
    wait_quiet,
)
from .timeline import AFTER_DRONE, Run, collect

STEPS = ("ack", "complete", AFTER_DRONE)
GIVE_UP = 10
"""Aborts left unanswered after which a run stops aborting (the drones are not coping)."""
CHARS_PER_TOKEN = 4
"""The peer streams ``"tok "``: four characters a token."""


class Reader(Browser):
    """A browser that also counts the characters of text it got."""

    def __init__(self, url: str, token: str | None = None) -> None:
        super().__init__(url, token)
        self.chars = 0

    async def _on_progress(self, data: dict[str, Any]) -> None:
        if data.get("kind") == "text":
            self.chars += len(data.get("text", ""))
        await super()._on_progress(data)


@contextlib.contextmanager
def pythonpath(path: str | None) -> Iterator[None]:
    old = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def drone_tree(rev: str, into: Path) -> str:
    """A ``hangar`` tree with commit ``rev``'s drone and this checkout's other parts."""
    tree = into / "hangar"
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", rev, "drone"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for part in ("shared", "server", "web"):
        (tree / part).symlink_to(ROOT / part)
    return str(into)


def children(pids: list[int]) -> list[int]:
    found: list[int] = []
    for pid in pids:
        with contextlib.suppress(OSError):
            found += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return found


def spawn_drones(stack: Stack, relay: str, peer: str, args: argparse.Namespace) -> list[Proc]:
    per_drone = max(1, -(-args.streams // args.drones))
    drones = []
    for i in range(args.drones):
        argv = ["-m", "bench.hangar_mono", "drone", "--server", relay, "--token", TOKEN]
        argv += ["--name", f"drone-{i}", "--provider", "openai", "--base-url", peer + "/v1"]
        argv += ["--api-key", "x", "--model", "m", "--concurrency", str(per_drone)]
        argv += ["--workdir", str(stack.drone_workdir)]
        argv += ["--workers", args.workers] if args.workers is not None else []
        with pythonpath(args.tree):
            drones.append(stack.spawn(f"drone-{i}", argv))
    return drones


async def one_run(args: argparse.Namespace, number: int, workdir: Path) -> dict[str, Any]:
    stack = Stack(workdir / f"run-{number}")
    readers: list[Reader] = []
    try:
        relay, relay_proc = await stack.relay("relay")
        peer, peer_proc = await stack.peer("openai", 1 / args.rate)
        drones = spawn_drones(stack, relay, peer, args)
        await wait_drones(relay, args.drones, limit=60)
        tokens = await people(relay, args.streams)
        readers = [Reader(relay, token) for token in tokens]
        for reader in readers:
            await reader.connect()
        quiet = await wait_quiet()
        load_before = os.getloadavg()[0]
        pids = {
            "relay": [relay_proc.pid],
            "drones": [d.pid for d in drones],
            "workers": children([d.pid for d in drones]),
            "peer": [peer_proc.pid],
            "bench": [os.getpid()],
        }
        run = Run(f"{args.streams} streams at {args.rate:g} tok/s", loaded=True)
        owner: dict[str, Browser] = {}
        for i, reader in enumerate(readers):
            prompt = f"rates {number} {i}"
            turn_id = await reader.submit(prompt)
            run.prompts[turn_id], owner[turn_id] = prompt, reader
        await started(owner, run)
        chars = sum(r.chars for r in readers)
        with cpu_load(pids) as streaming:
            await asyncio.sleep(args.steady)
        rate = (sum(r.chars for r in readers) - chars) / CHARS_PER_TOKEN / args.steady
        with cpu_load(pids) as aborting:
            leftover = await aborts(owner, run, f"rates {number}")
        await asyncio.gather(*(b.abort(t) for t, b in leftover.items()), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await asyncio.gather(*(b.done[t].wait() for t, b in leftover.items()))
        await collect(run, peer, relay_proc, drones)
        errors = [
            (turn_id, success, message)
            for reader in readers
            for turn_id, (_, success, message) in reader.completed.items()
            if not success
        ]
        return {
            "run": run,
            "rate": rate / args.streams,
            "disconnects": relay_proc.text().count("drone offline"),
            "errors": len(errors),
            "problems": len(run.failures),
            "load": (load_before, os.getloadavg()[0]),
            "note": f"{quiet}; streaming: {shares(streaming)}; aborting: {shares(aborting)}",
            "others": max(streaming["others"], aborting["others"]),
            "failures": [str(e) for e in errors[:3]] + run.failures[:3],
        }
    finally:
        for reader in readers:
            await reader.close()
        stack.stop()


async def started(owner: dict[str, Browser], run: Run, within: float = 120.0) -> None:
    """Wait until every stream has reached its browser; those that end first or never start
    are failures (and are not aborted)."""

    async def streaming(turn_id: str) -> None:
        browser = owner[turn_id]
        first = asyncio.ensure_future(browser.first_progress[turn_id].wait())
        ended = asyncio.ensure_future(browser.done[turn_id].wait())
        await asyncio.wait((first, ended), timeout=within, return_when="FIRST_COMPLETED")
        first.cancel()
        ended.cancel()
        if turn_id in browser.completed or not browser.first_progress[turn_id].is_set():
            run.failures.append(f"{turn_id}: did not stream {browser.completed.get(turn_id)}")
            del owner[turn_id]

    await asyncio.gather(*(streaming(t) for t in list(owner)))


async def aborts(owner: dict[str, Browser], run: Run, tag: str) -> dict[str, Browser]:
    """``bench.abort_latency.sequential``, going on past an abort that is not answered."""
    running = dict(owner)
    for i in range(len(owner)):
        ready: list[str] = []
        try:
            async with asyncio.timeout(30):
                while not ready:
                    ready = [
                        t
                        for t, b in running.items()
                        if b.first_progress[t].is_set() and t not in b.completed
                    ]
                    await asyncio.sleep(0 if ready else 0.05)
        except TimeoutError:
            run.failures.append("no stream left to abort for 30 s")
            break
        turn_id = random.choice(ready)
        browser = running.pop(turn_id)
        await asyncio.sleep(random.uniform(0, 0.04))
        try:
            await abort_one(browser, turn_id, run)
        except TimeoutError:
            run.failures.append(f"{turn_id}: no ack or no completion within 30 s")
            if len(run.failures) >= GIVE_UP:
                run.failures.append(f"gave up after {GIVE_UP} aborts without an answer")
                break
        prompt = f"{tag} replacement {i}"
        replacement = await browser.submit(prompt)
        running[replacement], run.prompts[replacement] = browser, prompt
    return running


def step_values(run: Run, step: str) -> list[float]:
    if step == AFTER_DRONE:
        start, end = run.stamps.get("drone signaled", {}), run.stamps.get("upstream closed", {})
    else:
        start, end = run.emitted, run.stamps.get(step, {})
    return [end[t] - start[t] for t in run.emitted if t in start and t in end]


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hangar-rates-") as tmp:
        workdir = Path(args.logs or tmp)
        if args.drone_from:
            args.tree = drone_tree(args.drone_from, Path(tmp) / "tree")
        results = []
        for n in range(args.runs):
            for attempt in range(args.attempts):
                result = await one_run(args, n * args.attempts + attempt, workdir)
                if result["others"] <= args.redo_above:
                    break
                last = attempt == args.attempts - 1
                verdict = "kept, no tries left" if last else "again"
                print(f"- run {n}: the rest of the machine used {result['others']:.0%}; {verdict}")
            results.append(result)
    rows = []
    for step in STEPS:
        figures = [summary(step_values(r["run"], step)) for r in results]
        medians = [
            f"{statistics.median(float(f[i]) for f in figures if f[i] != 'n/a'):.1f}"
            if any(f[i] != "n/a" for f in figures)
            else "n/a"
            for i in range(3)
        ]
        per_run = " / ".join(f[1] for f in figures)
        rows.append([step, str(len(step_values(results[0]["run"], step))), *medians, per_run])
    label = f"drone from {args.drone_from}" if args.drone_from else "this checkout"
    workers = f", --workers {args.workers}" if args.workers is not None else ""
    print(f"{args.streams} streams at {args.rate:g} tok/s, {args.drones} drones ({label}{workers})")
    print(table(["emit → step", "n", "p50 ms", "p99 ms", "max ms", "p99 per run"], rows))
    for n, result in enumerate(results):
        before, after = result["load"]
        print(
            f"- run {n}: tokens/s per stream {result['rate']:.1f}; drone disconnects "
            f"{result['disconnects']}; turns ended in error {result['errors']}; other problems "
            f"{result['problems']}; load average {before:.2f} "
            f"before, {after:.2f} after; {result['note']}"
        )
        for failure in result["failures"]:
            print(f"  - {failure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=50, help="streams at once")
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s of each stream")
    parser.add_argument("--drones", type=int, default=4, help="drone processes")
    parser.add_argument("--runs", type=int, default=3, help="runs (medians are reported)")
    parser.add_argument("--steady", type=float, default=5.0, help="s of streaming measured")
    parser.add_argument("--workers", help="the drones' --workers (default: theirs)")
    parser.add_argument("--drone-from", help="run the drones of this commit")
    parser.add_argument(
        "--redo-above",
        type=float,
        default=0.15,
        help="redo a run in which the rest of the machine used more than this share of a core",
    )
    parser.add_argument("--attempts", type=int, default=4, help="tries per run at most")
    parser.add_argument("--logs", help="keep the processes' logs here")
    args = parser.parse_args()
    args.tree = None
    args.interval = 0.02  # aborts 0-40 ms apart, as bench.abort_latency's sequential case
    random.seed(args.runs * 7919 + args.streams)
    started = time.monotonic()
    run_main(main_async(args))
    print(f"- took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
