"""A relay restart under an open page, in real Chromium: the page reconnects by itself, the turn
streaming from a ``hangar drone`` process goes on and finishes, and the answer the page shows
never gets shorter, even when the restarted relay's snapshot holds less of it than the page."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from playwright.async_api import Page, expect

from bench.peers import OpenAIPeer, Reply
from bench.services import free_port
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, has_class, open_hangar, stored, submit, turn_id_of
from tests.conftest import DRONE_TOKEN, People, RelayHandle, Upstream, eventually, relay_folder

pytestmark = pytest.mark.browser

# About 7 s of streaming: the restart falls well inside it.
REPLY = Reply(chunks=[f"t{i} " for i in range(240)], delay=0.03)


@dataclass
class RestartableRelay:
    """A relay in this process on a fixed port and SQLite file, that can be stopped and started
    again on both; ``handle`` always names the running one."""

    handle: RelayHandle
    runner: web.AppRunner

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def start(self) -> None:
        self.runner, _ = await start_relay(self.handle.config)
        self.handle.relay = self.runner.app[RELAY]
        self.handle.people = People(self.handle.relay.accounts)


@pytest.fixture
async def restartable(
    tmp_path: Path, relay_ping: tuple[float, float] | None
) -> AsyncIterator[RestartableRelay]:
    config = RelayConfig(
        port=free_port(),
        database=str(relay_folder(tmp_path) / "hangar.db"),
        drone_token=DRONE_TOKEN,
        abort_grace=2.0,
        drone_grace=2.0,
        ping=relay_ping,
    )
    runner, port = await start_relay(config)
    relay = runner.app[RELAY]
    handle = RelayHandle(f"http://127.0.0.1:{port}", relay, config, People(relay.accounts))
    restartable = RestartableRelay(handle, runner)
    yield restartable
    await restartable.runner.cleanup()


@pytest.fixture
def relay(restartable: RestartableRelay) -> RelayHandle:
    """The browser fixtures' relay is the restartable one."""
    return restartable.handle


async def watch_answer_length(page: Page, turn_id: str) -> None:
    """Record the length of the turn's answer text every 50 ms and at every change of the turns."""
    await page.evaluate(
        """(turnId) => {
            const lengths = (window.__lengths = []);
            const sample = () => lengths.push(window.hangar.answerText(turnId)?.length ?? 0);
            setInterval(sample, 50);
            new MutationObserver(sample).observe(document.getElementById("turns"), {
                childList: true, subtree: true, characterData: true,
            });
            sample();
        }""",
        turn_id,
    )


async def answer_lengths(page: Page) -> list[int]:
    lengths: list[int] = await page.evaluate("() => window.__lengths.slice()")
    return lengths


async def test_a_relay_restart_mid_turn_never_shows_less_text_and_the_turn_finishes(
    page: Page,
    relay: RelayHandle,
    restartable: RestartableRelay,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., Any],
) -> None:
    openai_peer.script(REPLY)
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    await open_hangar(page, relay)
    turn = await submit(page, "Count for a while")
    turn_id = await turn_id_of(turn)
    await watch_answer_length(page, turn_id)
    await expect(turn.locator(".turn-output")).to_contain_text("t10 ", timeout=WAIT_MS)
    await page.evaluate(
        "(id) => { window.__card = document.querySelector(`article[data-turn-id='${id}']`); }",
        turn_id,
    )

    # The drone is held back until the page has its snapshot from the new relay, which holds
    # what the relay wrote of the turn's text (docs/reliability.md, "a relay that dies"): up to
    # what the page shows, and less when text streamed after the last write; the drone sends
    # the rest again only later.
    drone.send_signal(signal.SIGSTOP)
    try:
        await restartable.restart()
        await page.wait_for_function(
            """(id) => {
                const card = document.querySelector(`article[data-turn-id='${id}']`);
                return card !== null && card !== window.__card;
            }""",
            arg=turn_id,
            timeout=WAIT_MS,
        )
        await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
        snapshot_text, _ = await relay.relay.live_state.text(turn_id)
        assert len(snapshot_text) <= max(await answer_lengths(page)), (
            "the new relay's snapshot holds more than the page showed"
        )
    finally:
        drone.send_signal(signal.SIGCONT)

    await expect(turn).to_have_class(has_class("finished"), timeout=30_000)
    final = await page.evaluate("(id) => window.hangar.answerText(id)", turn_id)
    assert final == REPLY.text
    lengths = await answer_lengths(page)
    shrinks = [(a, b) for a, b in pairwise(lengths) if b < a]
    assert not shrinks, f"the answer got shorter: {shrinks[:5]} (of {len(lengths)} samples)"
    assert lengths[-1] == len(REPLY.text)
    assert (await stored(relay, turn_id, "finished")).text == REPLY.text


async def test_during_an_outage_the_drones_are_unknown_and_after_it_the_relays_word(
    page: Page, relay: RelayHandle, restartable: RestartableRelay
) -> None:
    summary = page.locator("#drone-summary")
    connection = page.locator("#connection")
    async with HandDrone(relay.url, drone_id="before"):
        await open_hangar(page, relay)
        await expect(summary).to_have_text("1 online · 0 busy · 1 idle")

        await restartable.stop()
        await expect(page.locator("#connection-label")).to_have_text("Reconnecting…")
        await expect(summary).to_have_text("Drones unknown while not connected.")
        await expect(page.locator("#drone option", has_text="before")).not_to_contain_text("idle")

    # Back without that drone: the page says so, then sees the next one come.
    await restartable.start()
    await expect(connection).to_have_attribute("data-state", "connected", timeout=WAIT_MS)
    await expect(summary).to_have_text("No drones online.")
    async with HandDrone(relay.url, drone_id="after"):
        await expect(summary).to_have_text("1 online · 0 busy · 1 idle")
