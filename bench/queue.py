"""The queue: how long a submitted work order takes to reach an idle drone, and how many queued
orders two relays put through four drones.

1. **Dispatch**: one relay (SQLite), one idle drone; orders one after another, each waiting for
   the last to end. Submit (the browser's emit) to the drone accepting the order (its log line)
   and to the model request reaching the upstream peer.
2. **Through two relays**: two relays on one PostgreSQL and one Redis, four drones with ten slots
   each, and ``--orders`` submitted at once (more than there are slots, so most wait in line).
   Orders per second from the first submit to the last completion; each order's wait from its
   submit to its model request; every order must end once and reach the model once.

Needs PostgreSQL and Redis for part 2 (``HANGAR_BENCH_POSTGRES``, an admin URL: the benchmark
creates and drops a database of its own; ``HANGAR_BENCH_REDIS``: a Redis it shares with others:
the relays' keys start with their deployment's prefix, and only those are deleted afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from hangar.server.app import RelayConfig

from .common import (
    Browser,
    Stack,
    connect_browsers,
    get_json,
    log_times,
    run_main,
    summary,
    table,
    wait_drones,
    wait_quiet,
)

POSTGRES = os.environ.get("HANGAR_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("HANGAR_BENCH_REDIS", "redis://127.0.0.1:6379/13")


async def dispatch(args: argparse.Namespace, workdir: Path) -> list[list[object]]:
    stack = Stack(workdir / "dispatch")
    try:
        relay, _ = await stack.relay("relay")
        peer, _ = await stack.peer("openai", 0.001, chunks=2)
        drone = stack.drone(relay, "openai", peer, concurrency=1, name="drone")
        await wait_drones(relay, 1)
        browsers = await connect_browsers(relay, 10)
        quiet = await wait_quiet()
        submitted: dict[str, float] = {}
        for index in range(args.sequential + 5):
            browser = browsers[index % len(browsers)]
            started = time.monotonic()
            turn_id = await browser.submit(f"order {index}")
            await asyncio.wait_for(browser.done[turn_id].wait(), 30)
            if index >= 5:  # the first few warm up
                submitted[turn_id] = started
            if index % 10 == 9:
                await asyncio.sleep(1.0)  # a person's pace: each connection's submit rate limit
        accepted = log_times(drone.text(), r"work order turn=(\S+) accepted=True")
        upstream = {row["prompt"]: row["started"] for row in get_json(peer + "/bench/requests")}
        prompts = {turn: f"order {i + 5}" for i, turn in enumerate(submitted)}
        to_drone = [accepted[t][0] - at for t, at in submitted.items() if t in accepted]
        to_model = [upstream[prompts[t]] - at for t, at in submitted.items()]
        for browser in browsers:
            await browser.close()
        return [
            ["submit → drone accepted", len(to_drone), *summary(to_drone), quiet],
            ["submit → model request", len(to_model), *summary(to_model), ""],
        ]
    finally:
        stack.stop()


async def through_two_relays(args: argparse.Namespace, workdir: Path) -> str:
    import asyncpg
    import redis.asyncio as aioredis

    name = f"hangar_bench_{os.getpid()}"
    admin = await asyncpg.connect(POSTGRES)
    await admin.execute(f'CREATE DATABASE "{name}"')
    database = POSTGRES.rsplit("/", 1)[0] + "/" + name
    cache = aioredis.Redis.from_url(REDIS)
    prefix = RelayConfig(database=database).deployment()
    stack = Stack(workdir / "relays")
    try:
        a, _ = await stack.relay("relay-a", database, REDIS)
        b, _ = await stack.relay("relay-b", database, REDIS)
        peer, _ = await stack.peer("openai", 0.001, chunks=2)
        for index in range(4):
            stack.drone((a, b)[index % 2], "openai", peer, concurrency=10, name=f"drone-{index}")
        await wait_drones(a, 4)
        per_browser = 10  # each connection's quick-submit allowance
        browsers: list[Browser] = []
        for relay in (a, b):
            browsers += await connect_browsers(relay, args.orders // per_browser // 2)
        quiet = await wait_quiet()
        started = time.monotonic()

        async def orders_of(index: int, browser: Browser) -> list[tuple[str, float]]:
            sent = []
            for n in range(per_browser):
                sent.append((await browser.submit(f"order {index}-{n}"), time.monotonic()))
            return sent

        sent = [pair for part in await asyncio.gather(
            *(orders_of(i, b) for i, b in enumerate(browsers))
        ) for pair in part]  # fmt: skip
        owner = {turn: browser for browser in browsers for turn in browser.done}
        await asyncio.wait_for(
            asyncio.gather(*(owner[turn].done[turn].wait() for turn, _ in sent)), 300
        )
        finished = max(owner[turn].completed[turn][0] for turn, _ in sent)
        requests = get_json(peer + "/bench/requests")
        prompts = [row["prompt"] for row in requests]
        ended_ok = sum(1 for turn, _ in sent if owner[turn].completed[turn][1])
        waits = sorted(row["started"] - started for row in requests)
        rate = len(sent) / (finished - started)
        rows = [
            [
                len(sent),
                f"{rate:.0f}",
                f"{finished - started:.2f}",
                *summary(waits),
                ended_ok,
                len(set(prompts)),
                len(prompts) - len(set(prompts)),
                quiet,
            ]
        ]
        for browser in browsers:
            await browser.close()
        headers = [
            "orders", "orders/s", "s in all", "wait p50 ms", "wait p99 ms", "wait max ms",
            "ended finished", "reached the model", "reached it twice", "before the run",
        ]  # fmt: skip
        return table(headers, rows)
    finally:
        stack.stop()
        async for key in cache.scan_iter(match=prefix + "*"):
            await cache.delete(key)
        await cache.aclose()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def main_async(args: argparse.Namespace) -> None:
    workdir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    rows = await dispatch(args, workdir)
    print(table(["from → to", "n", "p50 ms", "p99 ms", "max ms", "before the run"], rows))
    print()
    print(await through_two_relays(args, workdir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequential", type=int, default=100, help="orders, part 1")
    parser.add_argument("--orders", type=int, default=1000, help="orders at once, part 2")
    parser.add_argument("--logs", help="keep the processes' logs here")
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
