"""A model service that asks the drone to wait (``429`` or ``503`` with ``Retry-After``): the
wait it asks for is not silence, a limit that lasts ends the turn with the service's own answer,
and an abort does not wait for it (docs/reliability.md, "The bounds")."""

from __future__ import annotations

import asyncio
import email.utils
import time
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply
from hangar.drone.providers.retry import asked_wait
from hangar.shared.protocol import ABORTED
from tests.conftest import eventually
from tests.test_agent_service import Recorder, finished, order, service_for

LIMITED = "Rate limit reached for requests."


def limited(wait: str, status: int = 429) -> Reply:
    return Reply(status=status, error_message=LIMITED, headers={"Retry-After": wait})


async def one_turn(
    peer: OpenAIPeer, workdir: Path, *replies: Reply, **settings: Any
) -> tuple[tuple[str, bool, str], str]:
    """Run one work order against ``replies``: its completion and the reason it ended."""
    recorder = Recorder()
    service = service_for(peer, recorder, workdir, **settings)
    peer.script(*replies)
    try:
        service.accept(order("t_1", "Go"))
        completion = await finished(recorder)
    finally:
        await service.close()
    return completion, recorder.endings[-1].reason


async def test_the_wait_a_rate_limit_asks_for_is_not_taken_for_a_stalled_model(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """The service asks for 1 s; the drone's stall bound is 0.5 s. Before, the SDK's wait
    counted as the model's silence, and the turn ended ``stalled``."""
    fine = Reply(chunks=["Fine ", "now."])
    ended = await one_turn(openai_peer, tmp_path, limited("1"), fine, stall=0.5)

    assert ended == (("t_1", True, "Fine now."), "finished")
    first, second = openai_peer.requests
    assert first.ended is not None and second.started - first.ended >= 0.95


@pytest.mark.parametrize("wait", ["soon", "nan", "-5", "Sat, 01 Jan 10000 00:00:00 GMT"])
async def test_a_retry_after_the_drone_cannot_read_is_tried_again_after_a_pause(
    openai_peer: OpenAIPeer, tmp_path: Path, wait: str
) -> None:
    """Before, a date past the calendar's years failed the turn as the drone's own failure."""
    ended = await one_turn(openai_peer, tmp_path, limited(wait), Reply(chunks=["Fine."]))

    assert ended == (("t_1", True, "Fine."), "finished")
    assert len(openai_peer.requests) == 2


async def test_a_rate_limit_that_lasts_ends_the_turn_with_the_services_answer(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    replies = limited("0.4"), limited("0.4", 503), limited("0.4")
    ended = await one_turn(openai_peer, tmp_path, *replies, stall=0.5)

    assert ended == (("t_1", False, f"The model service answered 429: {LIMITED}"), "model_failed")
    assert len(openai_peer.requests) == 3  # the first try and the drone's 2 retries


@pytest.mark.parametrize(
    ("wait", "said"),
    [
        ("600", "in 600 s"),
        ("120.4", "in 121 s"),
        ("1e308", "much later"),
        ("inf", "much later"),
        ("Sat, 01 Jan 2101 00:00:00 GMT", "much later"),
    ],
)
async def test_a_service_that_asks_for_more_than_two_minutes_fails_the_turn_at_once(
    openai_peer: OpenAIPeer, tmp_path: Path, wait: str, said: str
) -> None:
    ended = await one_turn(openai_peer, tmp_path, limited(wait), Reply(chunks=["Too late."]))

    asks = f"The model service answered 429: {LIMITED} It asks to be tried again {said}."
    assert ended == (("t_1", False, asks), "model_failed")
    assert len(openai_peer.requests) == 1


async def test_an_abort_ends_a_turn_waiting_out_a_rate_limit_at_once(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path)
    openai_peer.script(limited("30"), Reply(chunks=["Too late."]))
    try:
        service.accept(order("t_1", "Go"))
        await eventually(lambda: openai_peer.requests and openai_peer.requests[0].ended)
        assert service.abort("t_1") == (True, "Abort signaled")
        async with asyncio.timeout(2):
            assert await finished(recorder) == ("t_1", True, ABORTED)
    finally:
        await service.close()

    assert len(openai_peer.requests) == 1
    assert recorder.endings[-1].reason == "aborted"


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.25"}, 0.25),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "an HTTP date 30 s from now"}, 30.0),
        ({"retry-after": "later"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "Sat, 01 Jan 10000 00:00:00 GMT"}, None),
        ({"retry-after": "Jan 31 00:00:00 Mon, +99999999999"}, None),
        ({}, None),
    ],
)
def test_every_form_of_retry_after_is_read(headers: dict[str, str], seconds: float | None) -> None:
    if headers.get("retry-after", "").startswith("an HTTP date"):
        headers = {"retry-after": email.utils.formatdate(time.time() + 30, usegmt=True)}
    asked = asked_wait(headers)
    if seconds is None:
        assert asked is None
    else:
        assert asked == pytest.approx(seconds, abs=1.5)
