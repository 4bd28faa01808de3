"""The page with the relay's queue, in real Chromium: turns waiting in line and cancelled there,
follow-ups queued or sent as an interrupt, "Stop after this step", why a turn ended (the
operator's Ctrl-C, someone else's abort) and the tokens it used."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.shared.protocol import TOOL_CANCELLED
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
from tests.conftest import Browser, RelayHandle, Upstream

pytestmark = pytest.mark.browser


RECORD_STATUSES = """(root) => {
    // Every turn card in root (or root itself), and those added to it later.
    const seen = (window.__seen ??= {});
    const record = () => {
        const cards = root.matches("article.turn") ? [root] : root.querySelectorAll("article.turn");
        for (const card of cards) {
            const mine = (seen[card.dataset.turnId] ??= { statuses: [], feet: [] });
            const status = card.dataset.status;
            if (mine.statuses.at(-1) !== status) mine.statuses.push(status);
            mine.feet.push(card.querySelector(".turn-foot").textContent);
        }
    };
    record();
    new MutationObserver(record).observe(root, {
        attributes: true, childList: true, characterData: true, subtree: true,
    });
}"""


async def record_statuses(page: Page, turn: Locator | None = None) -> None:
    """Record every status a turn's card passes through, and every text its foot shows: of
    ``turn``, or of every card shown from now on."""
    await (turn or page.locator("#turns")).evaluate(RECORD_STATUSES)


async def seen(page: Page, turn_id: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = await page.evaluate("(id) => window.__seen[id]", turn_id)
    return found


async def session_item(page: Page) -> Locator:
    session_id = await page.evaluate("() => window.hangar.currentSessionId()")
    assert session_id
    return page.locator(f'#sessions [data-session-id="{session_id}"]')


async def wait_until_listed(page: Page, process: subprocess.Popen[Any], name: str) -> None:
    """Wait for a drone subprocess to show in the drone picker."""
    listed = page.locator("#drone option", has_text=name)
    deadline = asyncio.get_running_loop().time() + 30
    while await listed.count() == 0:
        assert process.poll() is None, f"the drone process exited early ({process.returncode})"
        assert asyncio.get_running_loop().time() < deadline, "the drone process never connected"
        await asyncio.sleep(0.05)


async def test_a_prompt_waits_in_line_for_the_busy_drone_and_can_be_cancelled_there(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browsers: Callable[..., Any],
) -> None:
    openai_peer.script(SLOW, Reply(chunks=["Second ", "answer."]))
    drone = await start_drone(Upstream("openai", openai_peer))  # one slot
    await open_hangar(page, relay)
    first = await submit(page, "First, a long essay")
    await expect(first.locator(".turn-output")).to_contain_text("w0 w1 ", timeout=WAIT_MS)
    first_id = await turn_id_of(first)
    first_item = await session_item(page)

    await page.click("#new-session")
    second = await submit(page, "Second, in a session of its own")
    second_id = await turn_id_of(second)
    await expect(second).to_have_class(has_class("queued"))
    await expect(second.locator(".turn-status")).to_have_text(
        "Queued: next in line · for any drone"
    )
    await expect(page.locator("#prompt")).to_be_focused()
    await expect(page.locator("#submit")).to_have_text("Queue")
    await expect(page.locator("#cancel")).to_be_hidden()  # nothing runs in this session
    second_item = await session_item(page)
    await expect(second_item.locator(".session-queued")).to_have_text("queued")
    await expect(first_item.locator(".session-working")).to_have_text("working")
    await assert_not_red(second)
    await expect(second).not_to_have_class(has_class("aborted"))

    # A third waits for the drone by name: the second is ahead of it.
    await page.click("#new-session")
    await page.select_option("#drone", drone.drone_id)
    third = await submit(page, "Third, for that drone")
    third_id = await turn_id_of(third)
    await expect(third.locator(".turn-status")).to_have_text(
        f"Queued: 2nd in line · for {drone.config.name} (gpt-test)"
    )

    # Its own Cancel, from the keyboard, is named after its prompt.
    cancel = third.get_by_role("button", name="Cancel queued turn: Third, for that drone")
    await cancel.focus()
    await page.keyboard.press("Enter")
    await expect(third).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(third.locator(".turn-status")).to_have_text("Cancelled before it started.")
    await assert_not_red(third)
    await expect(page.locator("#prompt")).to_be_focused()
    await expect(page.locator("#toasts .toast.error")).to_have_count(0)
    assert (await stored(relay, third_id)).status == "aborted"
    assert (await stored(relay, second_id)).status == "queued"

    # Back in the second session, its snapshot tells the same place.
    await second_item.click()
    await expect(second.locator(".turn-status")).to_have_text(
        "Queued: next in line · for any drone"
    )
    # The first ends (aborted from another of the person's browsers): the second starts.
    other: Browser = await browsers("tester")
    assert (await other.abort(first_id))[0] is True
    await expect(second).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(second.locator(".turn-output")).to_have_text("Second answer.")
    await expect(second_item.locator(".session-queued")).to_have_count(0)
    ended, started = await stored(relay, first_id), await stored(relay, second_id)
    assert ended.status == "aborted" and ended.ended_at is not None
    assert started.started_at is not None and started.started_at >= ended.ended_at


async def test_enter_queues_a_follow_up_that_runs_after_the_turn(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(
        Reply(chunks=["First ", "part, ", "then ", "the rest."], stall_after=(2, 3.0)),
        Reply(chunks=["Follow-up ", "answered."]),
    )
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    first = await submit(page, "Start something")
    await expect(first.locator(".turn-output")).to_have_text("First part, ", timeout=WAIT_MS)
    await expect(page.locator("#submit")).to_have_text("Queue")
    await expect(page.locator("#interrupt")).to_be_visible()
    await expect(page.locator("#prompt")).to_be_enabled()

    follow_up = await submit(page, "And then this")

    await expect(follow_up).to_have_class(has_class("queued"))
    await expect(follow_up.locator(".turn-status")).to_have_text(
        "Queued: waits for the turn before it · for any drone"
    )
    await expect(first).to_have_class(has_class("processing"))
    await expect(page.locator("#prompt")).to_be_focused()
    await expect(page.locator("#prompt")).to_have_value("")
    await expect(first).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(follow_up).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(follow_up.locator(".turn-output")).to_have_text("Follow-up answered.")
    await expect(page.locator("#sessions .session")).to_have_count(1)
    await assert_idle_controls(page)
    before, after = (
        await stored(relay, await turn_id_of(first)),
        await stored(relay, await turn_id_of(follow_up)),
    )
    assert before.session_id == after.session_id
    assert before.ended_at is not None and after.started_at is not None
    assert after.started_at >= before.ended_at
    request = openai_peer.requests[-1]
    assert request.rejected is None
    assert [(m["role"], m["content"]) for m in request.messages if m["role"] != "system"] == [
        ("user", "Start something"),
        ("assistant", "First part, then the rest."),
        ("user", "And then this"),
    ]


async def test_ctrl_enter_interrupts_the_turn_and_sends_the_prompt(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(SLOW, Reply(chunks=["Interrupted, ", "then ", "answered."], delay=0.05))
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    first = await submit(page, "Write forever")
    await expect(first.locator(".turn-output")).to_contain_text("w0 w1 w2 ", timeout=WAIT_MS)
    interrupt = page.locator("#interrupt")
    await expect(interrupt).to_contain_text("Interrupt and send")
    await expect(interrupt.locator("kbd")).to_have_text("Ctrl+Enter")
    await expect(page.locator(".shortcuts")).to_contain_text("Ctrl+Enter interrupt and send")

    await page.fill("#prompt", "Stop that, answer this")
    await record_statuses(page)  # the second turn may end before the test sees its card
    await page.press("#prompt", "Control+Enter")

    turns = page.locator("#turns article.turn")
    await expect(turns).to_have_count(2, timeout=WAIT_MS)
    second = turns.nth(1)
    await expect(first).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(first.locator(".turn-status")).to_have_text(ABORTED_STATUS)
    await expect(first.locator(".turn-usage")).to_have_text(re.compile(r"^about \d"))
    await assert_not_red(first)
    await expect(second).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(second.locator(".turn-output")).to_have_text("Interrupted, then answered.")
    assert "processing" in (await seen(page, await turn_id_of(second)))["statuses"]
    await expect(page.locator("#prompt")).to_be_focused()
    await assert_idle_controls(page)
    assert len(openai_peer.requests) == 2
    request = openai_peer.requests[-1]
    assert request.rejected is None
    history = [(m["role"], m["content"]) for m in request.messages if m["role"] != "system"]
    assert history[0] == ("user", "Write forever")
    assert history[1][0] == "assistant" and history[1][1].startswith("w0 w1 w2 ")
    assert history[-1] == ("user", "Stop that, answer this")


async def test_ctrl_enter_runs_next_and_shows_ahead_of_a_follow_up_queued_before_it(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(
        SLOW, Reply(chunks=["Now ", "this."], delay=0.3), Reply(chunks=["Then that."])
    )
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    first = await submit(page, "Write forever")
    await expect(first.locator(".turn-output")).to_contain_text("w0 w1 ", timeout=WAIT_MS)
    follow_up = await submit(page, "Then that")
    await expect(follow_up).to_have_class(has_class("queued"))

    await page.fill("#prompt", "Now this")
    await page.press("#prompt", "Control+Enter")

    turns = page.locator("#turns article.turn")
    await expect(turns).to_have_count(3, timeout=WAIT_MS)
    await expect(turns.locator(".turn-prompt")).to_have_text(
        ["Write forever", "Now this", "Then that"]
    )
    await expect(turns.nth(1)).to_have_class(has_class("processing"), timeout=WAIT_MS)
    await expect(follow_up).to_have_class(has_class("queued"))
    await expect(follow_up).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(turns.nth(1).locator(".turn-output")).to_have_text("Now this.")
    await page.reload()
    await expect(page.locator("#turns article.turn .turn-prompt")).to_have_text(
        ["Write forever", "Now this", "Then that"], timeout=WAIT_MS
    )


ENDINGS = {
    "operator": "The drone's operator stopped it.",  # Ctrl-C in the drone's terminal
    "shutdown": "Aborted: the drone was shut down.",  # SIGTERM (a service manager's stop)
    "unanswered": "Aborted: the drone did not stop it in time, so the relay ended the turn.",
}


@pytest.mark.parametrize("reason", list(ENDINGS))
async def test_an_abort_ended_by_the_drone_or_the_relay_says_why_in_yellow(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[Any]],
    reason: str,
) -> None:
    openai_peer.script(SLOW)
    await open_hangar(page, relay)
    process = drone_process(Upstream("openai", openai_peer), server=relay.url, name="operated")
    await wait_until_listed(page, process, "operated")
    turn = await submit(page, "Work until told otherwise")
    turn_id = await turn_id_of(turn)
    await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 w2 ", timeout=WAIT_MS)
    await record_statuses(page, turn)

    if reason == "unanswered":  # a frozen drone: the person's Cancel, ended by the relay
        process.send_signal(signal.SIGSTOP)
        try:
            await page.click("#cancel")
            await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        finally:
            process.send_signal(signal.SIGCONT)
    else:
        process.send_signal(signal.SIGINT if reason == "operator" else signal.SIGTERM)
        await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        assert await asyncio.to_thread(process.wait, 10) is not None

    await expect(turn.locator(".turn-status")).to_have_text(ENDINGS[reason])
    await assert_not_red(turn)
    record = await stored(relay, turn_id)
    assert record.status == "aborted" and record.reason == reason
    shown = await seen(page, turn_id)
    assert shown["statuses"] == ["processing", "aborted"], shown
    assert not [text for text in shown["feet"] if "by you" in text], shown
    await assert_idle_controls(page)


async def a_command_running(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    tmp_path: Path,
    command: str,
) -> tuple[Locator, str, Locator]:
    """A turn whose model asks for ``command`` (then, if asked again, answers what a stop
    should prevent), shown once the command runs: the turn, its id, its tool line."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": command})]),
        Reply(chunks=["A second model call the stop should prevent."]),
    )
    await start_drone(Upstream("openai", openai_peer), workdir=str(tmp_path))
    await open_hangar(page, relay)
    turn = await submit(page, "Run a slow command")
    tool = turn.locator(".tool")
    await expect(tool).to_have_attribute("data-state", "start", timeout=WAIT_MS)
    return turn, await turn_id_of(turn), tool


