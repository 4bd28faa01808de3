"""Abort latency: from a browser's ``abortWorkOrder`` emit to its ack, to the turn's
``workOrderComplete(turnId, True, "aborted")`` and to the upstream peer seeing the HTTP stream
closed; with one stream, and with many streaming at once.

    .venv/bin/python -m bench.abort_latency [--providers openai,ollama] [--streams 200] ...

Every step is stamped with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process on
the machine): the browser's emit, ack and completion here; the relay's and drones' log lines
(run through ``bench.hangar_mono``); the peer's disconnect stamp in the peer process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from .common import (
    Browser,
    Stack,
    connect_browsers,
    cpu_load,
    get_json,
    run_main,
    table,
    wait_drones,
    wait_quiet,
)
from .profiling import py_spy, top_frames
from .timeline import STEPS, Run, collect


async def abort_one(browser: Browser, turn_id: str, run: Run) -> None:
    emitted, acked, success, message = await browser.abort(turn_id)
    run.emitted[turn_id] = emitted
    run.stamp("ack", turn_id, acked)
    if (success, message) != (True, "Abort signaled"):
        run.failures.append(f"{turn_id}: ack {success} {message!r}")
    await asyncio.wait_for(browser.done[turn_id].wait(), 30)
    at, success, message = browser.completed[turn_id]
    run.stamp("complete", turn_id, at)
    if (success, message) != (True, "aborted"):
        run.failures.append(f"{turn_id}: complete {success} {message!r}")


async def idle(browsers: list[Browser], count: int, interval: float, tag: str) -> Run:
    """``count`` sequential aborts, one stream at a time, at a random point between chunks."""
    run = Run("1 stream", loaded=False)
    for i in range(count):
        browser = browsers[i % len(browsers)]
        prompt = f"bench {tag} idle {i}"
        turn_id = await browser.submit(prompt)
        run.prompts[turn_id] = prompt
        await asyncio.wait_for(browser.first_progress[turn_id].wait(), 30)
        await asyncio.sleep(random.uniform(0, interval * 2))
        await abort_one(browser, turn_id, run)
        await asyncio.sleep(0.05)
    return run


async def loaded(
    browsers: list[Browser],
    args: argparse.Namespace,
    mode: str,
    tag: str,
    pids: dict[str, list[int]],
    before_aborts: Callable[[], Awaitable[None]],
) -> Run:
    """``args.streams`` streams at once; once each has reached its browser, abort them: one at a
    time (each replaced by a new stream), all at once, or one every ``args.spacing`` s."""
    count = args.streams
    run = Run(f"{count} streams, {mode}", loaded=True)
    owner: dict[str, Browser] = {}
    # One at a time: concurrent submits race in the relay's choice of drone (see the doc).
    for i in range(count):
        browser = browsers[i % len(browsers)]
        prompt = f"bench {tag} {mode} {i}"
        turn_id = await browser.submit(prompt)
        run.prompts[turn_id], owner[turn_id] = prompt, browser

    async def streaming(turn_id: str) -> None:
        browser = owner[turn_id]
        started = asyncio.ensure_future(browser.first_progress[turn_id].wait())
        ended = asyncio.ensure_future(browser.done[turn_id].wait())
        await asyncio.wait((started, ended), return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        ended.cancel()
        if turn_id in browser.completed:
            run.failures.append(f"{turn_id}: ended before the abort {browser.completed[turn_id]}")
            del owner[turn_id]

    await asyncio.wait_for(asyncio.gather(*(streaming(t) for t in list(owner))), 60)
    before = sum(sum(b.progress.values()) for b in browsers)
    with cpu_load(pids) as cpu:
        await asyncio.sleep(2.0)
    delivered = (sum(sum(b.progress.values()) for b in browsers) - before) / 2.0
    offered = count / args.loaded_interval
    run.note = f"progress {delivered:.0f}/s (offered {offered:.0f}/s); CPU: {shares(cpu)}"
    await before_aborts()
    turns = list(owner)
    random.shuffle(turns)
    if mode == "sequential":
        with cpu_load(pids) as cpu:
            leftover = await sequential(owner, run, args, f"{tag} {mode}")
        run.note += f"; CPU while aborting: {shares(cpu)}"
        # The streams still running (the replacements included) are stopped unmeasured.
        await asyncio.gather(*(b.abort(t) for t, b in leftover.items()))
        await asyncio.gather(*(b.done[t].wait() for t, b in leftover.items()))
        return run
    with cpu_load(pids) as cpu:
        if mode == "burst":
            await asyncio.gather(*(abort_one(owner[t], t, run) for t in turns))
        else:
            tasks = []
            for t in turns:
                tasks.append(asyncio.ensure_future(abort_one(owner[t], t, run)))
                await asyncio.sleep(args.spacing)
            await asyncio.gather(*tasks)
    run.note += f"; CPU while aborting: {shares(cpu)}"
    return run


async def sequential(
    owner: dict[str, Browser], run: Run, args: argparse.Namespace, tag: str
) -> dict[str, Browser]:
    """One abort at a time while the others stream; each aborted stream is replaced by a new
    work order, so every abort happens with ``len(owner)`` streams running. Returns the streams
    still running at the end."""
    running = dict(owner)
    for i in range(len(owner)):
        ready = [t for t, b in running.items() if b.first_progress[t].is_set()]
        turn_id = random.choice(ready)
        browser = running.pop(turn_id)
        await asyncio.sleep(random.uniform(0, args.interval * 2))
        await abort_one(browser, turn_id, run)
        prompt = f"bench {tag} replacement {i}"
        replacement = await browser.submit(prompt)
        running[replacement], run.prompts[replacement] = browser, prompt
    return running


def shares(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in cpu.items()) + " (100% = 1 core)"


async def bench_provider(args: argparse.Namespace, provider: str, workdir: Path) -> list[Run]:
    stack = Stack(workdir)
    browsers: list[Browser] = []
    runs: list[Run] = []
    profiles: list[Path] = []
    try:
        relay, relay_proc = await stack.relay(f"relay-{provider}")
        peer, peer_proc = await stack.peer(provider, args.interval)
        per_drone = max(1, -(-args.streams // args.drones))
        drones = [
            stack.drone(relay, provider, peer, per_drone, f"drone-{provider}-{i}")
            for i in range(args.drones)
        ]
        await wait_drones(relay, args.drones)
        pids = {
            "relay": [relay_proc.pid],
            "drones": [d.pid for d in drones],
            "peer": [peer_proc.pid],
            "bench": [os.getpid()],
        }
        tag = f"{provider}-{int(time.time())}"
        if args.idle:
            # A few connections of their own (the relay rate-limits submits per connection).
            browsers = await connect_browsers(relay, args.idle_browsers)
            await idle(browsers, 3, args.interval, tag + "-warmup")  # connections, imports
            quiet = await wait_quiet()
            if args.profile:
                for target in (relay_proc, drones[0]):
                    profiles.append(py_spy(stack, target, args.idle * 0.15, "idle")[1])
            with cpu_load(pids) as cpu:
                run = await idle(browsers, args.idle, args.interval, tag)
            run.note = f"{quiet}; CPU during the run: {shares(cpu)}"
            await collect(run, peer, relay_proc, drones)
            runs.append(run)
            for browser in browsers:
                await browser.close()
        browsers = await connect_browsers(relay, args.browsers or max(1, args.streams))
        pace = f"{peer}/bench/pace?interval={args.loaded_interval}"
        await asyncio.to_thread(get_json, pace, "POST")
        for mode in [m for m in args.modes.split(",") if m and args.streams > 0]:
            quiet = await wait_quiet()

            async def before_aborts(mode: str = mode) -> None:
                if args.profile:  # the aborts only, not the streaming before them
                    for target in (relay_proc, drones[0]):
                        profiles.append(py_spy(stack, target, 3, mode)[1])
                    await asyncio.sleep(0.5)

            run = await loaded(browsers, args, mode, tag, pids, before_aborts)
            run.note = f"{quiet}; {run.note}"
            await collect(run, peer, relay_proc, drones)
            runs.append(run)
    finally:
        for browser in browsers:
            await browser.close()
        await asyncio.sleep(1 if profiles else 0)
        stack.stop()
    for path in profiles:
        if path.exists():
            print(top_frames(path))
    return runs


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        workdir = Path(args.logs or tmp)
        rows: list[list[str]] = []
        notes: list[str] = []
        for provider in args.providers.split(","):
            for run in await bench_provider(args, provider, workdir):
                rows += run.rows(provider)
                if run.note:
                    notes.append(f"{provider}, {run.label}: {run.note}")
                notes += [f"{provider}, {run.label}: {f}" for f in run.failures[:10]]
        headers = ["provider", "case", "emit → step", "n", "p50 ms", "p99 ms", "max ms"]
        print(table([*headers, "p99 target"], rows))
        print("\n".join(f"- {step}: {meaning}" for step, meaning in STEPS))
        for note in notes:
            print("-", note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--providers", default="openai,ollama")
    parser.add_argument("--idle", type=int, default=200, help="sequential single-stream aborts")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams")
    parser.add_argument("--drones", type=int, default=4, help="drone processes")
    parser.add_argument("--browsers", type=int, default=0, help="connections (default: 1/stream)")
    parser.add_argument("--idle-browsers", type=int, default=10, help="connections, 1 stream")
    parser.add_argument(
        "--modes",
        default="sequential,burst,staggered",
        help="sequential (one abort at a time, the stream replaced), burst, staggered",
    )
    parser.add_argument("--spacing", type=float, default=0.01, help="staggered: s between aborts")
    parser.add_argument("--interval", type=float, default=0.02, help="s between chunks, 1 stream")
    parser.add_argument(
        "--loaded-interval", type=float, default=0.5, help="s between chunks, many streams"
    )
    parser.add_argument("--logs", help="keep the processes' logs (and profiles) here")
    parser.add_argument("--profile", action="store_true", help="py-spy the relay and a drone")
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
