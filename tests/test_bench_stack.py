"""The benchmarks' own set-up (``bench.common.Stack``) starts what ``docs/performance.md``
measures: a relay on its SQLite file, an upstream peer and a ``hangar drone`` that joins the
relay and answers a person's work order. Every figure there rests on it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.common import Browser, Stack, connect_browsers, wait_drones

pytestmark = pytest.mark.asyncio


async def test_a_benchmark_stack_s_drone_joins_its_relay_and_answers_a_work_order(
    tmp_path: Path,
) -> None:
    stack = Stack(tmp_path / "bench")
    browsers: list[Browser] = []
    try:
        relay, _ = await stack.relay()
        peer, _ = await stack.peer("openai", 0.01, chunks=3)
        drone = stack.drone(relay, "openai", peer, 1, "drone-0")
        await wait_drones(relay, 1, limit=60)
        browsers = await connect_browsers(relay, 1)

        turn_id = await browsers[0].submit("bench stack")
        await asyncio.wait_for(browsers[0].done[turn_id].wait(), 30)

        assert browsers[0].completed[turn_id][1] is True
        assert drone.popen.poll() is None
    finally:
        for browser in browsers:
            await browser.close()
        stack.stop()
