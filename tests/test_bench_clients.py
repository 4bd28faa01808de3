"""The burst benchmarks' cheaper browser (``bench.light``) speaks socket.io's wire protocol as
the relay expects: a person's token opens ``/ide``, a submit is answered, progress and the
completion arrive, and an abort is acked as a python-socketio client's is. Its figures in
``docs/performance.md`` are only worth something if it sees what a real client sees."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bench.light import LightBrowser
from bench.peers import OpenAIPeer, Reply
from tests.conftest import RelayHandle, Upstream

pytestmark = pytest.mark.asyncio

SLOW = Reply(chunks=[f"w{i} " for i in range(400)], delay=0.03)


async def test_the_light_browser_submits_sees_progress_aborts_and_sees_the_turn_end(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(SLOW, Reply(chunks=["Next ", "one."]))
    await start_drone(Upstream("openai", openai_peer))
    browser = await LightBrowser(relay.url, await relay.people.token()).connect()
    try:
        turn_id = await browser.submit("Count slowly")
        await asyncio.wait_for(browser.first_progress[turn_id].wait(), 10)

        emitted, acked, success, message = await browser.abort(turn_id)
        await asyncio.wait_for(browser.done[turn_id].wait(), 10)

        assert (success, message) == (True, "Abort signaled")
        assert emitted <= acked <= browser.completed[turn_id][0]
        assert browser.completed[turn_id][1:] == (True, "aborted")
        again = await browser.submit("Then this")
        await asyncio.wait_for(browser.done[again].wait(), 10)
        assert browser.completed[again][1:] == (True, "Next one.")
    finally:
        await browser.close()


async def test_the_light_browser_is_refused_without_a_token(relay: RelayHandle) -> None:
    with pytest.raises(RuntimeError, match="namespace refused"):
        await LightBrowser(relay.url, "not-a-token").connect()
