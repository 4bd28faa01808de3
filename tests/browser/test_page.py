"""The browser page in real Chromium: live streaming, Cancel, Esc Esc, refused aborts, a drone
that dies mid-turn, a reload mid-turn. A real relay, real drones and a local OpenAI-SSE peer."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Locator, Page, expect

from bench.peers import OpenAIPeer, Reply
from hangar.server.store import TurnRecord
from hangar.shared.protocol import NO_ACTIVE_WORK_ORDER
from tests.browser.conftest import artifact, assert_no_sideways_scroll, log_in
from tests.conftest import RelayHandle, Upstream

pytestmark = pytest.mark.browser

# About 9 s of streaming: long enough to act on mid-turn, never long enough to finish first.
SLOW = Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03)
WAIT_MS = 10_000

ABORTED_STATUS = "The turn was aborted by you."


def has_class(name: str) -> re.Pattern[str]:
    return re.compile(rf"(^|\s){re.escape(name)}(\s|$)")


async def open_hangar(page: Page, relay: RelayHandle, person: str = "tester") -> None:
    """Log ``person`` in, load the page and wait for the socket to connect."""
    await log_in(page, relay, person)
    await page.goto(relay.url + "/")
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )


async def submit(page: Page, prompt: str) -> Locator:
    """Type a prompt, press Enter, and return the new turn's card."""
    turns = page.locator("#turns article.turn")
    before = await turns.count()
    await page.fill("#prompt", prompt)
    await page.press("#prompt", "Enter")
    await expect(turns).to_have_count(before + 1, timeout=WAIT_MS)
    turn_id = await turns.last.get_attribute("data-turn-id")
    assert turn_id, "a turn card carries its turn id"
    return page.locator(f'#turns article.turn[data-turn-id="{turn_id}"]')


async def turn_id_of(turn: Locator) -> str:
    turn_id = await turn.get_attribute("data-turn-id")
    assert turn_id
    return turn_id


async def output_text(turn: Locator) -> str:
    """The text the turn's answer streamed, exactly (drawn as Markdown in its output)."""
    text: str | None = await turn.page.evaluate(
        "(id) => window.hangar.answerText(id)", await turn_id_of(turn)
    )
    return text or ""


async def stored(relay: RelayHandle, turn_id: str, status: str | None = None) -> TurnRecord:
    """The stored turn; with ``status``, wait (bounded) until it has that status."""
    deadline = asyncio.get_running_loop().time() + WAIT_MS / 1000
    while True:
        turn = await relay.relay.store.get_turn(turn_id)
        assert turn is not None, f"turn {turn_id} is not stored"
        if status is None or turn.status == status:
            return turn
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"turn {turn_id} is {turn.status!r}, expected {status!r}")
        await asyncio.sleep(0.02)


async def record_outgoing(page: Page) -> None:
    """Record the name of every event the page's socket sends from now on."""
    await page.evaluate(
        """() => {
            window.__sent = [];
            window.hangar.socket.onAnyOutgoing((event) => window.__sent.push(event));
        }"""
    )


async def sent(page: Page) -> list[str]:
    events: list[str] = await page.evaluate("() => window.__sent.slice()")
    return events


async def record_cancel_button(page: Page) -> None:
    """Record every state #cancel passes through (text, disabled, hidden) from now on."""
    await page.evaluate(
        """() => {
            const button = document.getElementById("cancel");
            const states = (window.__cancelStates = []);
            const record = () => states.push({
                text: button.textContent, disabled: button.disabled, hidden: button.hidden,
            });
            new MutationObserver(record).observe(button, {
                attributes: true, childList: true, characterData: true, subtree: true,
            });
        }"""
    )


async def cancel_states(page: Page) -> list[dict[str, Any]]:
    states: list[dict[str, Any]] = await page.evaluate("() => window.__cancelStates.slice()")
    return states


async def assert_idle_controls(page: Page) -> None:
    """No turn processing: Submit is back, Cancel is gone, Esc Esc is not listened for."""
    await expect(page.locator("#submit")).to_be_visible()
    await expect(page.locator("#submit")).to_be_enabled()
    await expect(page.locator("#cancel")).to_be_hidden()
    assert await page.evaluate("() => window.hangar.escListenerActive()") is False
    assert await page.evaluate("() => window.hangar.processingTurnId()") is None


