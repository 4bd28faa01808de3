"""A long session in real Chromium: it opens with its latest turns, and the earlier ones come as
the person scrolls up, the view staying where it was (also when the session was left and opened
again while they were on their way); a connection blip keeps the turns loaded and the place."""

from __future__ import annotations

import re
import time

import pytest
from playwright.async_api import Page, WebSocketRoute, expect

from hangar.server.store import Ending, SessionRecord, TurnRecord
from hangar.shared.protocol import ChatMessage
from tests.browser.test_page import WAIT_MS, open_hangar
from tests.browser.test_page_resync import BELOW_VIEW, OFFSET_IN_VIEW, blip
from tests.conftest import RelayHandle, eventually

pytestmark = pytest.mark.browser


async def a_long_session(relay: RelayHandle, turns: int) -> str:
    user = await relay.relay.accounts.user("tester")
    assert user is not None
    store = relay.relay.store
    now = time.time()
    await store.create_session(SessionRecord("s_long", user.user_id, "A long one", now - 9000))
    for number in range(turns):
        turn = TurnRecord(
            f"t_{number:03d}",
            "s_long",
            user.user_id,
            f"question {number}",
            created_at=now - 9000 + number,
            messages=[ChatMessage(role="user", content=f"question {number}")],
        )
        await store.create_turn(turn)
        answer = ChatMessage(role="assistant", content=f"answer {number}")
        await store.add_message(turn.turn_id, answer, 0)
        await store.end_turn(turn.turn_id, Ending("finished", "done", "finished"))
    return "s_long"


async def test_a_long_session_shows_its_latest_turns_and_earlier_ones_on_scrolling_up(
    page: Page, relay: RelayHandle
) -> None:
    await open_hangar(page, relay)
    await a_long_session(relay, 45)
    await page.reload()
    await page.locator('#sessions [data-session-id="s_long"]').click()
    cards = page.locator("#turns article.turn")
    await expect(cards).to_have_count(30, timeout=WAIT_MS)
    await expect(cards.first).to_contain_text("question 15")
    await expect(cards.last).to_contain_text("answer 44")
    earlier = page.locator("#turns .earlier button")
    await expect(earlier).to_have_text("Show earlier turns")

    await page.locator("#conversation").evaluate("(el) => { el.scrollTop = 0; }")

    await expect(cards).to_have_count(45, timeout=WAIT_MS)
    await expect(page.locator("#turns .earlier")).to_have_count(0)
    texts = await cards.all_inner_texts()
    assert [int(t.split("question ")[1].split()[0]) for t in texts] == list(range(45))
    # What the person was looking at stays in view: the earlier turns appear above it.
    kept = cards.filter(has_text="question 15")
    assert await kept.evaluate(
        """(el) => {
          const view = document.getElementById("conversation").getBoundingClientRect();
          const box = el.getBoundingClientRect();
          return box.bottom > view.top && box.top < view.bottom;
        }"""
    )


async def test_earlier_turns_on_their_way_as_the_session_is_opened_again_still_all_come(
    page: Page, relay: RelayHandle
) -> None:
    held: list[str | bytes] = []
    relays: list[WebSocketRoute] = []

    async def hold_the_first_ask_for_earlier_turns(route: WebSocketRoute) -> None:
        server = route.connect_to_server()
        relays.append(server)

        def to_relay(frame: str | bytes) -> None:
            if not held and '"openSession"' in str(frame) and '"before"' in str(frame):
                held.append(frame)  # a slow relay: its answer comes after the session reopens
            else:
                server.send(frame)

        route.on_message(to_relay)

    await page.route_web_socket(re.compile(r"/socket\.io/"), hold_the_first_ask_for_earlier_turns)
    await open_hangar(page, relay)
    await a_long_session(relay, 75)
    await page.reload()
    session = page.locator('#sessions [data-session-id="s_long"]')
    await session.click()
    cards = page.locator("#turns article.turn")
    await expect(cards).to_have_count(30, timeout=WAIT_MS)
    earlier = page.locator("#turns .earlier")
    show_earlier = earlier.get_by_role("button", name="Show earlier turns")
    await show_earlier.click()
    await expect(earlier).to_have_text("Loading earlier turns…")
    await eventually(lambda: held, WAIT_MS / 1000, "the page to ask for earlier turns")

    await page.click("#new-session")
    await session.click()
    await expect(cards).to_have_count(30, timeout=WAIT_MS)
    await expect(show_earlier).to_be_visible()
    relays[-1].send(held[0])  # the answer for the list shown before comes now

    await show_earlier.click()
    await expect(cards).to_have_count(60, timeout=WAIT_MS)
    await show_earlier.click()
    await expect(cards).to_have_count(75, timeout=WAIT_MS)
    await expect(earlier).to_have_count(0)
    texts = await cards.all_inner_texts()
    assert [int(t.split("question ")[1].split()[0]) for t in texts] == list(range(75))


async def test_a_connection_blip_keeps_the_earlier_turns_loaded_and_the_place_read(
    page: Page, relay: RelayHandle
) -> None:
    await open_hangar(page, relay)
    await a_long_session(relay, 75)
    await page.reload()
    await page.locator('#sessions [data-session-id="s_long"]').click()
    cards = page.locator("#turns article.turn")
    await expect(cards).to_have_count(30, timeout=WAIT_MS)
    conversation = page.locator("#conversation")
    await conversation.evaluate("(el) => { el.scrollTop = 0; }")
    await expect(cards).to_have_count(60, timeout=WAIT_MS)
    # Reading turn 30, some way down what is loaded.
    await page.locator('#turns article.turn[data-turn-id="t_030"]').evaluate(
        "(el) => el.scrollIntoView()"
    )
    where = await page.evaluate(OFFSET_IN_VIEW, "t_030")
    below = await conversation.evaluate(BELOW_VIEW)

    await blip(page, "t_074")

    await expect(cards).to_have_count(60)
    assert abs(await page.evaluate(OFFSET_IN_VIEW, "t_030") - where) <= 1
    assert abs(await conversation.evaluate(BELOW_VIEW) - below) <= 1
    # And the turns before those still come.
    await page.locator("#turns .earlier").get_by_role("button", name="Show earlier turns").click()
    await expect(cards).to_have_count(75, timeout=WAIT_MS)
