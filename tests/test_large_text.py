"""Text larger than one progress event may carry reaches the person whole, in order.

A model may send a huge chunk, and a worker joins a fast stream's chunks into one batch (a
local model can deliver megabytes between two of the worker's writes). A text delta carries at
most a million characters (docs/protocol.md, ``workOrderProgress``): the drone sends such text
as several deltas, and the turn goes on as if it had come in small chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bench.peers import Reply
from hangar.shared.protocol import ANSWER_TOO_LONG
from tests.conftest import Browser, RelayHandle, Upstream

Start = Callable[..., Any]
HUGE = "".join(f"{n:07d} " for n in range(200_000))  # 1.6 million characters, in one chunk


@pytest.mark.parametrize("workers", [0, 1], ids=["in the drone", "in a worker"])
async def test_a_chunk_larger_than_a_text_event_reaches_the_person_whole(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser, workers: int
) -> None:
    upstream.peer.script(Reply(chunks=["Numbers: ", HUGE, "done."]))
    await start_drone(upstream, workers=workers)

    turn_id = (await browser.submit("Count"))["turnId"]

    success, result = (await browser.completion(turn_id, timeout=30))[1:]
    assert success is True, result
    assert browser.text(turn_id) == "Numbers: " + HUGE + "done."
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None and turn.messages[-1].content == "Numbers: " + HUGE + "done."


# 4.8 million characters: more than one event to the relay may carry (4,000,000 bytes).
ENDLESS = ["".join(f"{n:07d} " for n in range(k * 10_000, (k + 1) * 10_000)) for k in range(60)]


@pytest.mark.parametrize("workers", [0, 1], ids=["in the drone", "in a worker"])
async def test_an_answer_too_long_to_send_ends_its_turn_and_the_drone_goes_on(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser, workers: int
) -> None:
    upstream.peer.script(Reply(chunks=ENDLESS), Reply(chunks=["Shorter now."]))
    await start_drone(upstream, workers=workers)

    turn_id = (await browser.submit("Count forever"))["turnId"]

    assert await browser.completion(turn_id, timeout=30) == (turn_id, False, ANSWER_TOO_LONG)
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None and (turn.status, turn.reason) == ("error", "model_failed")
    # What the person saw is kept, flagged as cut short: the history stays a conversation.
    shown = browser.text(turn_id)
    assert 0 < len(shown) < len("".join(ENDLESS))
    assert [(m.role, m.content, m.aborted) for m in turn.messages[1:]] == [
        ("assistant", shown, True)
    ]
    again = (await browser.submit("Count less"))["turnId"]
    assert await browser.completion(again, timeout=30) == (again, True, "Shorter now.")