async def assert_not_red(turn: Locator) -> None:
    """None of the turn's colours is one of the page's danger (error) colours."""
    colours: dict[str, Any] = await turn.evaluate(
        """(el) => {
            const probe = document.createElement("div");
            document.body.append(probe);
            const danger = ["--danger", "--danger-strong", "--danger-bg", "--danger-border"].map(
                (name) => {
                    probe.style.color = `var(${name})`;
                    return getComputedStyle(probe).color;
                },
            );
            probe.remove();
            const card = getComputedStyle(el);
            const status = getComputedStyle(el.querySelector(".turn-status"));
            return {
                danger,
                used: {
                    border: card.borderTopColor,
                    background: card.backgroundColor,
                    statusColour: status.color,
                    statusBackground: status.backgroundColor,
                },
            };
        }"""
    )
    danger = set(colours["danger"])
    assert len(danger) == 4, colours
    for what, colour in colours["used"].items():
        assert colour not in danger, f"the aborted turn's {what} is red: {colours}"
        rgb = [int(x) for x in re.findall(r"\d+", colour)[:3]]
        assert not (rgb[0] >= 150 and rgb[0] > 2 * rgb[1] and rgb[0] > 2 * rgb[2]), (
            f"the aborted turn's {what} looks red: {colour}"
        )


# ---------------------------------------------------------------------------- tests


async def test_cancel_aborts_the_streaming_turn(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")

    turn = await submit(page, "Write a long essay")
    turn_id = await turn_id_of(turn)
    await expect(turn).to_have_class(has_class("processing"))
    await expect(turn.locator(".turn-status")).to_have_text("Working…")
    await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 w2 w3 ", timeout=WAIT_MS)
    await expect(page.locator("#submit")).to_have_text("Queue")  # a follow-up waits for it
    await expect(page.locator("#cancel")).to_have_text("Cancel")
    assert await page.evaluate("() => window.hangar.processingTurnId()") == turn_id
    assert await page.evaluate("() => window.hangar.escListenerActive()") is True

    await record_cancel_button(page)
    await page.click("#cancel")

    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text(ABORTED_STATUS)
    await expect(turn).not_to_have_class(has_class("error"))
    await expect(turn).not_to_have_class(has_class("processing"))
    await expect(turn.locator(".spinner")).to_have_count(0)
    states = await cancel_states(page)
    assert {"text": "Aborting…", "disabled": True, "hidden": False} in states, states
    aborting_at = states.index({"text": "Aborting…", "disabled": True, "hidden": False})
    assert all(s["disabled"] or s["hidden"] for s in states[aborting_at:]), (
        f"Cancel must stay disabled once it reads Aborting…: {states}"
    )
    await openai_peer.wait_for_disconnect()
    assert openai_peer.last is not None and not openai_peer.last.completed
    await assert_idle_controls(page)
    # Once the card says the turn was aborted, no toast still claims it is being aborted (well
    # before such a toast would have timed out by itself, after 4 s).
    await expect(page.locator("#toasts .toast", has_text="Aborting")).to_have_count(
        0, timeout=2_000
    )
    await expect(page.locator("#toasts .toast.error")).to_have_count(0)
    await assert_not_red(turn)
    await page.screenshot(path=artifact("abort.png"), full_page=True)

    record = await stored(relay, turn_id)
    assert record.status == "aborted" and record.result == "aborted"
    shown = await output_text(turn)
    assert shown and SLOW.text.startswith(shown) and shown != SLOW.text
    assert record.text == shown, "the page keeps exactly what had streamed"


async def test_esc_once_warns_and_esc_esc_aborts(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer))
    await page.clock.install()
    await open_hangar(page, relay)

    turn = await submit(page, "Keep talking")
    turn_id = await turn_id_of(turn)
    await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 ", timeout=WAIT_MS)
    assert await page.evaluate("() => window.hangar.escListenerActive()") is True
    await record_outgoing(page)
    warning = page.locator("#toasts .toast", has_text="Press Esc again to abort")

    await page.keyboard.press("Escape")
    await expect(warning).to_be_visible()
    await expect(warning).not_to_have_class(has_class("error"))
    # Past the 3 s window the warning goes and a lone Esc has aborted nothing.
    await page.clock.fast_forward(3_100)
    await expect(warning).to_be_hidden(timeout=5_000)
    await expect(turn).to_have_class(has_class("processing"))
    assert "abortWorkOrder" not in await sent(page)
    assert (await stored(relay, turn_id)).status == "processing"

    # A new Esc only warns again; the second one within 3 s aborts.
    await page.keyboard.press("Escape")
    await expect(warning).to_be_visible()
    assert "abortWorkOrder" not in await sent(page)
    await page.keyboard.press("Escape")

    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text(ABORTED_STATUS)
    await expect(warning).to_be_hidden()
    assert (await sent(page)).count("abortWorkOrder") == 1
    await openai_peer.wait_for_disconnect()
    await assert_idle_controls(page)
    assert (await stored(relay, turn_id)).status == "aborted"


