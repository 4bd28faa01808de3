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
