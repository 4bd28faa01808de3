"""A drone far from its relay: a link whose answers come more than a second late."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.peers import OpenAIPeer
from hangar.server.app import RelayConfig
from tests.conftest import DRONE_TOKEN, Browser, Upstream, eventually, relay_folder, relay_on
from tests.slow_link import SlowLink
from tests.test_faults import a_next_turn_works, listed_drones

LATE = 1.5
"""Seconds the relay's answers take to reach the drone (pings are sent every third of the
drone grace, 10 s here, and answered within the rest: this link keeps its connection)."""


async def test_a_drone_on_a_slow_link_gets_back_in_after_the_link_drops(
    tmp_path: Path, drone_process: Any, openai_peer: OpenAIPeer
) -> None:
    """After a dropped connection python-socketio's own reconnect waited 1 s for the relay to
    let the drone in, and gave up: over a link this slow the drone connected and left again,
    for ever (its first connect waited 10 s, and got in)."""
    config = RelayConfig(
        port=0,
        database=str(relay_folder(tmp_path) / "hangar.db"),
        drone_token=DRONE_TOKEN,
        drone_grace=10.0,
    )
    async with relay_on(config) as relay:
        link = SlowLink(int(relay.url.rsplit(":", 1)[1]), LATE)
        try:
            drone_process(Upstream("openai", openai_peer), server=await link.start())
            browser = await Browser(relay.url, await relay.people.token("ada")).connect()
            try:
                await eventually(lambda: listed_drones(browser), timeout=30, what="the drone")
                log = tmp_path / "proc-drone-0.log"
                await eventually(  # the relay's welcome came through
                    lambda: b"connected to relay" in log.read_bytes(), timeout=10, what="welcome"
                )
                link.cut()
                await eventually(
                    lambda: relay.relay.directory.local == {}, timeout=10, what="the drop"
                )
                await a_next_turn_works(browser, None, openai_peer)
            finally:
                await browser.close()
        finally:
            await link.close()