async def test_esc_esc_with_nothing_processing_does_nothing(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    toasts = page.locator("#toasts .toast")

    # A fresh page with no turn at all.
    await assert_idle_controls(page)
    await record_outgoing(page)
    await page.keyboard.press("Escape")
    await page.keyboard.press("Escape")
    await expect(toasts).to_have_count(0)
    assert "abortWorkOrder" not in await sent(page)

    # After a turn that finished.
    turn = await submit(page, "Say hello")
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text("Finished")
    await expect(turn.locator(".turn-output")).to_have_text("Hello world")
    await assert_idle_controls(page)
    await page.locator("#prompt").focus()
    await page.keyboard.press("Escape")
    await page.keyboard.press("Escape")
    await page.locator("body").press("Escape")
    await page.locator("body").press("Escape")

    await expect(toasts).to_have_count(0)
    assert "abortWorkOrder" not in await sent(page)
    assert await page.evaluate("() => window.hangar.escListenerActive()") is False
    await expect(turn).to_have_class(has_class("finished"))


async def test_abort_refused_by_the_drone_shows_the_error_and_restores_cancel(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    first = await submit(page, "Say hello")
    await expect(first).to_have_class(has_class("finished"), timeout=WAIT_MS)

    # The page misses the next completion (and the turnEnded after it), so the turn still looks
    # processing here while it has already finished at the drone.
    await page.evaluate(
        """() => {
            const socket = window.hangar.socket;
            socket.off("workOrderComplete");
            socket.off("turnEnded");
            window.__missed = [];
            socket.on("workOrderComplete", (...args) => window.__missed.push(args));
        }"""
    )
    openai_peer.script(Reply(chunks=["All ", "done."], delay=0.01))
    turn = await submit(page, "Finish quickly")
    turn_id = await turn_id_of(turn)
    await page.wait_for_function(
        "(id) => window.__missed.some((args) => args[0] === id)", arg=turn_id, timeout=WAIT_MS
    )
    assert (await stored(relay, turn_id)).status == "finished"
    await expect(turn).to_have_class(has_class("processing"))
    await expect(turn.locator(".turn-output")).to_have_text("All done.")
    cancel = page.locator("#cancel")
    await expect(cancel).to_have_text("Cancel")
    await expect(cancel).to_be_enabled()

    await record_outgoing(page)
    await cancel.click()

    error = page.locator("#toasts .toast.error", has_text=NO_ACTIVE_WORK_ORDER)
    await expect(error).to_be_visible(timeout=WAIT_MS)
    await expect(error).to_have_text(NO_ACTIVE_WORK_ORDER)
    await expect(cancel).to_have_text("Cancel")
    await expect(cancel).to_be_enabled()
    await expect(cancel).to_be_visible()
    await expect(page.locator("#toasts .toast", has_text="Aborting")).to_have_count(0)
    assert await sent(page) == ["abortWorkOrder"]
    assert (await stored(relay, turn_id)).status == "finished"


async def test_drone_killed_mid_turn_shows_the_error(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[Any]],
) -> None:
    openai_peer.script(SLOW)
    await open_hangar(page, relay)
    process = drone_process(Upstream("openai", openai_peer), server=relay.url, name="doomed")
    # The drone picker lists the drone once the subprocess has connected to the relay.
    listed = page.locator("#drone option", has_text="doomed")
    deadline = asyncio.get_running_loop().time() + 30
    while await listed.count() == 0:
        assert process.poll() is None, f"the drone process exited early ({process.returncode})"
        assert asyncio.get_running_loop().time() < deadline, "the drone process never connected"
        await asyncio.sleep(0.05)
    await expect(page.locator("#drone-summary")).to_have_text(re.compile(r"^1 online"))

    turn = await submit(page, "Work until you drop")
    turn_id = await turn_id_of(turn)
    await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 w2 ", timeout=WAIT_MS)
    process.send_signal(signal.SIGKILL)
    await asyncio.to_thread(process.wait, 10)

    await expect(turn).to_have_class(has_class("error"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text("Error: The drone disconnected.")
    await expect(turn).not_to_have_class(has_class("processing"))
    await expect(turn.locator(".spinner")).to_have_count(0)
    await assert_idle_controls(page)
    await expect(page.locator("#drone-summary")).to_have_text("No drones online.")
    record = await stored(relay, turn_id)
    assert record.status == "error" and record.result == "The drone disconnected."


async def test_reload_mid_turn_keeps_streaming_and_cancel_still_works(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    # The reload falls in a pause of the stream, so the reloaded page's snapshot is exactly the
    # five words streamed so far; the stream then goes on into the reloaded page.
    openai_peer.script(Reply(chunks=SLOW.chunks, delay=SLOW.delay, stall_after=(5, 3.0)))
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    turn = await submit(page, "A long story, please")
    turn_id = await turn_id_of(turn)
    before_reload = "w0 w1 w2 w3 w4 "
    await expect(turn.locator(".turn-output")).to_have_text(before_reload, timeout=WAIT_MS)
    session_id = await page.evaluate("() => window.hangar.currentSessionId()")
    assert session_id and f"#s={session_id}" in page.url

    await page.reload()
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )
    assert await page.evaluate("() => window.hangar.currentSessionId()") == session_id
    await expect(turn).to_have_class(has_class("processing"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text("Working…")
    await expect(page.locator(f'#sessions [data-session-id="{session_id}"]')).to_be_visible()
    await expect(turn.locator(".turn-output")).to_contain_text(before_reload)
    await page.wait_for_function(
        """([id, n]) => {
            const out = document.querySelector(`article.turn[data-turn-id="${id}"] .turn-output`);
            return out !== null && out.textContent.length > n;
        }""",
        arg=[turn_id, len(before_reload)],
        timeout=WAIT_MS,
    )
    await expect(turn.locator(".turn-output")).to_contain_text("w5 w6 ", timeout=WAIT_MS)
    assert await page.evaluate("() => window.hangar.processingTurnId()") == turn_id
    assert await page.evaluate("() => window.hangar.escListenerActive()") is True

    await page.click("#cancel")
    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)
    await expect(turn.locator(".turn-status")).to_have_text(ABORTED_STATUS)
    await openai_peer.wait_for_disconnect()
    await assert_idle_controls(page)
    record = await stored(relay, turn_id)
    assert record.status == "aborted"
    shown = await output_text(turn)
    assert shown.startswith(before_reload + "w5 w6 ") and SLOW.text.startswith(shown)
    assert record.text == shown, "the reloaded page shows exactly what streamed, once"


async def test_narrow_page_has_no_horizontal_overflow(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(Reply(chunks=["x" * 400, " and a long line without breaks"]))
    await start_drone(Upstream("openai", openai_peer))
    await page.set_viewport_size({"width": 360, "height": 720})
    await open_hangar(page, relay)
    await expect(page.locator("#connection[data-state=connected]")).to_be_visible()
    turn = await submit(page, "y" * 300)
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await page.fill("#prompt", "z" * 500)

    await assert_no_sideways_scroll(page, 360)
