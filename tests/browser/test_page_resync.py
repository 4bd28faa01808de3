"""A page that falls behind, in real Chromium: the relay drops what it has not sent it, tells it
to resync, and the page opens its session again and shows the whole answer. A connection blip
does the same, and leaves the person reading where they were."""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.async_api import Page, WebSocketRoute, expect

from hangar.shared.protocol import TextDelta
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import (
    WAIT_MS,
    has_class,
    open_hangar,
    output_text,
    submit,
    turn_id_of,
)
from tests.conftest import RelayHandle, eventually

pytestmark = pytest.mark.browser

RESYNC = '"resync"'
BURST = 1200
"""Text events sent to the page at once: more than the relay queues for one browser (1,000)."""

OFFSET_IN_VIEW = """(id) => Math.round(
    document.querySelector(`#turns article.turn[data-turn-id="${id}"]`).getBoundingClientRect().top
    - document.getElementById("conversation").getBoundingClientRect().top
)"""
"""How far below the conversation's top a turn's card starts (negative: above it)."""

BELOW_VIEW = "(el) => el.scrollHeight - el.scrollTop - el.clientHeight"
"""How far the conversation goes on below what is in view (px)."""

SCROLL_ENDED = """(el) => new Promise((done) => {
    let last = el.scrollTop;
    let still = 0;
    const frame = () => {
        still = el.scrollTop === last ? still + 1 : 0;
        last = el.scrollTop;
        if (still >= 10) done(); else requestAnimationFrame(frame);
    };
    requestAnimationFrame(frame);
})"""
"""Resolves once a smooth scroll of ``el`` is over (ten frames without a move)."""


async def blip(page: Page, turn_id: str) -> None:
    """The page's connection drops and comes back by itself (socket.io reconnects); returns once
    the page has shown the relay's fresh snapshot of the open session (``turn_id``'s card is
    built again)."""
    await page.evaluate(
        "(id) => { window.__before = document.querySelector(`article[data-turn-id='${id}']`); }",
        turn_id,
    )
    await page.evaluate("() => window.hangar.socket.io.engine.close()")
    await page.wait_for_function(
        """(id) => {
            const card = document.querySelector(`article[data-turn-id='${id}']`);
            return card !== null && card !== window.__before;
        }""",
        arg=turn_id,
        timeout=WAIT_MS,
    )
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")


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


async def test_a_page_that_missed_text_shows_the_whole_answer_once_the_turn_ends(
    page: Page, relay: RelayHandle
) -> None:
    """Text the page never got (its relay restarted mid-answer, say, and it reconnected before
    the drone did): the ending says how long the answer is, and the page opens the session
    again instead of showing the turn finished with a piece missing."""

    def lost(frame: str) -> bool:
        return "workOrderProgress" in frame and "lost-piece" in frame

    async def drop_a_piece(route: WebSocketRoute) -> None:
        server = route.connect_to_server()
        server.on_message(lambda frame: None if lost(str(frame)) else route.send(frame))
        route.on_message(server.send)

    await page.route_web_socket(re.compile(r"/socket\.io/"), drop_a_piece)
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Answer")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Before. ")
        await expect(turn.locator(".turn-output")).to_have_text("Before.", timeout=WAIT_MS)
        await drone.text(turn_id, "lost-piece ")
        await drone.text(turn_id, "after.")
        await expect(turn.locator(".turn-output")).to_have_text("Before. after.", timeout=WAIT_MS)

        await drone.complete(turn_id, True, "Done.")

        await expect(turn).to_have_attribute("data-status", "finished", timeout=WAIT_MS)
        await expect(turn.locator(".turn-output")).to_have_text(
            "Before. lost-piece after.", timeout=WAIT_MS
        )


async def test_a_connection_blip_leaves_a_follower_following_and_a_reader_where_they_were(
    page: Page, relay: RelayHandle
) -> None:
    conversation = page.locator("#conversation")
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Answer at length")
        turn_id = await drone.next_order()
        for line in range(80):
            await drone.text(turn_id, f"line {line} of a long answer\n\n")
        await expect(turn.locator(".turn-output")).to_contain_text("line 79", timeout=WAIT_MS)

        # Following the answer: still following after the blip.
        await blip(page, turn_id)
        await drone.text(turn_id, "after the first blip\n\n")
        await expect(turn.locator(".turn-output")).to_contain_text("after the first blip")
        await page.wait_for_function(
            f"() => ({BELOW_VIEW})(document.getElementById('conversation')) < 4", timeout=WAIT_MS
        )

        # Scrolled up to read: still there after the blip, offered the way down.
        await conversation.hover()
        await page.mouse.wheel(0, -1000)
        await page.wait_for_function(
            f"() => ({BELOW_VIEW})(document.getElementById('conversation')) >= 1000",
            timeout=WAIT_MS,
        )
        await conversation.evaluate(SCROLL_ENDED)
        where = await page.evaluate(OFFSET_IN_VIEW, turn_id)
        await blip(page, turn_id)
        await drone.text(turn_id, "after the second blip\n\n")
        await expect(turn.locator(".turn-output")).to_contain_text("after the second blip")
        await expect(page.locator("#jump-latest")).to_be_visible()
        assert abs(await page.evaluate(OFFSET_IN_VIEW, turn_id) - where) <= 1
        assert await conversation.evaluate(BELOW_VIEW) >= 1000
        await drone.complete(turn_id, True, "Done.")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
