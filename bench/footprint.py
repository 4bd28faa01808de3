"""Memory footprint: relay RSS per idle browser connection and per running work order, drone RSS
per running work order (VmRSS from /proc/<pid>/status, before and after).

    .venv/bin/python -m bench.footprint [--browsers 200] [--orders 100] [--providers openai,ollama]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from .common import (
    Browser,
    Proc,
    Stack,
    connect_browsers,
    rss_kib,
    run_main,
    table,
    wait_drones,
)


async def settle() -> None:
    """Let connections finish their handshakes and garbage be collected."""
    await asyncio.sleep(2.0)


def rss(procs: list[Proc]) -> int:
    return sum(rss_kib(p.pid) for p in procs)


async def start_orders(browsers: list[Browser], count: int, tag: str) -> dict[str, Browser]:
    owner: dict[str, Browser] = {}
    for i in range(count):
        browser = browsers[i % len(browsers)]
        owner[await browser.submit(f"footprint {tag} {i}")] = browser
    for turn_id, browser in owner.items():
        await asyncio.wait_for(browser.first_progress[turn_id].wait(), 60)
    return owner


async def abort_all(owner: dict[str, Browser]) -> None:
    await asyncio.gather(*(b.abort(t) for t, b in owner.items()))
    await asyncio.wait_for(asyncio.gather(*(b.done[t].wait() for t, b in owner.items())), 30)


async def main_async(args: argparse.Namespace) -> None:
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        stack = Stack(Path(args.logs or tmp))
        browsers: list[Browser] = []
        try:
            relay, relay_proc = await stack.relay()
            for browser in await connect_browsers(relay, 10):  # warm-up
                await browser.close()
            await settle()
            before = rss([relay_proc])
            browsers = await connect_browsers(relay, args.browsers)
            await settle()
            after = rss([relay_proc])
            rows.append(
                [
                    "relay",
                    f"{args.browsers} idle browser connections",
                    f"{before / 1024:.1f}",
                    f"{after / 1024:.1f}",
                    f"{(after - before) / args.browsers:.1f}",
                ]
            )
            for provider in args.providers.split(","):
                rows += await orders(stack, args, provider, relay, relay_proc, browsers)
        finally:
            for browser in browsers:
                await browser.close()
            stack.stop()
    print(table(["process", "what", "RSS before MiB", "RSS after MiB", "KiB each"], rows))


async def orders(
    stack: Stack,
    args: argparse.Namespace,
    provider: str,
    relay: str,
    relay_proc: Proc,
    browsers: list[Browser],
) -> list[list[str]]:
    """Rows for ``args.orders`` running work orders of ``provider``."""
    peer, peer_proc = await stack.peer(provider, args.interval)
    per_drone = -(-args.orders // args.drones)
    drones = [
        stack.drone(relay, provider, peer, per_drone, f"footprint-{provider}-{i}")
        for i in range(args.drones)
    ]
    try:
        await wait_drones(relay, args.drones)
        # Warm-up: every drone runs (and aborts) a few orders: SDK clients, pools, imports.
        await abort_all(await start_orders(browsers, 4 * args.drones, "warm-up"))
        await settle()
        relay_before, drones_before = rss([relay_proc]), rss(drones)
        running = await start_orders(browsers, args.orders, provider)
        await settle()
        relay_after, drones_after = rss([relay_proc]), rss(drones)
        await abort_all(running)
        await settle()
        relay_ended, drones_ended = rss([relay_proc]), rss(drones)
    finally:
        stack.stop([peer_proc, *drones])
    what = f"{args.orders} running {provider} work orders"
    n = args.orders
    return [
        [
            "relay",
            what + f" (after they ended: {relay_ended / 1024:.1f} MiB)",
            f"{relay_before / 1024:.1f}",
            f"{relay_after / 1024:.1f}",
            f"{(relay_after - relay_before) / n:.1f}",
        ],
        [
            f"{args.drones} drones (sum)",
            what + f" (after they ended: {drones_ended / 1024:.1f} MiB)",
            f"{drones_before / 1024:.1f}",
            f"{drones_after / 1024:.1f}",
            f"{(drones_after - drones_before) / n:.1f}",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--browsers", type=int, default=200, help="idle browser connections")
    parser.add_argument("--orders", type=int, default=100, help="running work orders")
    parser.add_argument("--drones", type=int, default=2, help="drone processes")
    parser.add_argument("--providers", default="openai,ollama")
    parser.add_argument("--interval", type=float, default=0.5, help="s between upstream chunks")
    parser.add_argument("--logs", help="keep the processes' logs here")
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
