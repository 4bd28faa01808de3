"""How the page feels around a running turn, in real Chromium: the conversation follows a
streaming answer unless the person scrolls up (then "Jump to latest" brings them back), every
way of aborting leaves the keyboard in the prompt, and "Aborting…" shows from the click until
the turn has ended, also when the drone is slow to answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from bench.peers import OpenAIPeer, Reply
from tests.browser.conftest import artifact
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import (
    ABORTED_STATUS,
    SLOW,
    WAIT_MS,
    assert_idle_controls,
    assert_not_red,
    has_class,
    open_hangar,
    stored,
    submit,
    turn_id_of,
)
from tests.conftest import RelayHandle, Upstream

pytestmark = pytest.mark.browser

ESC_HINT_QUEUED = "Press Esc again to cancel the queued turn"

CANCELLED_STATUS = "Cancelled before it started."

# A tall answer: one paragraph per line, slow enough to act on while it streams (~6 s).
TALL = Reply(chunks=[f"Line {i} of a tall answer.\n\n" for i in range(200)], delay=0.03)


async def distance_from_bottom(page: Page) -> float:
    """How far (px) the conversation is scrolled from its bottom."""
    distance: float = await page.evaluate(
        """() => {
            const el = document.getElementById("conversation");
            return el.scrollHeight - el.scrollTop - el.clientHeight;
        }"""
    )
    return distance


async def scroll_top(page: Page) -> float:
    top: float = await page.evaluate("() => document.getElementById('conversation').scrollTop")
    return top


async def abort_with_cancel(page: Page, turn: Locator) -> None:
    await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 w2 ", timeout=WAIT_MS)
    await page.click("#cancel")
    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)


async def test_a_new_prompt_after_three_aborted_turns_is_followed_while_it_streams(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(SLOW, SLOW, SLOW, TALL)
    await start_drone(Upstream("openai", openai_peer))
    await page.set_viewport_size({"width": 1280, "height": 640})
    await open_hangar(page, relay)
    for n in range(3):
        await abort_with_cancel(page, await submit(page, f"Aborted turn {n}"))
    await assert_idle_controls(page)

    fourth = await submit(page, "Now a tall answer")

    await expect(fourth.locator(".turn-prompt")).to_be_in_viewport()
    for line in (20, 60, 100):
        await expect(fourth.locator(".turn-output")).to_contain_text(
            f"Line {line} of", timeout=WAIT_MS
        )
        # The card's foot ("Working…") is its bottom: still in view while it grows.
        await expect(fourth.locator(".turn-foot")).to_be_in_viewport()
        assert await distance_from_bottom(page) < 80
    await expect(page.locator("#jump-latest")).to_be_hidden()


async def test_scrolling_up_stops_following_and_jump_to_latest_brings_it_back(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(TALL)
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    turn = await submit(page, "A tall answer")
    output = turn.locator(".turn-output")
    await expect(output).to_contain_text("Line 40 of", timeout=WAIT_MS)
    jump = page.locator("#jump-latest")
    await expect(jump).to_be_hidden()

    await page.locator("#conversation").hover()
    await page.mouse.wheel(0, -600)
    await page.wait_for_function("() => document.getElementById('conversation').scrollTop > 0")
    await expect(jump).to_be_visible(timeout=WAIT_MS)  # new lines arrive below the view
    await expect(jump).to_have_accessible_name("Jump to latest")
    await page.screenshot(path=artifact("jump-to-latest.png"))
    held = await scroll_top(page)
    await expect(output).to_contain_text("Line 80 of", timeout=WAIT_MS)
    assert await scroll_top(page) == held, "the view stays where the person scrolled to"
    await expect(turn.locator(".turn-foot")).not_to_be_in_viewport()

    await jump.click()

    await expect(jump).to_be_hidden()
    await expect(output).to_contain_text("Line 120 of", timeout=WAIT_MS)
    await expect(turn.locator(".turn-foot")).to_be_in_viewport()
    assert await distance_from_bottom(page) < 80
    await expect(page.locator("#prompt")).to_be_focused()

    # Scrolled up when the turn ends: the cue says so too.
    await page.locator("#conversation").hover()
    await page.mouse.wheel(0, -600)
    await expect(jump).to_be_visible(timeout=WAIT_MS)
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(jump).to_be_visible()
    await jump.click()
    await expect(turn.locator(".turn-foot")).to_be_in_viewport()
    await expect(jump).to_be_hidden()


async def test_every_way_of_aborting_leaves_the_keyboard_in_the_prompt(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(SLOW, SLOW, SLOW, SLOW)
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    prompt = page.locator("#prompt")
    cancel = page.locator("#cancel")

    async def running(text: str) -> Locator:
        turn = await submit(page, text)
        await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 ", timeout=WAIT_MS)
        return turn

    async def ends_with_focus_in_prompt(turn: Locator) -> None:
        await expect(prompt).to_be_focused()
        await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        await expect(turn.locator(".turn-status")).to_have_text(ABORTED_STATUS)
        await expect(cancel).to_be_hidden()
        await expect(prompt).to_be_focused()

    turn = await running("Abort me with a click")
    await cancel.click()
    await ends_with_focus_in_prompt(turn)

    for key in ("Enter", "Space"):
        turn = await running(f"Abort me with {key}")
        await cancel.focus()
        await page.keyboard.press(key)
        await ends_with_focus_in_prompt(turn)

    turn = await running("Abort me with Esc Esc")
    await page.locator("#conversation").focus()
    await page.keyboard.press("Escape")
    await page.keyboard.press("Escape")
    await ends_with_focus_in_prompt(turn)
    await assert_idle_controls(page)


async def record_toasts(page: Page) -> None:
    """Record, from now on, the most toasts shown at once and every text a toast showed."""
    await page.evaluate(
        """() => {
            const box = document.getElementById("toasts");
            const seen = (window.__toasts = { most: 0, texts: [] });
            new MutationObserver(() => {
                const shown = [...box.querySelectorAll(".toast:not(.leaving)")];
                seen.most = Math.max(seen.most, shown.length);
                for (const el of shown) {
                    if (seen.texts.at(-1) !== el.textContent) seen.texts.push(el.textContent);
                }
            }).observe(box, { childList: true, subtree: true, characterData: true });
        }"""
    )


async def test_aborting_shows_from_the_click_until_a_slow_drone_ends_the_turn(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        cancel = page.locator("#cancel")

        # Cancel clicked: the drone takes its time to answer.
        turn = await submit(page, "Think slowly")
        turn_id = await drone.next_order()
        assert turn_id == await turn_id_of(turn)
        await drone.text(turn_id, "Thinking about it")
        await expect(turn.locator(".turn-output")).to_have_text("Thinking about it")
        drone.answer_aborts.clear()
        await cancel.click()

        await expect(cancel).to_have_text("Aborting…")
        await expect(cancel).to_be_visible()
        await expect(cancel).to_be_disabled()
        await expect(page.locator("#prompt")).to_be_focused()
        await drone.abort_asked.wait()
        await expect(cancel).to_have_text("Aborting…")  # still, while the drone has not answered
        await expect(turn).to_have_class(has_class("processing"))
        drone.answer_aborts.set()
        await expect(cancel).to_have_text("Aborting…")  # answered, but the turn has not ended
        await expect(cancel).to_be_visible()
        await drone.complete(turn_id, True, "aborted")
        await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        await expect(cancel).to_be_hidden()
        await assert_idle_controls(page)
        await expect(page.locator("#toasts .toast")).to_have_count(0)

        # Esc Esc: the warning toast becomes the "Aborting…" toast; never two toasts at once.
        drone.abort_asked.clear()
        drone.answer_aborts.clear()
        turn = await submit(page, "Think slowly again")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Still thinking")
        await expect(turn.locator(".turn-output")).to_have_text("Still thinking")
        await record_toasts(page)
        await page.keyboard.press("Escape")
        toasts = page.locator("#toasts .toast:not(.leaving)")
        await expect(toasts).to_have_text(["Press Esc again to abort"])
        await page.keyboard.press("Escape")
        await expect(toasts).to_have_text(["Aborting…"])
        await expect(cancel).to_have_text("Aborting…")
        await drone.abort_asked.wait()
        drone.answer_aborts.set()
        await drone.complete(turn_id, True, "aborted")
        await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        await expect(page.locator("#toasts .toast")).to_have_count(0, timeout=2_000)
        seen: dict[str, Any] = await page.evaluate("() => window.__toasts")
        assert seen["most"] == 1, seen
        assert seen["texts"] == ["Press Esc again to abort", "Aborting…"], seen
        await expect(page.locator("#prompt")).to_be_focused()


async def test_a_queued_turn_cancelled_before_it_started_reads_cancelled_not_aborted(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:  # one slot: the first turn takes it
        await open_hangar(page, relay)
        first = await submit(page, "Take the only drone")
        first_turn = await drone.next_order()
        await expect(first).to_have_class(has_class("processing"))
        first_session = await page.evaluate("() => window.hangar.currentSessionId()")

        await page.click("#new-session")
        waiting = await submit(page, "Wait in line, then be cancelled")
        await expect(waiting).to_have_class(has_class("queued"))
        await waiting.get_by_role("button", name="Cancel queued turn").click()
        await expect(waiting).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        await expect(waiting.locator(".turn-status")).to_have_text(CANCELLED_STATUS)
        await expect(page.locator("#announcer")).to_have_text("Turn cancelled before it started.")
        await assert_not_red(waiting)

        await page.reload()  # the relay's snapshot of it says the same
        await expect(waiting.locator(".turn-status")).to_have_text(CANCELLED_STATUS)
        await assert_not_red(waiting)

        # The turn that had started is aborted, and says so.
        await page.locator(f'#sessions [data-session-id="{first_session}"]').click()
        await page.click("#cancel")
        await asyncio.wait_for(drone.abort_asked.wait(), WAIT_MS / 1000)
        await drone.complete(first_turn, True, "aborted")
        await expect(first.locator(".turn-status")).to_have_text(ABORTED_STATUS)


async def busy_drone_and_a_queued_turn(
    page: Page, relay: RelayHandle, drone: HandDrone
) -> tuple[str, Locator]:
    """The only drone busy with a turn of another session (the id returned), and a new
    session whose prompt waits in line for it (its card returned)."""
    await open_hangar(page, relay)
    first = await submit(page, "Take the only drone")
    first_turn = await drone.next_order()
    await expect(first).to_have_class(has_class("processing"))
    await page.click("#new-session")
    waiting = await submit(page, "Wait in line")
    await expect(waiting).to_have_class(has_class("queued"))
    await expect(waiting.locator(".turn-status")).to_contain_text("Queued: next in line")
    await expect(page.locator("#cancel")).to_be_hidden()
    return first_turn, waiting


async def test_esc_esc_cancels_the_sessions_turn_waiting_in_line(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:  # one slot: the first turn takes it
        first_turn, waiting = await busy_drone_and_a_queued_turn(page, relay, drone)
        await record_toasts(page)
        toasts = page.locator("#toasts .toast:not(.leaving)")

        await page.keyboard.press("Escape")
        await expect(toasts).to_have_text([ESC_HINT_QUEUED])
        await page.keyboard.press("Escape")

        await expect(waiting).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        await expect(waiting.locator(".turn-status")).to_have_text(CANCELLED_STATUS)
        await expect(page.locator("#toasts .toast")).to_have_count(0, timeout=WAIT_MS)
        seen: dict[str, Any] = await page.evaluate("() => window.__toasts")
        assert seen["most"] == 1, seen
        assert seen["texts"] == [ESC_HINT_QUEUED, "Cancelling…"], seen
        await expect(page.locator("#prompt")).to_be_focused()
        assert drone.aborts == [], "the other session's running turn is left alone"
        assert (await stored(relay, first_turn)).status == "processing"
        await assert_idle_controls(page)


async def test_esc_then_esc_aborts_a_turn_that_started_between_the_two_presses(
    page: Page, relay: RelayHandle
) -> None:
    """The first Esc lands while the turn still waits in line (as right after Enter), the
    second once it has started: the turn is aborted."""
    async with HandDrone(relay.url) as drone:
        first_turn, waiting = await busy_drone_and_a_queued_turn(page, relay, drone)
        toasts = page.locator("#toasts .toast:not(.leaving)")

        await page.keyboard.press("Escape")
        await expect(toasts).to_have_text([ESC_HINT_QUEUED])
        await drone.complete(first_turn, True, "done")  # the drone is free: the turn starts
        waiting_id = await drone.next_order()
        assert waiting_id == await turn_id_of(waiting)
        await expect(waiting).to_have_class(has_class("processing"), timeout=WAIT_MS)
        await expect(toasts).to_have_text([ESC_HINT_QUEUED])
        await page.keyboard.press("Escape")

        await expect(toasts).to_have_text(["Aborting…"])
        await asyncio.wait_for(drone.abort_asked.wait(), WAIT_MS / 1000)
        assert [a["turnId"] for a in drone.aborts] == [waiting_id]
        await drone.complete(waiting_id, True, "aborted")
        await expect(waiting.locator(".turn-status")).to_have_text(ABORTED_STATUS)
        await assert_idle_controls(page)


async def test_esc_esc_stops_the_running_turn_not_the_follow_up_queued_behind_it(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        running = await submit(page, "Run first")
        running_id = await drone.next_order()
        await expect(running).to_have_class(has_class("processing"))
        follow_up = await submit(page, "Then this")
        await expect(follow_up).to_have_class(has_class("queued"))

        await page.keyboard.press("Escape")
        await page.keyboard.press("Escape")

        await asyncio.wait_for(drone.abort_asked.wait(), WAIT_MS / 1000)
        assert [a["turnId"] for a in drone.aborts] == [running_id]
        await drone.complete(running_id, True, "aborted")
        await expect(running.locator(".turn-status")).to_have_text(ABORTED_STATUS)
        follow_up_id = await drone.next_order()  # the follow-up runs after it
        assert follow_up_id == await turn_id_of(follow_up)
        await expect(follow_up).to_have_class(has_class("processing"), timeout=WAIT_MS)
