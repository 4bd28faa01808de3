"""The relay's own share of abort latency: the same abort through the relay and through a bare
python-socketio forwarder (``bench.forwarder``), with a synthetic drone that answers at once and
then reports ``workOrderComplete(turnId, True, "aborted")``. No model, no drone SDK, no streaming:
what is left is socket.io hops plus what the server does.

    .venv/bin/python -m bench.abort_floor [--aborts 200]
    .venv/bin/python -m bench.abort_floor --burst [--streams 200] [--drones 4] [--runs 3]

``--burst`` is ``bench.abort_burst`` on the same floor: 4 synthetic drones, each a process of its
own, stream a text event every 0.5 s for each of 200 turns (one browser connection and person
per turn); then all 200 are aborted in the same instant. With ``--sdk`` the synthetic drones
stream each turn from an upstream peer through the openai SDK and close that stream on an abort
before the turn ends (the least a drone must do); ``--light`` runs the browsers as
``bench.light``'s cheaper clients.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .common import (
    Browser,
    Client,
    Proc,
    Stack,
    connect_browsers,
    connect_clients,
    cpu_load,
    peer_requests,
    quantile,
    run_main,
    summary,
    table,
    wait_drones,
    wait_quiet,
)
from .profiling import py_spy, top_frames
from .synthetic import SyntheticDrone


async def measure(url: str, count: int) -> tuple[list[float], list[float]]:
    """Sequential aborts; (emit → ack, emit → workOrderComplete) in seconds."""
    drone = await SyntheticDrone().connect(url, "floor-drone")
    browsers: list[Browser] = []
    acks: list[float] = []
    completes: list[float] = []
    try:
        browsers = await connect_browsers(url, 20)  # the relay rate-limits each connection
        for i in range(count + 20):  # the first 20 warm up
            browser = browsers[i % len(browsers)]
            turn_id = await browser.submit(f"floor {i}")
            assert await asyncio.wait_for(drone.orders.get(), 10) == turn_id
            await asyncio.sleep(0.02)
            emitted, acked, success, message = await browser.abort(turn_id)
            assert (success, message) == (True, "Abort signaled"), (success, message)
            await asyncio.wait_for(browser.done[turn_id].wait(), 10)
            if i >= 20:
                acks.append(acked - emitted)
                completes.append(browser.completed[turn_id][0] - emitted)
            await asyncio.sleep(0.05)  # stay under the relay's per-connection rate limits
    finally:
        for browser in browsers:
            await browser.close()
        await drone.close()
    return acks, completes


async def burst(
    stack: Stack, url: str, server: Proc, args: argparse.Namespace, relay: bool
) -> tuple[list[float], list[float], str]:
    """Every turn aborted at once; (emit → ack, emit → workOrderComplete) in seconds, and the
    CPU used meanwhile."""
    upstream = await stack.peer("openai", 0.5) if args.sdk else None
    peer = [upstream[0]] if upstream else []
    drones = [
        stack.spawn(f"synthetic-{i}", ["-m", "bench.synthetic", url, f"burst-{i}", "0.5", *peer])
        for i in range(args.drones)
    ]
    browsers: list[Client] = []
    try:
        for drone in drones:
            await drone.wait_line(r"SYNTHETIC \S+ READY")
        if relay:
            await wait_drones(url, args.drones)
        browsers = await connect_clients(url, args.streams, args.light)
        owner = {await browser.submit(f"burst {i}"): browser for i, browser in enumerate(browsers)}
        waits = [b.first_progress[t].wait() for t, b in owner.items()]
        await asyncio.wait_for(asyncio.gather(*waits), 60)
        quiet = await wait_quiet()
        acks: list[float] = []
        completes: list[float] = []

        async def abort_one(turn_id: str) -> None:
            browser = owner[turn_id]
            emitted, acked, success, message = await browser.abort(turn_id)
            assert (success, message) == (True, "Abort signaled"), (success, message)
            await asyncio.wait_for(browser.done[turn_id].wait(), 30)
            acks.append(acked - emitted)
            completes.append(browser.completed[turn_id][0] - emitted)

        turns = list(owner)
        random.shuffle(turns)
        if args.profile and relay:
            spy, profile = py_spy(stack, server, 3, "burst")
            await asyncio.sleep(0.5)  # py-spy attached
        pids = {"server": [server.pid], "drones": [d.pid for d in drones], "bench": [os.getpid()]}
        pids |= {"peer": [upstream[1].pid]} if upstream else {}
        with cpu_load(pids) as cpu:
            await asyncio.gather(*(abort_one(t) for t in turns))
        if args.profile and relay:
            await asyncio.to_thread(spy.popen.wait, 30)
            print(top_frames(profile, 25))
        shares = ", ".join(f"{k} {v:.0%}" for k, v in cpu.items())
        closed = f"; {await closed_upstream(upstream[0], len(turns))}" if upstream else ""
        spent = f"CPU per aborted turn: {cpu.per_item(len(turns))}"
        return (
            acks,
            completes,
            f"{quiet}; {shares}; waited for a core: {cpu.waits()}; {spent}{closed}",
        )
    finally:
        for browser in browsers:
            await browser.close()
        stack.stop(drones)


async def closed_upstream(peer: str, count: int) -> str:
    """How many of the peer's ``count`` streams it saw closed before their end."""

    def closed(rows: list[dict[str, Any]]) -> int:
        return sum(1 for row in rows if row["disconnectedAt"] is not None)

    rows = await peer_requests(peer, lambda rows: closed(rows) >= count)
    return f"upstream streams closed: {closed(rows)} of {count}"