async def test_stop_after_this_step_keeps_the_running_tools_result(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    tmp_path: Path,
) -> None:
    turn, turn_id, tool = await a_command_running(
        page, relay, openai_peer, start_drone, tmp_path, "sleep 1; echo done"
    )
    stop = page.locator("#stop-after-step")
    await expect(stop).to_have_text("Stop after this step")

    await stop.click()

    await expect(stop).to_have_text("Stop now")
    await expect(turn.locator(".turn-status")).to_have_text("Stopping after this step…")
    await expect(turn).to_have_class(has_class("processing"))
    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text(ABORTED_STATUS)
    await assert_not_red(turn)
    await expect(tool).to_have_attribute("data-state", "end")
    await expect(tool.locator(".tool-result-body")).to_contain_text("done")
    await assert_idle_controls(page)
    assert len(openai_peer.requests) == 1, "no model call after the step"
    record = await stored(relay, turn_id, "aborted")
    results = [m.content for m in record.messages if m.role == "tool"]
    assert len(results) == 1 and "done" in results[0] and results[0] != TOOL_CANCELLED


async def test_stop_now_after_stop_after_this_step_aborts_at_once(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    tmp_path: Path,
) -> None:
    turn, turn_id, _ = await a_command_running(
        page, relay, openai_peer, start_drone, tmp_path, "sleep 60; echo never"
    )
    stop = page.locator("#stop-after-step")
    await stop.click()
    await expect(stop).to_have_text("Stop now")

    await stop.click()  # the step takes too long: the second press does not wait for it

    await expect(turn).to_have_class(has_class("aborted"), timeout=5_000)  # not the 60 s
    await expect(turn.locator(".turn-status")).to_have_text(ABORTED_STATUS)
    await assert_not_red(turn)
    await assert_idle_controls(page)
    record = await stored(relay, turn_id, "aborted")
    assert [m.content for m in record.messages if m.role == "tool"] == [TOOL_CANCELLED]
    assert len(openai_peer.requests) == 1


