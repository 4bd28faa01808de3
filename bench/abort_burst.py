"""A burst of aborts: 200 turns stream (4 drones × 50, one browser connection each, a person
each), then every one is aborted in the same instant; emit → ack and emit → complete, with the
steps between from the processes' logs (``bench.timeline``).

    .venv/bin/python -m bench.abort_burst [--streams 200] [--runs 3] [--profile] [--light]

Each run starts its own processes; the figures are the medians of the runs' percentiles. A
second table shows the burst as a whole: when the first, half and last of the turns reached
each step, from the first emit. ``--profile`` samples the relay and one drone with py-spy
during the aborts of the last run. ``--light`` runs the browsers with ``bench.light``, which
costs the machine about half as much as python-socketio's client.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pstats
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from .common import (
    Client,
    Proc,
    Stack,
    connect_clients,
    cpu_load,
    quantile,
    run_main,
    table,
    wait_drones,
    wait_quiet,
    with_children,
)
from .profiling import py_spy, top_frames
from .timeline import STEPS, Run, collect

TARGETS = {"ack": 50.0, "complete": 100.0}


async def abort_one(browser: Client, turn_id: str, run: Run) -> None:
    emitted, acked, success, message = await browser.abort(turn_id)
    run.emitted[turn_id] = emitted
    run.stamp("ack", turn_id, acked)
    if (success, message) != (True, "Abort signaled"):
        run.failures.append(f"{turn_id}: ack {success} {message!r}")
    await asyncio.wait_for(browser.done[turn_id].wait(), 30)
    run.stamp("complete", turn_id, browser.completed[turn_id][0])


async def one_run(args: argparse.Namespace, workdir: Path, profile: bool) -> tuple[Run, str]:
    stack = Stack(workdir)
    if args.cprofile:
        os.environ["HANGAR_BENCH_CPROFILE"] = str(workdir)  # the processes started below
    browsers: list[Client] = []
    try:
        relay, relay_proc = await (stack.forwarder() if args.forwarder else stack.relay())
        peer, peer_proc = await stack.peer("openai", args.interval)
        per_drone = -(-args.streams // args.drones)
        drones = [
            stack.drone(relay, "openai", peer, per_drone, f"drone-{i}") for i in range(args.drones)
        ]
        if args.forwarder:
            for drone in drones:
                await drone.wait_line(r"connected to relay", 60)
        else:
            await wait_drones(relay, args.drones)
        browsers = await connect_clients(relay, args.streams, args.light)
        run = Run(f"{args.streams} streams, burst", loaded=True)
        owner: dict[str, Client] = {}
        for i, browser in enumerate(browsers):
            prompt = f"bench burst {time.time()} {i}"
            turn_id = await browser.submit(prompt)
            run.prompts[turn_id], owner[turn_id] = prompt, browser
        waits = [b.first_progress[t].wait() for t, b in owner.items()]
        await asyncio.wait_for(asyncio.gather(*waits), 60)
        quiet = await wait_quiet()
        spies = [
            py_spy(stack, t, 3, "burst", t is drones[0]) for t in (relay_proc, drones[0]) if profile
        ]
        if spies:
            await asyncio.sleep(0.5)  # py-spy attached
        turns = list(owner)
        random.shuffle(turns)
        pids = {"relay": [relay_proc.pid]}
        pids["drones"] = [d.pid for d in drones]
        pids["workers"] = [pid for d in drones for pid in with_children(d.pid)[1:]]
        pids |= {"peer": [peer_proc.pid], "bench": [os.getpid()]}
        profiled = [relay_proc.pid, *pids["drones"]] if args.cprofile else []
        for pid in profiled:
            os.kill(pid, signal.SIGUSR1)
        with cpu_load(pids) as cpu:
            await asyncio.gather(*(abort_one(owner[t], t, run) for t in turns))
        for pid in profiled:
            os.kill(pid, signal.SIGUSR2)
        note = f"{quiet}; load {os.getloadavg()[0]:.2f}; CPU while aborting: "
        note += ", ".join(f"{k} {v:.0%}" for k, v in cpu.items())
        run.note = f"{note}; waited for a core: {cpu.waits()}; "
        run.note += f"CPU per aborted turn: {cpu.per_item(len(turns))}"
        run.cpu_per_turn = cpu.total() * 1000 / len(turns)
        await collect(run, peer, relay_proc, drones)
        for spy, _ in spies:
            await asyncio.to_thread(spy.popen.wait, 30)
        found = "\n".join(top_frames(path) for _, path in spies if path.exists())
        if profiled:
            found += await cprofile_summary(relay_proc, drones)
        return run, found
    finally:
        for browser in browsers:
            await browser.close()
        stack.stop()


async def main_async(args: argparse.Namespace) -> None:
    runs: list[Run] = []
    profiles = ""
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        for i in range(args.runs):
            last = i == args.runs - 1
            workdir = Path(args.logs or tmp) / f"run-{i}"
            run, found = await one_run(args, workdir, args.profile and last)
            runs.append(run)
            profiles += found
    rows = []
    for step, _ in STEPS:
        per_run = []
        for run in runs:
            end = run.stamps.get(step, {})
            per_run.append([end[t] - run.emitted[t] for t in run.emitted if t in end])
        if not all(per_run):
            continue
        p50, p99, top = (
            statistics.median(quantile(v, q) * 1000 for v in per_run) for q in (0.5, 0.99, 1.0)
        )
        target = TARGETS.get(step)
        verdict = f"≤ {target:g}: {'met' if p99 <= target else '**missed**'}" if target else ""
        rows.append([step, len(per_run[0]), f"{p50:.1f}", f"{p99:.1f}", f"{top:.1f}", verdict])
    print(f"a burst of {args.streams} aborts; medians of {len(runs)} runs")
    print(table(["emit → step", "n per run", "p50 ms", "p99 ms", "max ms", "p99 target"], rows))
    print("\nthe burst as a whole: when each step was reached, ms after the first emit")
    print(table(["step", "first", "10%", "50%", "90%", "last"], _pipeline(runs)))
    spent = [run.cpu_per_turn for run in runs if run.cpu_per_turn is not None]
    if spent:
        each = ", ".join(f"{v:.2f}" for v in spent)
        median = statistics.median(spent)
        print(f"\nCPU per aborted turn, every process: {median:.2f} ms (runs: {each})")
    for i, run in enumerate(runs):
        print(f"- run {i + 1}: {run.note}")
        for failure in run.failures[:5]:
            print(f"  - {failure}")
    if profiles:
        print(profiles)


async def cprofile_summary(relay: Proc, drones: list[Proc]) -> str:
    """The functions the relay and the drones (together) spent the burst in, by own time."""
    out = []
    for name, chosen in (("relay", [relay]), ("drones", drones)):
        paths = [(await p.wait_line(r"cprofile written to (\S+)")).group(1) for p in chosen]
        stream = io.StringIO()
        pstats.Stats(*paths, stream=stream).sort_stats("tottime").print_stats(30)
        out.append(f"cProfile, {name}, the burst only (CPU time, profiled):\n{stream.getvalue()}")
    return "\n".join(out)


def _pipeline(runs: list[Run]) -> list[list[str]]:
    """Per step, when the first, 10%, half, 90% and last of the turns reached it, from the
    first emit of their run (medians over the runs): where the burst queues."""
    rows = []
    for step in ["emit", *(name for name, _ in STEPS)]:
        per_run = []
        for run in runs:
            first = min(run.emitted.values(), default=0.0)
            stamps = run.emitted if step == "emit" else run.stamps.get(step, {})
            per_run.append(sorted(at - first for at in stamps.values()))
        if not all(per_run):
            continue
        marks = (0.0, 0.1, 0.5, 0.9, 1.0)
        cells = [
            statistics.median(v[round(q * (len(v) - 1))] * 1000 for v in per_run) for q in marks
        ]
        rows.append([step, *(f"{c:.1f}" for c in cells)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--drones", type=int, default=4)
    parser.add_argument("--interval", type=float, default=0.5, help="s between chunks")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="py-spy relay and a drone")
    parser.add_argument(
        "--forwarder",
        action="store_true",
        help="the same drones behind a bare python-socketio forwarder (bench.forwarder) instead "
        "of the relay: the floor the drones and the transport set",
    )
    parser.add_argument("--logs", help="keep the processes' logs (and profiles) here")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="cProfile the relay and the drones' own processes during the aborts (slower)",
    )
    parser.add_argument(
        "--light",
        action="store_true",
        help="the browsers speak socket.io's wire protocol over bare websockets (bench.light): "
        "how much of the figures the benchmark's own clients are",
    )
    args = parser.parse_args()
    if args.cprofile and args.forwarder:
        parser.error("--cprofile profiles the relay: not with --forwarder")
    run_main(main_async(args))


if __name__ == "__main__":
    main()