async def burst_main(args: argparse.Namespace) -> None:
    rows = []
    notes = []
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        for name in args.servers.split(","):
            per_run: tuple[list[list[float]], list[list[float]]] = ([], [])
            for i in range(args.runs):
                stack = Stack(Path(args.logs or tmp) / f"{name.replace(' ', '-')}-{i}")
                try:
                    relay = name == "relay"
                    url, server = await (stack.relay() if relay else stack.forwarder())
                    acks, completes, note = await burst(stack, url, server, args, relay)
                finally:
                    stack.stop()
                per_run[0].append(acks)
                per_run[1].append(completes)
                p99s = f"ack p99 {quantile(acks, 0.99) * 1000:.1f} ms, complete p99 "
                p99s += f"{quantile(completes, 0.99) * 1000:.1f} ms"
                notes.append(f"- {name}, run {i + 1}: {p99s}; {note}")
            for step, values in zip(("ack", "complete"), per_run, strict=True):
                p50, p99, top = (
                    statistics.median(quantile(v, q) * 1000 for v in values)
                    for q in (0.5, 0.99, 1.0)
                )
                rows.append([name, step, len(values[0]), f"{p50:.1f}", f"{p99:.1f}", f"{top:.1f}"])
    kind = "synthetic drones streaming through the openai SDK" if args.sdk else "synthetic drones"
    print(f"a burst of {args.streams} aborts, {args.drones} {kind}; {args.runs} runs")
    print(table(["server", "emit → step", "n per run", "p50 ms", "p99 ms", "max ms"], rows))
    print("\n".join(notes))


async def main_async(args: argparse.Namespace) -> None:
    if args.burst:
        await burst_main(args)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        stack = Stack(Path(args.logs or tmp))
        try:
            relay, _ = await stack.relay()
            bare, _ = await stack.forwarder()
            for name, url in (("relay", relay), ("bare forwarder", bare)):
                quiet = await wait_quiet()
                acks, completes = await measure(url, args.aborts)
                rows.append([name, "ack", str(len(acks)), *summary(acks), quiet])
                rows.append([name, "complete", str(len(completes)), *summary(completes), ""])
        finally:
            stack.stop()
    headers = ["server", "emit → step", "n", "p50 ms", "p99 ms", "max ms", "before the run"]
    print(table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--aborts", type=int, default=200, help="sequential aborts per server")
    parser.add_argument("--logs", help="keep the servers' logs here")
    parser.add_argument("--burst", action="store_true", help="abort every turn at once")
    parser.add_argument("--streams", type=int, default=200, help="--burst: turns aborted at once")
    parser.add_argument("--drones", type=int, default=4, help="--burst: synthetic drones")
    parser.add_argument("--runs", type=int, default=3, help="--burst: runs per server")
    parser.add_argument("--profile", action="store_true", help="--burst: py-spy the relay")
    parser.add_argument(
        "--servers", default="relay,bare forwarder", help="--burst: which servers, in this order"
    )
    parser.add_argument(
        "--light", action="store_true", help="--burst: the browsers of bench.light (cheaper)"
    )
    parser.add_argument(
        "--sdk",
        action="store_true",
        help="--burst: the synthetic drones stream from an upstream peer through the openai "
        "SDK (2 chunks/s) and close that stream on an abort before the turn ends",
    )
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
