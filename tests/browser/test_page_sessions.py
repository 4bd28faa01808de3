"""The sessions sidebar in real Chromium: sessions by last activity, renamed inline from the
keyboard, deleted after a confirmation, searched on the relay, loaded a page at a time as the
list scrolls, changed by another browser (the keyboard moving on from one it deletes), and on a
phone a drawer of whole titles."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from hangar.server.store import SessionRecord, TurnRecord
from hangar.shared.protocol import ChatMessage
from tests.browser.conftest import artifact
from tests.browser.test_page import WAIT_MS, open_hangar
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser

PERSON = "tester"


async def make_sessions(relay: RelayHandle, titles: list[str], person: str = PERSON) -> list[str]:
    """Store sessions of ``person``, the first title's the latest; returns their ids in that
    order (the sidebar's)."""
    user = await relay.relay.accounts.user(person)
    assert user is not None
    now = time.time()
    ids = []
    for n, title in enumerate(titles):
        session = SessionRecord(f"s_{n:04d}", user.user_id, title, now - 3600 - 60 * n)
        await relay.relay.store.create_session(session)
        ids.append(session.session_id)
    return ids


PLACE_IN_LIST = """(el) => Math.round(
    el.getBoundingClientRect().top - document.getElementById("sessions").getBoundingClientRect().top
)"""
"""Where a session's item is in the list's view (px from its top)."""


def item(page: Page, session_id: str) -> Locator:
    return page.locator(f'#sessions [data-session-id="{session_id}"]')


async def listed(page: Page) -> list[str]:
    found: list[str] = await page.locator("#sessions .session").evaluate_all(
        "(buttons) => buttons.map((b) => b.dataset.sessionId)"
    )
    return found


async def open_with(page: Page, relay: RelayHandle, titles: list[str]) -> list[str]:
    """Log in, store the person's sessions, load the page with them listed."""
    await open_hangar(page, relay, PERSON)
    ids = await make_sessions(relay, titles)
    await page.reload()
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    await expect(page.locator("#sessions .session").first).to_be_attached(timeout=WAIT_MS)
    return ids


async def test_a_session_is_renamed_inline_from_the_keyboard(
    page: Page, relay: RelayHandle
) -> None:
    ids = await open_with(page, relay, ["Newest", "Draft about billing", "Oldest"])
    await item(page, ids[1]).click()
    await expect(page.locator("#session-title")).to_have_text("Draft about billing")

    await item(page, ids[1]).focus()
    await page.keyboard.press("Tab")  # to its Rename button, shown while the item has focus
    rename = page.get_by_role("button", name="Rename session: Draft about billing")
    await expect(rename).to_be_focused()
    await expect(rename).to_be_visible()
    await page.keyboard.press("Enter")
    title = page.get_by_role("textbox", name="Session title")
    await expect(title).to_be_focused()
    await expect(title).to_have_value("Draft about billing")
    await page.keyboard.type("Billing: invoices per customer")  # replaces the selected title
    await page.keyboard.press("Enter")

    await expect(item(page, ids[1]).locator(".session-title")).to_have_text(
        "Billing: invoices per customer"
    )
    await expect(item(page, ids[1])).to_be_focused()
    await expect(page.locator("#session-title")).to_have_text("Billing: invoices per customer")
    # A rename is the latest activity: the session moves up (with its sessionChanged).
    sessions = page.locator("#sessions .session")
    await expect(sessions.first).to_have_attribute("data-session-id", ids[1])
    assert await listed(page) == [ids[1], ids[0], ids[2]]
    stored = await relay.relay.store.get_session(ids[1])
    assert stored is not None and stored.title == "Billing: invoices per customer"

    # Esc leaves the title as it was (and does not arm the page's Esc Esc abort).
    await page.get_by_role("button", name="Rename session: Oldest").click()
    await page.keyboard.type("Something else")
    await page.keyboard.press("Escape")
    await expect(item(page, ids[2]).locator(".session-title")).to_have_text("Oldest")
    await expect(page.locator("#toasts")).not_to_contain_text("Press Esc again")
    stored = await relay.relay.store.get_session(ids[2])
    assert stored is not None and stored.title == "Oldest"


async def test_a_rename_in_progress_stays_open_while_its_session_moves_up_the_list(
    page: Page, relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    ids = await open_with(page, relay, ["First", "Second", "Third"])
    other = await browsers(PERSON)
    await page.get_by_role("button", name="Rename session: Third").click()
    title = page.get_by_role("textbox", name="Session title")
    await page.keyboard.type("Half typed")

    # A turn starts in that session elsewhere: it is now the latest, first in the list.
    await other.submit("Asked from a phone", sessionId=ids[2])
    await expect(item(page, ids[2]).locator(".session-queued")).to_have_text("queued")
    assert (await listed(page))[0] == ids[2]

    await expect(title).to_be_focused()
    await expect(title).to_have_value("Half typed")
    await page.keyboard.type(" and finished")
    await page.keyboard.press("Enter")
    await expect(item(page, ids[2]).locator(".session-title")).to_have_text(
        "Half typed and finished"
    )
    stored = await relay.relay.store.get_session(ids[2])
    assert stored is not None and stored.title == "Half typed and finished"


async def test_deleting_a_session_asks_first_then_removes_it_everywhere(
    page: Page, relay: RelayHandle
) -> None:
    ids = await open_with(page, relay, ["Keep me", "Delete me"])
    await item(page, ids[1]).click()
    dialog = page.get_by_role("dialog", name="Delete this session?")

    await page.get_by_role("button", name="Delete session: Delete me").click()
    await expect(dialog).to_be_visible()
    await expect(dialog).to_contain_text("“Delete me” and all its turns will be deleted for good.")
    await expect(dialog.get_by_role("button", name="Cancel")).to_be_focused()
    await page.keyboard.press("Escape")
    await expect(dialog).to_be_hidden()
    await expect(item(page, ids[1])).to_be_visible()
    assert await relay.relay.store.get_session(ids[1]) is not None

    await page.get_by_role("button", name="Delete session: Delete me").click()
    await dialog.get_by_role("button", name="Delete").click()

    await expect(item(page, ids[1])).to_have_count(0)
    await expect(page.locator("#toasts")).to_contain_text("Session deleted.")
    await expect(page.locator("#session-title")).to_have_text("New session")  # it was open
    # One word of it: the relay's news of the deletion is this page's own deletion.
    await expect(page.locator("#toasts .toast", has_text="deleted")).to_have_count(1)
    assert await relay.relay.store.get_session(ids[1]) is None
    assert await listed(page) == [ids[0]]


# The relay's `sessionRemoved` comes before its answer to the deletion; this holds the news back
# until just after the answer, the other order a busy relay or network could make.
NEWS_AFTER_ANSWER = """() => {
    const socket = window.hangar.socket;
    const held = [];
    const onevent = socket.onevent.bind(socket);
    const onack = socket.onack.bind(socket);
    socket.onevent = (packet) => {
        if (packet.data?.[0] === "sessionRemoved") held.push(packet);
        else onevent(packet);
    };
    socket.onack = (packet) => {
        onack(packet);
        setTimeout(() => held.splice(0).forEach(onevent));
    };
}"""


@pytest.mark.parametrize("order", ["news-first", "answer-first"])
async def test_deleting_a_session_from_the_keyboard_moves_the_focus_to_the_next_one(
    page: Page, relay: RelayHandle, order: str
) -> None:
    ids = await open_with(page, relay, ["First", "Second", "Third"])
    if order == "answer-first":
        await page.evaluate(NEWS_AFTER_ANSWER)
    dialog = page.get_by_role("dialog", name="Delete this session?")

    delete = page.get_by_role("button", name="Delete session: Second")
    await delete.focus()
    await page.keyboard.press("Enter")
    await expect(dialog.get_by_role("button", name="Cancel")).to_be_focused()
    await page.keyboard.press("Tab")
    await expect(dialog.get_by_role("button", name="Delete")).to_be_focused()
    await page.keyboard.press("Enter")

    await expect(item(page, ids[1])).to_have_count(0)
    await expect(page.locator("#toasts")).to_contain_text("Session deleted.")
    await expect(item(page, ids[2])).to_be_focused()  # the next session, not the page's start
    assert await listed(page) == [ids[0], ids[2]]

    # The last one listed: the keyboard goes to the one before it.
    await page.keyboard.press("Tab")  # to its Rename button
    await page.keyboard.press("Tab")  # to its Delete button
    await expect(page.get_by_role("button", name="Delete session: Third")).to_be_focused()
    await page.keyboard.press("Enter")
    await dialog.get_by_role("button", name="Delete").click()
    await expect(item(page, ids[2])).to_have_count(0)
    await expect(item(page, ids[0])).to_be_focused()


async def test_a_session_whose_turn_waits_is_not_deleted_and_the_page_says_why(
    page: Page, relay: RelayHandle
) -> None:
    ids = await open_with(page, relay, ["Waiting for a drone"])
    user = await relay.relay.accounts.user(PERSON)
    assert user is not None
    turn = TurnRecord(
        "t_waiting",
        ids[0],
        user.user_id,
        "Do it",
        status="queued",
        messages=[ChatMessage(role="user", content="Do it")],
    )
    await relay.relay.store.create_turn(turn)
    await page.reload()
    await expect(item(page, ids[0]).locator(".session-queued")).to_have_text("queued")

    await page.get_by_role("button", name="Delete session: Waiting for a drone").click()

    dialog = page.get_by_role("dialog", name="Stop its turns first")
    await expect(dialog).to_contain_text("has a turn running or waiting in line")
    await expect(dialog.get_by_role("button", name="Delete")).to_have_count(0)
    await dialog.get_by_role("button", name="Close").click()
    assert await relay.relay.store.get_session(ids[0]) is not None


async def test_a_delete_asked_while_another_browser_starts_a_turn_there_is_offered_no_more(
    page: Page, relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    """The dialog offered Delete for a session another browser had started a turn in (the relay
    then refused it); it now says why not, as when the turn had started before it opened."""
    ids = await open_with(page, relay, ["First", "Second"])
    other = await browsers(PERSON)
    await page.get_by_role("button", name="Delete session: Second").click()
    asking = page.get_by_role("dialog", name="Delete this session?")
    await asking.get_by_role("button", name="Delete").focus()

    turn_id = (await other.submit("Asked from a phone", sessionId=ids[1]))["turnId"]

    told = page.get_by_role("dialog", name="Stop its turns first")
    await expect(told).to_contain_text("has a turn running or waiting in line")
    await expect(told.get_by_role("button", name="Delete")).to_have_count(0)
    await expect(told.get_by_role("button", name="Close")).to_be_focused()
    assert await listed(page) == [ids[1], ids[0]]

    await other.abort(turn_id)  # the turn ends: Delete is offered again
    await expect(asking.get_by_role("button", name="Delete")).to_be_visible()
    await expect(asking.get_by_role("button", name="Cancel")).to_be_focused()
    await page.keyboard.press("Enter")
    await expect(asking).to_be_hidden()
    assert await relay.relay.store.get_session(ids[1]) is not None


async def test_a_title_typed_to_its_limit_says_so(page: Page, relay: RelayHandle) -> None:
    """The field stopped taking characters at 200 without a word."""
    ids = await open_with(page, relay, ["Short"])
    await page.get_by_role("button", name="Rename session: Short").click()
    title = page.get_by_role("textbox", name="Session title")
    limit = page.locator("#sessions .session-rename-limit")
    await title.fill("t" * 198)
    await page.keyboard.type("i")
    await expect(limit).to_be_hidden()

    await page.keyboard.type("tle")  # one more fits
    await expect(title).to_have_value("t" * 198 + "it")
    await expect(limit).to_have_text("A title holds 200 characters at most.")
    await expect(limit).to_be_visible()
    await page.keyboard.press("Backspace")
    await expect(limit).to_be_hidden()
    await page.keyboard.type("t")
    await page.keyboard.press("Enter")
    stored = await relay.relay.store.get_session(ids[0])
    assert stored is not None and stored.title == "t" * 198 + "it"


async def test_search_asks_the_relay_and_finds_titles_and_prompts(
    page: Page, relay: RelayHandle
) -> None:
    titles = [f"Routine session {n}" for n in range(80)]
    titles[70] = "The Über deployment"
    ids = await open_with(page, relay, titles)
    user = await relay.relay.accounts.user(PERSON)
    assert user is not None
    prompt = "Where is the über config kept?"
    turn = TurnRecord("t_1", ids[75], user.user_id, prompt, status="finished", created_at=1.0)
    await relay.relay.store.create_turn(turn)  # an old turn: the session keeps its place
    assert ids[70] not in await listed(page)  # further down than the first page

    await page.fill("#sessions-search", "ÜBER")

    await expect(page.locator("#sessions .session")).to_have_count(2)
    assert await listed(page) == [ids[70], ids[75]]
    await page.fill("#sessions-search", "no such thing")
    await expect(page.locator("#sessions-empty")).to_have_text("No sessions match “no such thing”.")
    await page.focus("#sessions-search")
    await page.keyboard.press("Escape")  # clears the search
    await expect(page.locator("#sessions-search")).to_have_value("")
    await expect(page.locator("#sessions .session").first).to_have_attribute(
        "data-session-id", ids[0]
    )


async def test_more_sessions_load_as_the_list_scrolls(page: Page, relay: RelayHandle) -> None:
    ids = await open_with(page, relay, [f"Session number {n}" for n in range(120)])
    sessions = page.locator("#sessions .session")
    await expect(sessions).to_have_count(50)

    for count in (100, 120):
        await page.locator("#sessions").evaluate(
            "(list) => { list.scrollTop = list.scrollHeight; }"
        )
        await expect(sessions).to_have_count(count)

    assert await listed(page) == ids
    await expect(page.locator("#sessions .sessions-more")).to_be_hidden()  # the end


async def test_a_connection_blip_keeps_the_sessions_loaded_the_place_and_the_focus(
    page: Page, relay: RelayHandle
) -> None:
    ids = await open_with(page, relay, [f"Session number {n}" for n in range(120)])
    sessions = page.locator("#sessions .session")
    for count in (100, 120):
        await page.locator("#sessions").evaluate(
            "(list) => { list.scrollTop = list.scrollHeight; }"
        )
        await expect(sessions).to_have_count(count)
    focused = item(page, ids[100])
    await focused.focus()
    where = await focused.evaluate(PLACE_IN_LIST)
    # Deleted while this page hears nothing of it (as if during the blip).
    await relay.relay.store.delete_session(ids[3])

    await page.evaluate("() => window.hangar.socket.io.engine.close()")

    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    await expect(item(page, ids[3])).to_have_count(0, timeout=WAIT_MS)
    assert await listed(page) == ids[:3] + ids[4:]
    await expect(focused).to_be_focused()
    assert abs(await focused.evaluate(PLACE_IN_LIST) - where) <= 1  # a pixel's rounding


async def test_another_browsers_changes_show_at_once(
    page: Page, relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    ids = await open_with(page, relay, ["First", "Second", "Third"])
    other = await browsers(PERSON)

    await other.call("renameSession", {"sessionId": ids[2], "title": "Third, renamed elsewhere"})
    await expect(item(page, ids[2]).locator(".session-title")).to_have_text(
        "Third, renamed elsewhere"
    )
    assert (await listed(page))[0] == ids[2]

    await other.call("deleteSession", {"sessionId": ids[0]})
    await expect(item(page, ids[0])).to_have_count(0)

    ack = await other.submit("Asked from a phone")
    await expect(item(page, ack["sessionId"]).locator(".session-title")).to_have_text(
        "Asked from a phone"
    )
    assert (await listed(page))[0] == ack["sessionId"]
    await expect(item(page, ack["sessionId"]).locator(".session-queued")).to_have_text("queued")


async def test_a_session_deleted_elsewhere_closes_what_was_open_on_it_and_the_keyboard_moves_on(
    page: Page, relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    """Deleted by another browser while being renamed here, it took the keyboard's place with
    it (to the page's start); while its deletion was being confirmed here, the dialog stayed
    open, about a session no longer listed."""
    ids = await open_with(page, relay, ["First", "Second", "Third"])
    other = await browsers(PERSON)

    await page.get_by_role("button", name="Rename session: Second").click()
    title = page.get_by_role("textbox", name="Session title")
    await expect(title).to_be_focused()
    await page.keyboard.type(", renamed")
    await other.call("deleteSession", {"sessionId": ids[1]})
    await expect(item(page, ids[1])).to_have_count(0)
    await expect(item(page, ids[2])).to_be_focused()  # the next session

    dialog = page.get_by_role("dialog", name="Delete this session?")
    await page.get_by_role("button", name="Delete session: Third").click()
    await expect(dialog).to_be_visible()
    await other.call("deleteSession", {"sessionId": ids[2]})
    await expect(dialog).to_be_hidden()
    await expect(item(page, ids[0])).to_be_focused()  # the one before: none is after it
    await expect(page.locator("#toasts .toast.error")).to_have_count(0)
    assert await listed(page) == [ids[0]]


async def test_a_phone_lists_whole_distinct_titles_in_a_drawer(
    page: Page, relay: RelayHandle
) -> None:
    stem = "Refactor the billing service so invoices are generated per customer"
    titles = [f"{stem}, step {n}" for n in range(1, 4)]
    await page.set_viewport_size({"width": 390, "height": 844})
    ids = await open_with(page, relay, titles)
    toggle = page.locator("#sessions-toggle")
    await expect(page.locator("#sessions-panel")).to_be_hidden()

    await toggle.click()

    await expect(toggle).to_have_attribute("aria-expanded", "true")
    # The keyboard goes to the list, not to the search field (a phone's keyboard would cover it).
    await expect(page.locator("#sessions .session").first).to_be_focused()
    await expect(page.locator("#sessions-search")).not_to_be_focused()
    for session_id, title in zip(ids, titles, strict=True):
        shown = item(page, session_id).locator(".session-title")
        await expect(shown).to_be_visible()
        await expect(shown).to_have_text(title)
        await expect(shown).to_be_in_viewport(ratio=1)
        whole = await shown.evaluate("(el) => el.scrollHeight <= el.clientHeight + 1")
        assert whole, f"{title!r} is cut short"
    await page.keyboard.press("Escape")
    await expect(page.locator("#sessions-panel")).to_be_hidden()
    await expect(toggle).to_be_focused()

    await toggle.click()
    await item(page, ids[2]).click()  # choosing one closes the drawer
    await expect(page.locator("#sessions-panel")).to_be_hidden()
    await expect(toggle).to_contain_text(titles[2])


async def test_a_mangled_session_link_and_an_over_long_prompt_are_told_plainly(
    page: Page, relay: RelayHandle
) -> None:
    """A session link that is no session's says "Unknown session." (not the relay's check of
    its form), and a prompt past the limit is refused before it is sent, saying by how much,
    with the text kept to shorten."""
    await open_hangar(page, relay)
    await page.goto(relay.url + "/#s=<img src=x onerror=alert(1)>")
    toasts = page.locator("#toasts .toast.error")
    await expect(toasts).to_have_text(["Unknown session."], timeout=WAIT_MS)

    too_long = "word " * 20_001  # 100,005 characters
    await page.fill("#prompt", too_long)
    await page.press("#prompt", "Enter")

    await expect(toasts.filter(has_text="100,005 characters")).to_contain_text(
        "a prompt may have 100,000"
    )
    await expect(page.locator("#prompt")).to_have_value(too_long)
    await expect(page.locator("#turns article.turn")).to_have_count(0)
    await page.screenshot(path=artifact("prompt-too-long.png"))
