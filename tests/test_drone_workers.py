"""A drone whose work orders run in worker processes: it behaves as a single-process drone does,
and its acks and aborts never wait behind the streams, however busy the workers are.

The bounds below are the behaviour: a single-process drone whose loop parses a flood of chunks
misses them (its loop answers between two reads of the flood, 100 ms and more apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone import watch
from hangar.drone.pipes import frame
from hangar.drone.pool import WORKER_STOPPED, lost_ending
from hangar.drone.tools.policy import ToolPolicy
from hangar.server.reaper import DRONE_LOST
from hangar.server.store import Ending, SessionRecord, TurnRecord
from hangar.shared.abort import AbortCause
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    CUT_OFF,
    STOP_AFTER_STEP,
    TOOL_CANCELLED,
    ChatMessage,
)
from tests.conftest import DRONE_TOKEN, HANGAR, ROOT, Browser, RelayHandle, Upstream, eventually
from tests.test_tool_sandbox import grandchild_command, processes_running, started, unique_sleep

Start = Callable[..., Any]

SLOW = Reply(chunks=[f"word{i} " for i in range(400)], delay=0.03)
FLOOD = Reply(chunks=["x"] * 1_000_000, chunks_per_write=100)
CYCLE = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"
"""As fast as the drone reads: it parses chunks with all the CPU it gets (written 100 at a time,
so that the peer, in the tests' process beside the relay, stays far from busy)."""
FLOODS = 3
ACK_WITHIN = 0.1
"""Seconds from a browser's abort to its ack, through the relay, while the workers are busy."""
CLOSED_WITHIN = 0.04
"""Seconds from a browser's abort to the model service seeing its stream closed."""


def children_of(parent: int) -> list[int]:
    """The processes ``parent`` started that still run (or have yet to be reaped)."""
    found = []
    for task in os.listdir(f"/proc/{parent}/task"):
        try:  # a thread or a child may end while it is read
            found += [
                int(pid) for pid in Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            ]
        except FileNotFoundError:
            continue
    return found


def worker_pids(parent: int | None = None) -> list[int]:
    """The worker processes of the drone process ``parent`` (default: this test process, where
    the drones of ``start_drone`` run)."""
    found = []
    for pid in children_of(parent or os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"hangar.drone.worker_process" in cmdline:
            found.append(pid)
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_work_order_in_a_worker_streams_to_completion(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser
) -> None:
    upstream.peer.script(Reply(chunks=["The ", "answer ", "is ", "42."], delay=0.01))
    await start_drone(upstream, workers=1)

    turn_id = (await browser.submit("What is the answer?"))["turnId"]

    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "The answer is 42.")
    assert browser.text(turn_id) == "The answer is 42."
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None and [m.role for m in turn.messages] == ["user", "assistant"]


async def test_a_killed_worker_ends_its_turns_in_error_and_a_new_one_takes_its_place(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser
) -> None:
    upstream.peer.script(SLOW, SLOW)
    drone = await start_drone(upstream, workers=1, concurrency=2)
    turns = [(await browser.submit(f"Stream {n}"))["turnId"] for n in range(2)]
    for turn_id in turns:
        await browser.wait_text(turn_id, pieces=2, timeout=20)
    (killed,) = worker_pids()

    os.kill(killed, signal.SIGKILL)

    for turn_id in turns:
        assert await browser.completion(turn_id, timeout=10) == (turn_id, False, WORKER_STOPPED)
        assert (await browser.ending(turn_id))["reason"] == "drone_failed"
    assert drone.drone_id in relay.relay.directory.local, "the drone stayed connected"
    upstream.peer.script(Reply(chunks=["still ", "here"]))
    turn_id = (await browser.submit("Again"))["turnId"]
    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "still here")
    assert worker_pids() not in ([], [killed])


