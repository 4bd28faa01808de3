"""A submit whose answer the page never got, or got as a refusal, sent again from the page in
real Chromium: the connection drops between the relay storing the turn and its answer reaching
the page (or the relay stored it and then failed), and the person presses Enter again once the
page is connected again (``docs/protocol.md``, ``requestId``)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Page, WebSocketRoute, expect

from bench.peers import OpenAIPeer
from hangar.server.connections import UNAVAILABLE
from tests.browser.test_page import WAIT_MS, open_hangar
from tests.conftest import RelayHandle, Upstream

pytestmark = pytest.mark.browser

SUBMIT = re.compile(r'^42/ide,(\d+)\["submitWorkOrder",')


async def lose_the_first_submits_answer(page: Page, refusal: str | None = None) -> asyncio.Event:
    """Pass the page's websockets through, except that the answer to the first submit is
    dropped and that connection closed at both ends (or, with ``refusal``, the answer is that
    refusal instead); the event is set once it was."""
    lost = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    def route(page_side: WebSocketRoute) -> None:
        relay_side = page_side.connect_to_server()
        if lost.is_set():
            return  # a later connection: passed through as it is
        submit_ack: list[str] = []

        def from_page(message: str | bytes) -> None:
            found = SUBMIT.match(message) if isinstance(message, str) else None
            if found and not submit_ack:
                submit_ack.append(f"43/ide,{found.group(1)}[")
            relay_side.send(message)

        def from_relay(message: str | bytes) -> None:
            if lost.is_set() and refusal is None:
                return  # this connection is closing
            if (
                not lost.is_set()
                and submit_ack
                and isinstance(message, str)
                and message.startswith(submit_ack[0])
            ):
                lost.set()
                if refusal is not None:
                    page_side.send(
                        submit_ack[0] + json.dumps({"ok": False, "error": refusal}) + "]"
                    )
                    return
                for side in (page_side, relay_side):
                    task = asyncio.get_running_loop().create_task(side.close())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                return
            page_side.send(message)

        page_side.on_message(from_page)
        relay_side.on_message(from_relay)

    await page.route_web_socket(re.compile(r"/socket\.io/"), route)
    return lost


@pytest.mark.parametrize("answer", ["lost", "refused"])
async def test_a_submit_whose_answer_was_lost_sent_again_from_the_page_runs_once(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    answer: str,
) -> None:
    await start_drone(Upstream("openai", openai_peer))
    refusal = UNAVAILABLE if answer == "refused" else None
    lost = await lose_the_first_submits_answer(page, refusal)
    await open_hangar(page, relay, "resender")
    await page.wait_for_function(
        "() => window.hangar.socket.io.engine?.transport?.name === 'websocket'", timeout=WAIT_MS
    )

    await page.fill("#prompt", "Only once, please")
    await page.press("#prompt", "Enter")
    await asyncio.wait_for(lost.wait(), WAIT_MS / 1000)
    told = refusal or "it will not run twice"
    await expect(page.locator(".toast", has_text=told)).to_be_visible()
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connected", timeout=WAIT_MS
    )
    await expect(page.locator("#prompt")).to_have_value("Only once, please")
    await page.press("#prompt", "Enter")

    turn = page.locator("#turns article.turn")
    await expect(turn).to_have_count(1)
    await expect(turn).to_have_attribute("data-status", "finished", timeout=WAIT_MS)
    await expect(page.locator("#prompt")).to_have_value("")
    await expect(page.locator("#sessions [data-session-id]")).to_have_count(1)
    session_id = await page.evaluate("() => window.hangar.currentSessionId()")
    user = await relay.relay.accounts.user("resender")
    assert user is not None
    stored = await relay.relay.store.list_sessions(user.user_id)
    assert [s.session_id for s in stored] == [session_id]
    assert [t.turn_id for t in await relay.relay.store.list_turns(session_id)] == [
        await turn.get_attribute("data-turn-id")
    ]
    assert len(openai_peer.requests) == 1
