"""A long session in real Chromium: it opens with its latest turns, and the earlier ones come as
the person scrolls up, the view staying where it was."""

from __future__ import annotations

import time

import pytest
from playwright.async_api import Page, expect

from hangar.server.store import Ending, SessionRecord, TurnRecord
from hangar.shared.protocol import ChatMessage
from tests.browser.test_page import WAIT_MS, open_hangar
from tests.conftest import RelayHandle

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
