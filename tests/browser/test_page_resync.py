"""A page that falls behind, in real Chromium: the relay drops what it has not sent it, tells it
to resync, and the page opens its session again and shows the whole answer."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.async_api import Page, expect

from hangar.shared.protocol import TextDelta
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, open_hangar, output_text, submit, turn_id_of
from tests.conftest import RelayHandle, eventually

pytestmark = pytest.mark.browser

RESYNC = '"resync"'
BURST = 1200
"""Text events sent to the page at once: more than the relay queues for one browser (1,000)."""


async def test_a_page_that_fell_behind_shows_the_whole_answer_from_a_fresh_snapshot(
    page: Page, relay: RelayHandle
) -> None:
    frames: list[tuple[str, str]] = []

    def watch(socket: Any) -> None:
        socket.on("framesent", lambda payload: frames.append(("sent", str(payload))))
        socket.on("framereceived", lambda payload: frames.append(("received", str(payload))))

    page.on("websocket", watch)
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Answer at length")
        turn_id = await drone.next_order()
        assert turn_id == await turn_id_of(turn)
        await drone.text(turn_id, "Before. ")
        await expect(turn.locator(".turn-output")).to_have_text("Before.", timeout=WAIT_MS)

        # The drone's text comes faster than the page's connection takes it: the relay
        # handles these one after another without the page's writer running in between, so
        # they are all queued for it at once.
        reports = relay.relay.reports
        for i in range(BURST):
            await reports.progress(drone.drone_id, TextDelta(turn_id=turn_id, text=f"w{i} "))

        words = "".join(f"w{i} " for i in range(BURST))

        def told() -> int | None:
            found = [i for i, (way, p) in enumerate(frames) if way == "received" and RESYNC in p]
            return found[0] + 1 if found else None

        at = await eventually(told, WAIT_MS / 1000, "the relay to tell the page to resync")
        await eventually(
            lambda: [p for way, p in frames[at:] if way == "sent" and '"openSession"' in p],
            WAIT_MS / 1000,
            "the page to open its session again",
        )
        await expect(turn.locator(".turn-output")).to_contain_text(f"w{BURST - 1}", timeout=WAIT_MS)
        assert await output_text(turn) == "Before. " + words
        received = [p for way, p in frames if way == "received" and "workOrderProgress" in p]
        assert len(received) < BURST  # what it missed came in the snapshot, not event by event
