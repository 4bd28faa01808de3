"""Text larger than one progress event may carry reaches the person whole, in order; what a
worker writes that the drone cannot take ends that worker's turns, never the drone.

A model may send a huge chunk, and a worker joins a fast stream's chunks into one batch (a
local model can deliver megabytes between two of the worker's writes). A text delta carries at
most a million characters (docs/protocol.md, ``workOrderProgress``): the drone sends such text
as several deltas, and the turn goes on as if it had come in small chunks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.peers import Reply
from hangar.drone.pipes import HEADER
from hangar.drone.pool import WORKER_STOPPED
from hangar.server import histories
from hangar.shared.protocol import ANSWER_TOO_LONG
from tests.conftest import Browser, RelayHandle, Upstream, eventually
from tests.test_drone_workers import worker_pids

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


def open_files(pid: int) -> dict[str, str]:
    """The process ``pid``'s descriptors and what each is open on."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile (listdir's own)
            found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return found


def write_into_frames(pid: int, data: bytes) -> None:
    """Write ``data`` into the pipe the worker ``pid`` writes its frames to: the one it holds open
    for writing whose other end this process, its drone's, holds (it prints to its stderr)."""
    ours = set(open_files(os.getpid()).values())
    found = []
    for fd, link in open_files(pid).items():
        if link.startswith("pipe:") and link in ours:
            flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0]
            if int(flags, 8) & os.O_ACCMODE == os.O_WRONLY:
                found.append(fd)
    (fd,) = found
    with open(f"/proc/{pid}/fd/{fd}", "wb", buffering=0) as pipe:
        pipe.write(data)


@pytest.mark.parametrize(
    "written",
    [b"Hello from a library that printed\n", HEADER.pack(5) + b"nope!"],
    ids=["not a frame", "a frame that is not JSON"],
)
async def test_a_worker_that_writes_what_is_not_a_frame_is_replaced_and_its_turn_ends_in_error(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Start,
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
    written: bytes,
) -> None:
    caplog.set_level(logging.INFO, logger="hangar.drone")
    slow = Reply(chunks=[f"w{i} " for i in range(300)], delay=0.05)
    upstream.peer.script(slow, Reply(chunks=["Fine ", "again."]))
    drone = await start_drone(upstream, workers=1)
    turn_id = (await browser.submit("Stream"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (worker,) = worker_pids()

    write_into_frames(worker, written)

    assert await browser.completion(turn_id, timeout=20) == (turn_id, False, WORKER_STOPPED)
    assert drone.drone_id in relay.relay.directory.local, "the drone stayed connected"
    await eventually(lambda: worker_pids() not in ([], [worker]), what="a new worker")
    again = (await browser.submit("Again"))["turnId"]
    assert await browser.completion(again, timeout=20) == (again, True, "Fine again.")
    lines = [r for r in caplog.records if "sent what the drone cannot take" in r.getMessage()]
    assert len(lines) == 1 and not lines[0].exc_info, "one line, no traceback"


async def test_a_session_whose_history_is_too_large_for_a_work_order_says_so_at_once(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Start,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A work order larger than a drone takes (256 MiB) was sent anyway: the drone's connection
    closed, the turn went back in line two or three times, dropping the drone each time, and
    ended "The drone disconnected."; the session could never run again. Now the turn ends at
    once saying why, and the drone goes on. (The bound is lowered here: 256 MiB of history
    would take the test's memory.)"""
    monkeypatch.setattr(histories, "MAX_ORDER_BYTES", 1_000_000)
    upstream.peer.script(Reply(chunks=[HUGE]), Reply(chunks=["Fine."]))
    drone = await start_drone(upstream)
    first = await browser.submit("Count")
    assert (await browser.completion(first["turnId"]))[1] is True

    again = await browser.submit("And again", sessionId=first["sessionId"])

    ending = await browser.completion(again["turnId"])
    assert ending[1] is False
    assert ending[2] == (
        "This session's history is too large to send to a drone (1.6 MB; a work order may take "
        "at most 1.0 MB). Start a new session."
    )
    assert len(upstream.peer.requests) == 1  # the model was not asked
    fresh = await browser.submit("Something new")
    assert await browser.completion(fresh["turnId"]) == (fresh["turnId"], True, "Fine.")
    assert drone.drone_id in relay.relay.directory.local
