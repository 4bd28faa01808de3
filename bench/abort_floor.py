"""The relay's own share of abort latency: the same abort through the relay and through a bare
python-socketio forwarder (``bench.forwarder``), with a synthetic drone that answers at once and
then reports ``workOrderComplete(turnId, True, "aborted")``. No model, no drone SDK, no streaming:
what is left is socket.io hops plus what the server does.

    .venv/bin/python -m bench.abort_floor [--aborts 200]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from .common import Browser, Stack, connect_browsers, run_main, summary, table, wait_quiet
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


async def main_async(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="hangar-bench-") as tmp:
        stack = Stack(Path(args.logs or tmp))
        try:
            relay, _ = await stack.relay()
            bare = stack.spawn("forwarder", ["-m", "bench.forwarder"])
            found = await bare.wait_line(r"listening on (http://127\.0\.0\.1:\d+)/")
            for name, url in (("relay", relay), ("bare forwarder", found.group(1))):
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
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