async def test_stop_after_this_step_shows_in_every_tab_and_after_a_reload(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """Every tab on the session says the turn stops after its step (live, and after a reload),
    and offers to stop it now, which any of them can."""
    turn, turn_id, _ = await a_command_running(
        page, relay, openai_peer, start_drone, tmp_path, "sleep 60; echo never"
    )
    other = await page.context.new_page()
    await other.goto(page.url)
    theirs = other.locator(f'#turns article.turn[data-turn-id="{turn_id}"]')
    await expect(theirs).to_have_class(has_class("processing"), timeout=WAIT_MS)

    await page.locator("#stop-after-step").click()

    for tab, card in ((page, turn), (other, theirs)):
        await expect(card.locator(".turn-status")).to_have_text("Stopping after this step…")
        await expect(tab.locator("#stop-after-step")).to_have_text("Stop now")
    await page.reload()
    await expect(turn.locator(".turn-status")).to_have_text(
        "Stopping after this step…", timeout=WAIT_MS
    )
    await expect(page.locator("#stop-after-step")).to_have_text("Stop now")

    await other.locator("#stop-after-step").click()  # "Stop now", from the other tab

    for card in (turn, theirs):
        await expect(card).to_have_class(has_class("aborted"), timeout=5_000)  # not the 60 s
    await other.close()


async def test_a_finished_turn_shows_its_tokens_and_an_abort_says_who(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browsers: Callable[..., Any],
) -> None:
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    turn = await submit(page, "Say hello")
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    usage = (await stored(relay, await turn_id_of(turn), "finished")).usage
    assert usage is not None and not usage.estimated and usage.completion_tokens > 0
    total = usage.prompt_tokens + usage.completion_tokens
    words = f"{total:,} tokens ({usage.prompt_tokens:,} in, {usage.completion_tokens:,} out)"
    await expect(turn.locator(".turn-usage")).to_have_text(words)
    await expect(turn.locator(".turn-status")).to_have_text("Finished")

    # An admin aborts the person's next turn: the card names them.
    openai_peer.script(SLOW)
    aborted = await submit(page, "Take your time")
    await expect(aborted.locator(".turn-output")).to_contain_text("w0 w1 ", timeout=WAIT_MS)
    await relay.people.token("root", role="admin")
    admin: Browser = await browsers("root")
    assert (await admin.abort(await turn_id_of(aborted)))[0] is True
    await expect(aborted).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(aborted.locator(".turn-status")).to_have_text("Aborted by root.")
    await assert_not_red(aborted)

    # A reload shows both from the relay's snapshot.
    await page.reload()
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )
    await expect(turn.locator(".turn-usage")).to_have_text(words)
    await expect(aborted.locator(".turn-status")).to_have_text("Aborted by root.")
    await expect(aborted.locator(".turn-usage")).to_have_text(re.compile(r"^about \d"))


async def test_a_drone_picked_by_name_stays_picked_while_it_is_offline(
    page: Page, relay: RelayHandle
) -> None:
    picker = page.locator("#drone")
    async with HandDrone(relay.url, drone_id="hand-9"):
        await open_hangar(page, relay)
        await expect(page.locator("#drone-summary")).to_have_text("1 online · 0 busy · 1 idle")
        await page.select_option("#drone", "hand-9")

    # Gone for a moment: the person's choice stays, shown offline.
    await expect(page.locator("#drone-summary")).to_have_text("No drones online.")
    await expect(picker).to_have_value("hand-9")
    await expect(picker.locator("option:checked")).to_have_text("hand · m · offline")
    turn = await submit(page, "Only for hand-9")
    await expect(turn.locator(".turn-status")).to_have_text(
        "Queued: next in line · for hand (m) (offline)"
    )
    assert (await stored(relay, await turn_id_of(turn))).wanted_drone == "hand-9"

    async with HandDrone(relay.url, drone_id="hand-9") as back:
        assert await back.next_order() == await turn_id_of(turn)
        await expect(picker.locator("option:checked")).to_have_text("hand · m · busy")
        await expect(picker).to_have_value("hand-9")