async def test_a_frozen_worker_is_replaced_and_its_turns_end_in_error(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Start,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose loop stops (SIGSTOP here; a native call that never returns does the
    same) kept its turns processing past every bound, and took the next orders too; the drone
    answered the relay's pings all along. It is now replaced as a dead one is."""
    monkeypatch.setattr(watch, "WORKER_SILENT", 2.0)
    upstream.peer.script(SLOW)
    drone = await start_drone(upstream, workers=1, concurrency=2)
    turn_id = (await browser.submit("Stream on"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (frozen,) = worker_pids()

    os.kill(frozen, signal.SIGSTOP)
    try:
        assert await browser.completion(turn_id, timeout=10) == (turn_id, False, WORKER_STOPPED)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    assert drone.drone_id in relay.relay.directory.local, "the drone stayed connected"
    upstream.peer.script(Reply(chunks=["thawed ", "out"]))
    turn_id = (await browser.submit("Again"))["turnId"]
    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "thawed out")
    assert frozen not in worker_pids()


async def test_a_worker_is_sent_only_the_history_it_lacks_and_all_of_it_once_it_died(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Start,
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="hangar.drone")
    await start_drone(upstream, workers=2, concurrency=2)
    upstream.peer.script(*(Reply(chunks=[f"A{n}"]) for n in range(1, 5)))
    session = None
    for n in range(1, 4):
        ack = await browser.submit(f"Q{n}", **({"sessionId": session} if session else {}))
        session = ack["sessionId"]
        assert await browser.completion(ack["turnId"], timeout=20) == (ack["turnId"], True, f"A{n}")

    def sent() -> list[str]:
        lines = [r.getMessage() for r in caplog.records]
        return [line.split(": ")[1] for line in lines if "history messages sent" in line]

    # The worker that ran the session's last order keeps its history: it gets the rest only.
    assert sent() == [f"{k} of its {n} history messages sent" for k, n in ((0, 0), (2, 2), (2, 4))]
    keepers = [m.split("(pid ")[1].split(")")[0] for m in caplog.messages if " to worker" in m]
    keeper = set(keepers)
    assert len(keeper) == 1, "every order of the session went to the same worker"
    killed = int(keeper.pop())
    os.kill(killed, signal.SIGKILL)
    await eventually(
        lambda: len(pids := worker_pids()) == 2 and killed not in pids, what="its replacement"
    )

    ack = await browser.submit("Q4", sessionId=session)

    assert await browser.completion(ack["turnId"], timeout=20) == (ack["turnId"], True, "A4")
    assert sent()[-1] == "6 of its 6 history messages sent", "a whole history to a new keeper"
    assert [m["content"] for m in upstream.peer.requests[-1].messages] == [
        "Q1", "A1", "Q2", "A2", "Q3", "A3", "Q4",
    ]  # fmt: skip


async def test_ctrl_c_aborts_the_turns_in_workers_and_the_drone_exits(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser
) -> None:
    upstream.peer.script(SLOW, SLOW)
    drone = await start_drone(upstream, workers=2, concurrency=2)
    turns = [(await browser.submit(f"Stream {n}"))["turnId"] for n in range(2)]
    for turn_id in turns:
        await browser.wait_text(turn_id, pieces=2, timeout=20)
    assert len(worker_pids()) == 2

    drone.stop()

    for turn_id in turns:
        assert await browser.completion(turn_id) == (turn_id, True, ABORTED)
        assert (await browser.ending(turn_id))["reason"] == "operator"
    assert await asyncio.wait_for(drone.task, 10) == 0
    assert worker_pids() == []
    for index in range(2):
        await upstream.peer.wait_for_disconnect(index=index)


async def test_a_drone_killed_takes_its_workers_and_their_streams_with_it(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
) -> None:
    openai_peer.script(SLOW)
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=20, what="the drone")
    turn_id = (await browser.submit("Stream for a while"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (worker,) = worker_pids(drone.pid)

    drone.kill()

    await openai_peer.wait_for_disconnect()
    await eventually(lambda: not alive(worker), 5, "the worker to end")


async def test_a_drone_killed_mid_command_leaves_nothing_of_the_command_running(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
) -> None:
    sleeper = unique_sleep()
    command = ScriptedToolCall("run_shell", {"command": grandchild_command(sleeper)})
    openai_peer.script(Reply(chunks=[], tool_calls=[command]), Reply(chunks=["never asked"]))
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=20, what="the drone")
    turn_id = (await browser.submit("Start something that lasts"))["turnId"]
    await started(sleeper)  # in the sandbox where there is one, else in a PID namespace

    drone.kill()

    await eventually(lambda: not processes_running(*sleeper), 3, "no process of the command")
    assert await browser.completion(turn_id, timeout=20) == (turn_id, False, DRONE_LOST.result)


@pytest.mark.parametrize("relay_ping", [(5.0, 10.0)])  # the frozen drone stays connected
async def test_a_drone_that_falls_behind_holds_its_workers_back_and_loses_nothing(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
) -> None:
    # 2,900,000 chunks, some 400 MB of the service's stream: far more than the pipes and sockets
    # between hold. Their text, 2.9 MB (a character each, in a cycle of 61), is within a
    # message's bound (MAX_MESSAGE_BYTES) even read whole, however late the abort lands.
    chunks = [CYCLE[n % len(CYCLE)] for n in range(2_900_000)]
    openai_peer.script(Reply(chunks=chunks, chunks_per_write=100))
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=20, what="the drone")
    turn_id = (await browser.submit("Flood"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)

    drone.send_signal(signal.SIGSTOP)  # the drone reads nothing of its worker now
    try:
        held = await eventually(Stalled(openai_peer), 8, "the stream to be held back")
    finally:
        drone.send_signal(signal.SIGCONT)

    assert held < len(chunks) // 4, "its worker stopped reading the model's stream"
    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, ABORTED)
    text = browser.text(turn_id)
    assert len(text) > 2 * 1024 and text == "".join(chunks)[: len(text)], "nothing was lost"


class Stalled:
    """The chunks a peer sent, once that count stopped growing (the same for half a second)."""

    def __init__(self, peer: OpenAIPeer) -> None:
        self.peer = peer
        self.count = -1
        self.since = 0.0

    def __call__(self) -> int | None:
        now = time.monotonic()
        if self.peer.chunks_sent != self.count:
            self.count, self.since = self.peer.chunks_sent, now
            return None
        return self.count if now - self.since >= 0.5 else None


async def test_a_tool_call_in_a_worker_waits_for_approval_then_runs(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    command = ScriptedToolCall("run_shell", {"command": "echo approved > out.txt"})
    openai_peer.script(Reply(chunks=[], tool_calls=[command]), Reply(chunks=["Done."]))
    await start_drone(
        Upstream("openai", openai_peer), workers=1, tools=ToolPolicy.parse("run_shell=ask")
    )
    turn_id = (await browser.submit("Write the file"))["turnId"]
    call = await eventually(
        lambda: [p for p in browser.progress(turn_id, "tool") if p["state"] == "waiting"],
        timeout=20,
        what="a call waiting for approval",
    )
    assert not (tmp_path / "out.txt").exists()

    answer = {"turnId": turn_id, "callId": call[0]["callId"], "approve": True}
    assert await browser.call("approveToolCall", answer) == {"ok": True}

    assert await browser.completion(turn_id, timeout=10) == (turn_id, True, "Done.")
    assert (tmp_path / "out.txt").read_text() == "approved\n"
    assert [p["state"] for p in browser.progress(turn_id, "tool")] == ["waiting", "start", "end"]


async def test_stop_after_this_step_in_a_worker_lets_the_tool_finish_then_ends_aborted(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Start, browser: Browser
) -> None:
    steps = [
        ScriptedToolCall("run_shell", {"command": "sleep 1; echo finished its step"}),
        ScriptedToolCall("run_shell", {"command": "echo never run"}),
    ]
    openai_peer.script(Reply(chunks=[], tool_calls=steps), Reply(chunks=["never asked"]))
    await start_drone(Upstream("openai", openai_peer), workers=1)
    turn_id = (await browser.submit("Do two things"))["turnId"]
    await eventually(lambda: browser.progress(turn_id, "tool"), 20, "the first tool")

    gentle = await browser.call("abortWorkOrder", {"turnId": turn_id, "mode": "after_step"})

    assert gentle == (True, STOP_AFTER_STEP)
    assert await browser.completion(turn_id, timeout=10) == (turn_id, True, ABORTED)
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None
    assert [(m.role, m.content.strip()) for m in turn.messages[2:]] == [
        ("tool", "exit code 0\nfinished its step"),
        ("tool", TOOL_CANCELLED),
    ]
    assert len(openai_peer.requests) == 1, "no model call after the step"


async def test_a_drone_running_many_streams_sends_their_text_in_fewer_larger_deltas(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Start, browsers: Start
) -> None:
    streams = 40
    fast = Reply(chunks=[f"w{i} " for i in range(200)], delay=0.005)  # a chunk every 5 ms, 1 s
    openai_peer.script(*[fast] * streams)
    await start_drone(Upstream("openai", openai_peer), workers=1, concurrency=streams)
    people = [await browsers() for _ in range(4)]  # 10 submits each: a person's burst

    turns = [
        (person, (await person.submit(f"Stream {n}"))["turnId"])
        for person in people
        for n in range(streams // len(people))
    ]
    for person, turn_id in turns:
        assert (await person.completion(turn_id, timeout=30))[1] is True

    assert all(person.text(t) == fast.text for person, t in turns), "no text lost"
    # Alone, a turn's text would go as a delta per 25 ms (40 a second); 40 turns at once widen
    # each turn's window to 100 ms: a drone sends about 400 text deltas a second in all, each
    # turn about 10 a second however long the stream takes on this machine.
    rates = sorted(deltas_per_second(person.progress_times(t)) for person, t in turns)
    assert rates[streams // 2] <= 15, f"text deltas per second per turn: {rates}"


def deltas_per_second(arrived: list[float]) -> float:
    """How often a turn's text deltas came, from its first to its last."""
    assert len(arrived) >= 3, f"a stream of 1 s came as {len(arrived)} deltas"
    return (len(arrived) - 1) / (arrived[-1] - arrived[0])


async def abort_timed(browser: Browser, turn_id: str) -> tuple[float, float]:
    """Abort ``turn_id``: (when it was asked, seconds until the ack), monotonic."""
    asked = time.monotonic()
    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    return asked, time.monotonic() - asked


# The drone's own loop is the relay's here (one test process), busy relaying the floods: a
# ping missed for that is the test's doing, not the drone's (a drone runs in its own process).
@pytest.mark.parametrize("relay_ping", [(5.0, 10.0)])
async def test_an_abort_closes_the_model_stream_at_once_while_the_worker_is_saturated(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Start, browsers: Start
) -> None:
    openai_peer.script(*[FLOOD] * FLOODS, SLOW)
    await start_drone(Upstream("openai", openai_peer), workers=1, concurrency=FLOODS + 1)
    await flood(browsers, FLOODS)
    person = await browsers()
    turn_id = (await person.submit("Stream slowly"))["turnId"]
    await person.wait_text(turn_id, pieces=3, timeout=20)

    asked, _ = await abort_timed(person, turn_id)

    closed = await openai_peer.wait_for_disconnect(index=FLOODS)
    assert closed - asked < CLOSED_WITHIN, f"closed {(closed - asked) * 1000:.0f} ms after"
    assert await person.completion(turn_id, timeout=10) == (turn_id, True, ABORTED)
    assert all(r.ended is None for r in openai_peer.requests[:FLOODS]), "the floods stream on"


async def flood(browsers: Start, count: int) -> None:
    """Start ``count`` floods, each of its own person, and wait until each streams."""
    for _ in range(count):
        flooding = await browsers()
        await flooding.wait_text((await flooding.submit("Flood"))["turnId"], pieces=2, timeout=20)


# The drone's own loop is the relay's here (one test process), busy relaying the floods: a
# ping missed for that is the test's doing, not the drone's (a drone runs in its own process).
@pytest.mark.parametrize("relay_ping", [(5.0, 10.0)])
async def test_the_drone_acks_an_abort_at_once_while_every_worker_is_saturated(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Start, browsers: Start
) -> None:
    openai_peer.script(*[FLOOD] * FLOODS, SLOW)
    await start_drone(Upstream("openai", openai_peer), workers=2, concurrency=FLOODS + 1)
    await flood(browsers, FLOODS)
    person = await browsers()
    turn_id = (await person.submit("Stream slowly"))["turnId"]
    await person.wait_text(turn_id, pieces=3, timeout=20)

    _, acked = await abort_timed(person, turn_id)

    assert acked < ACK_WITHIN, f"acked after {acked * 1000:.0f} ms"
    assert await person.completion(turn_id, timeout=10) == (turn_id, True, ABORTED)


async def long_session(relay: RelayHandle, person: str, turns: int) -> str:
    """A session of ``person`` whose history holds ``turns`` finished turns."""
    user = await relay.relay.accounts.user(person)
    assert user is not None
    store = relay.relay.store
    await store.create_session(SessionRecord("s_long", user.user_id, "A long one"))
    history = []
    for number in range(turns):
        history.append(ChatMessage(role="user", content=f"question {number}"))
        history.append(ChatMessage(role="assistant", content=f"answer {number} " + "y" * 60))
    turn = TurnRecord("t_long", "s_long", user.user_id, "question 0", messages=history)
    await store.create_turn(turn)
    await store.end_turn("t_long", Ending("finished", "done", "finished", "done"))
    return "s_long"


class Heard(logging.Handler):
    """Sets ``event`` the moment a line that ``wanted`` is logged in this process (where the
    drones of ``start_drone`` run), without waiting for a poll."""

    def __init__(self, wanted: Callable[[str], bool]) -> None:
        super().__init__(logging.INFO)
        self.wanted = wanted
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.wanted(record.getMessage()):
            self.event.set()

    @contextlib.contextmanager
    def on(self, name: str) -> Iterator[None]:
        logger = logging.getLogger(name)
        level = logger.level
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.addHandler(self)
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


async def test_a_long_history_in_one_order_does_not_delay_another_orders_abort_ack(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browsers: Start,
) -> None:
    openai_peer.script(SLOW, Reply(chunks=["ok"]))
    await start_drone(Upstream("openai", openai_peer), workers=1, concurrency=2)
    person, long_one = await browsers(), await browsers("historian")
    turn_id = (await person.submit("Stream slowly"))["turnId"]
    await person.wait_text(turn_id, pieces=3, timeout=20)
    session_id = await long_session(relay, "historian", 1000)
    accepted = Heard(lambda line: "accepted=True" in line and turn_id not in line)
    with accepted.on("hangar.drone"):
        long_turn = (await long_one.submit("And now?", sessionId=session_id))["turnId"]
        # The abort goes the moment the drone hands the long order to its worker.
        await asyncio.wait_for(accepted.event.wait(), 10)
        asked, acked = await abort_timed(person, turn_id)

    assert acked < ACK_WITHIN, f"acked after {acked * 1000:.0f} ms"
    assert await long_one.completion(long_turn, timeout=20) == (long_turn, True, "ok")
    request = openai_peer.requests[1]
    assert len(request.messages) == 2001
    # The abort came while the worker still built the long order's request: the ack above did
    # not wait for it. (Whether the request then went out before or after the ack reached the
    # browser depends on the machine: both take a few milliseconds now.)
    assert request.started > asked, "the long order went out before the abort: nothing was tested"


def test_a_drone_refuses_a_worker_count_that_is_not_one(tmp_path: Path) -> None:
    done = subprocess.run(
        [*HANGAR, "drone", "--token", "x", "--workers", "many"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("--workers: expected auto or a whole number from 0 to 1024, got 'many'.")
    )


@pytest.mark.parametrize("when", ["loading", "starting its workers"])
def test_ctrl_c_while_the_drone_starts_is_one_clean_exit(tmp_path: Path, when: str) -> None:
    """A terminal's Ctrl-C reaches its whole foreground process group: the drone, and its
    workers once they are started, whatever they are doing then."""
    drone = subprocess.Popen(
        [
            *HANGAR,
            "drone",
            "--server",
            "http://127.0.0.1:9",
            "--token",
            "x",
            "--base-url",
            "http://127.0.0.1:9/v1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's process group of its own
    )
    try:
        deadline = time.monotonic() + 30
        program = "hangar" if when == "loading" else "worker_process"
        while time.monotonic() < deadline and drone.poll() is None:
            pids = [drone.pid] if when == "loading" else children_of(drone.pid)
            if any(importing(pid, program) for pid in pids):
                break
            time.sleep(0.002)
        os.killpg(drone.pid, signal.SIGINT)
        _, err = drone.communicate(timeout=30)
    finally:
        if drone.poll() is None:
            drone.kill()
            drone.wait()
    assert "Traceback" not in err, err
    assert drone.returncode in (0, 130), err


def importing(pid: int, program: str) -> bool:
    """Whether process ``pid`` (running ``program``) has begun loading what it runs on: a
    Python process that may not handle Ctrl-C itself yet."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        if program in Path(f"/proc/{pid}/cmdline").read_text():
            return "pydantic_core" in Path(f"/proc/{pid}/maps").read_text()
    return False


FDS = "ls -l /proc/$$/fd"
"""The shell's descriptors, as ``ls`` sees them while the shell waits for it."""


async def test_a_command_holds_no_descriptor_of_its_worker_or_drone(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
) -> None:
    """A worker started with the drone's ends of its pipes (uvloop's spawn leaves copies), and
    every command it ran, sandboxed or not, held them: one command wrote another turn's text
    and ending, one read the next turn's order, prompt and all. A command holds its own stdin,
    stdout and stderr now, and nothing else."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": FDS})]),
        Reply(chunks=["Listed."]),
    )
    drone_process(Upstream("openai", openai_peer), server=relay.url)  # on uvloop, as shipped
    await eventually(lambda: relay.relay.directory.local, timeout=20, what="the drone")

    turn_id = (await browser.submit("List your descriptors"))["turnId"]

    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "Listed.")
    [end] = [p for p in browser.progress(turn_id, "tool") if p["state"] == "end"]
    links = [line.split(" -> ") for line in end["result"].splitlines() if " -> " in line]
    held = {name.split()[-1]: target for name, target in links}
    own = {held[fd] for fd in ("0", "1", "2")}
    assert {fd: target for fd, target in held.items() if target not in own} == {}, held


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped (SIGSTOP) for the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_an_abort_answered_ends_the_turn_aborted_though_its_worker_dies_first(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser
) -> None:
    """ "Abort signaled" was answered, then the worker died before it ended the turn: the turn
    ended in error ("The drone's worker stopped."), not aborted by its person as promised."""
    upstream.peer.script(SLOW)
    await start_drone(upstream, workers=1)
    turn_id = (await browser.submit("Stream on"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (worker,) = worker_pids()

    with frozen(worker):
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
        os.kill(worker, signal.SIGKILL)

    assert await browser.completion(turn_id, timeout=10) == (turn_id, True, ABORTED)
    ending = await browser.ending(turn_id)
    person = next(args["user"]["name"] for event, args in browser.events if event == "hello")
    assert (ending["reason"], ending["endedBy"]) == ("aborted", person)


async def test_a_new_turn_goes_to_a_worker_that_answers_not_to_a_frozen_one(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Start,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The idle worker first in line was frozen: a new turn went to it all the same, and ended
    in error 15 s later when it was replaced, the other worker idle all along."""
    monkeypatch.setattr(watch, "WORKER_PING", 0.2)
    upstream.peer.script(Reply(chunks=["Answered ", "at once."]))
    await start_drone(upstream, workers=2, concurrency=2)
    await eventually(lambda: len(worker_pids()) == 2, what="both workers")

    with frozen(min(worker_pids())):  # the first started: the one picked first
        await asyncio.sleep(3 * watch.WORKER_PING)  # its pings go unanswered meanwhile
        turn_id = (await browser.submit("Quick one"))["turnId"]
        assert await browser.completion(turn_id, timeout=10) == (turn_id, True, "Answered at once.")


async def test_a_drone_whose_own_loop_was_held_up_keeps_its_workers(
    relay: RelayHandle,
    upstream: Upstream,
    start_drone: Start,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drone's process stopped (Ctrl-Z, a debugger) or starved past the bound its workers
    have to answer: back, it found their answers unread, counted its own pause against them,
    and killed them, their turns ended in error."""
    monkeypatch.setattr(watch, "WORKER_SILENT", 2.0)
    upstream.peer.script(Reply(chunks=[f"w{i} " for i in range(40)], delay=0.05))
    await start_drone(upstream, workers=1)
    turn_id = (await browser.submit("Stream on"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (worker,) = worker_pids()

    time.sleep(4.0)  # noqa: ASYNC251 (the fault itself: this process's loop, the drone's, held up)

    # The browser, held up too, may have lost its connection meanwhile: the store tells.
    async def ended() -> TurnRecord | None:
        turn = await relay.relay.store.get_turn(turn_id, messages=False)
        return turn if turn is not None and turn.status != "processing" else None

    turn = await eventually(ended, timeout=20, what="the turn's end")
    assert (turn.status, turn.result) == ("finished", "".join(f"w{i} " for i in range(40)).strip())
    assert worker_pids() == [worker]


async def test_a_drone_stopping_waits_briefly_for_a_frozen_worker_and_ends_its_turns_aborted(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser
) -> None:
    """Ctrl-C with a frozen worker: the drone waited 15 s for it, and its turn, which the
    drone's stop had aborted, ended in error."""
    upstream.peer.script(SLOW)
    drone = await start_drone(upstream, workers=1)
    turn_id = (await browser.submit("Stream on"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (worker,) = worker_pids()

    with frozen(worker):
        drone.stop()
        assert await browser.completion(turn_id, timeout=10) == (turn_id, True, ABORTED)
        assert (await browser.ending(turn_id))["reason"] == "operator"
        assert await asyncio.wait_for(drone.task, 10) == 0


def pipe_written_by(pid: int) -> Path:
    """The pipe a worker writes its events to (its stdout, moved past stdio as it starts)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        flags = int(Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().split()[3], 8)
        if int(fd.name) > 2 and os.readlink(fd).startswith("pipe:") and flags & os.O_WRONLY:
            return fd
    raise AssertionError(f"no pipe written by {pid}")


async def test_a_worker_event_the_drone_cannot_take_replaces_the_worker_and_ends_its_turn(
    relay: RelayHandle, upstream: Upstream, start_drone: Start, browser: Browser
) -> None:
    """A text event whose text was a list was taken: the turn's ending then failed on it, the
    ending was lost, the worker never replaced and its slot never freed (the turn stayed
    processing, the next got no model)."""
    upstream.peer.script(SLOW, Reply(chunks=["Next ", "one."]))
    await start_drone(upstream, workers=1)
    turn_id = (await browser.submit("Stream on"))["turnId"]
    await browser.wait_text(turn_id, pieces=2, timeout=20)
    (worker,) = worker_pids()

    with open(pipe_written_by(worker), "wb") as pipe:  # noqa: ASYNC230 (a pipe: no wait)
        pipe.write(frame([["text", turn_id, 0, ["not", "text"], 1]]))

    assert await browser.completion(turn_id, timeout=10) == (turn_id, False, WORKER_STOPPED)
    turn_id = (await browser.submit("Again"))["turnId"]
    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "Next one.")


SECRET = "drone-keyring-secret-789"
IN_A_KEYRING = f"""
import ctypes, os, platform, sys
calls = {{"x86_64": (248, 250), "aarch64": (217, 219)}}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(calls[1], 1, b"a-login")  # KEYCTL_JOIN_SESSION_KEYRING
secret = b"{SECRET}"
assert libc.syscall(calls[0], b"user", b"login:secret", secret, len(secret), -3) > 0
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""
"""Start the command given after it in a session keyring holding a secret, as a login may."""
READ_KEYS = """python3 - <<'PY'
import ctypes, platform
keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
found = ctypes.create_string_buffer(256)
for line in open("/proc/keys"):
    size = libc.syscall(keyctl, 11, int(line.split()[0], 16), found, 256)  # KEYCTL_READ
    print(line.split()[8], found.raw[:size] if size > 0 else "unread")
PY"""
"""Every key a command sees, and what it reads of each."""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="keyctl's number")
async def test_a_command_reads_nothing_of_the_drones_keyring(
    relay: RelayHandle, openai_peer: OpenAIPeer, browser: Browser, tmp_path: Path
) -> None:
    """A drone started in a session keyring holding a secret (a login's, say): a command, in
    the sandbox, read it out of the keyring, which bubblewrap leaves as it is."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": READ_KEYS})]),
        Reply(chunks=["Read."]),
    )
    settings = Upstream("openai", openai_peer).drone_settings()
    drone = subprocess.Popen(  # noqa: ASYNC220 (started at once; waited for below)
        [sys.executable, "-c", IN_A_KEYRING, "-m", "hangar.shared.cli", "drone",
         "--server", relay.url, "--token", DRONE_TOKEN, "--workdir", str(tmp_path),
         "--tools", "all=allow", "--provider", "openai", "--model", settings["model"],
         "--base-url", settings["base_url"], "--api-key", settings["api_key"]],
        cwd=ROOT,
    )  # fmt: skip
    try:
        await eventually(lambda: relay.relay.directory.local, timeout=20, what="the drone")
        turn_id = (await browser.submit("Read the keys"))["turnId"]
        assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "Read.")
    finally:
        drone.kill()
        drone.wait(10)
    [end] = [p for p in browser.progress(turn_id, "tool") if p["state"] == "end"]
    assert end["result"].startswith("exit code 0"), end["result"]
    assert SECRET not in end["result"], end["result"]


PLANT = (
    "mkdir -p hangar && printf '%s\\n' "
    '\'open(__file__ + ".ran", "w").write(repr(__import__("os").environ))\' '
    "> hangar/__init__.py"
)
"""A command that leaves Python code named as the drone's own package in its work directory."""


async def test_code_a_command_leaves_in_the_work_directory_never_runs_in_a_worker(
    relay: RelayHandle, openai_peer: OpenAIPeer, browser: Browser, tmp_path: Path
) -> None:
    """A drone works by default in the folder it was started in. Its workers, started from
    there with ``-m``, looked for modules there first: a command (in the sandbox) wrote
    ``hangar/__init__.py`` there, and the next worker to start (after a restart of the drone,
    or a worker replaced) ran it outside the sandbox, with the drone's environment."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": PLANT})]),
        Reply(chunks=["Planted."]),
        Reply(chunks=["Still here."]),
    )
    settings = Upstream("openai", openai_peer).drone_settings()
    drone = subprocess.Popen(  # noqa: ASYNC220 (started at once; waited for below)
        [sys.executable, "-P", "-m", "hangar.shared.cli", "drone", "--server", relay.url,
         "--token", DRONE_TOKEN, "--tools", "all=allow", "--workers", "1",
         "--provider", "openai", "--model", settings["model"],
         "--base-url", settings["base_url"], "--api-key", settings["api_key"]],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        await eventually(lambda: relay.relay.directory.local, timeout=20, what="the drone")
        first = await browser.submit("Leave a file")
        assert await browser.completion(first["turnId"], timeout=20) == (
            first["turnId"], True, "Planted."
        )  # fmt: skip
        assert (tmp_path / "hangar" / "__init__.py").exists()
        [worker] = worker_pids(drone.pid)
        os.kill(worker, signal.SIGKILL)
        await eventually(
            lambda: [pid for pid in worker_pids(drone.pid) if pid != worker and alive(pid)],
            timeout=20,
            what="a new worker",
        )
        second = await browser.submit("Go on", sessionId=first["sessionId"])
        assert await browser.completion(second["turnId"], timeout=20) == (
            second["turnId"], True, "Still here."
        )  # fmt: skip
    finally:
        drone.kill()
        drone.wait(10)
    assert not (tmp_path / "hangar" / "__init__.py.ran").exists()


@pytest.mark.parametrize(
    ("cause", "ending"),
    [
        ("cut_off", (False, CUT_OFF, "drone_lost")),
        ("person", (True, ABORTED, "aborted")),
        ("operator", (True, ABORTED, "operator")),
        (None, (False, WORKER_STOPPED, "drone_failed")),
    ],
)
def test_a_turn_whose_worker_died_ends_as_its_abort_said(
    cause: AbortCause | None, ending: tuple[bool, str, str]
) -> None:
    """A turn aborted because the drone was cut off from every relay, whose worker then died:
    the pool's watch of that worker failed on the cause ("cut_off" has no aborted reason), the
    worker was never replaced and the turn held its slot for good."""
    success, message, end = lost_ending(cause)
    assert (success, message, end.reason) == ending
