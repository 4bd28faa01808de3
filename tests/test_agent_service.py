"""Phases too narrow to hit over the network, landed exactly: the drone's ``AgentService`` with
its real provider and tools against the OpenAI peer; only the relay connection is replaced by a
recorder that can fire the abort at a precise point (as an abort arriving then would)."""

from __future__ import annotations

import array
import asyncio
import fcntl
import gc
import logging
import select
import termios
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.config import DroneConfig
from hangar.drone.pool import WorkerPool
from hangar.drone.providers import OpenAIProvider
from hangar.drone.service import AgentService, ToolSettings
from hangar.drone.tools.policy import ToolPolicy
from hangar.drone.worker_process import settings_wire
from hangar.shared.abort import AbortController
from hangar.shared.protocol import (
    ABORTED,
    NO_SUCH_CALL,
    RAN_ALREADY,
    STALLED,
    STOP_AFTER_STEP,
    TOOL_CANCELLED,
    ChatMessage,
    Ending,
    ToolCall,
    WorkOrder,
)
from tests.conftest import Upstream, eventually
from tests.test_upstream_close import provider_for

TWO_CALLS = Reply(
    chunks=[],
    tool_calls=[
        ScriptedToolCall("read_file", {"path": "a.txt"}),
        ScriptedToolCall("list_directory"),
    ],
)


class Recorder:
    """Outlet and Report at once: keeps what the drone would send to the relay."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.tools: list[tuple[str, str]] = []
        self.completions: list[tuple[str, bool, str]] = []
        self.endings: list[Ending] = []
        self.on_message: Callable[[ChatMessage], None] | None = None
        self.on_tool: Callable[[str, str], None] | None = None
        self.completed = asyncio.Event()

    def report_for(self, turn_id: str) -> Recorder:
        return self

    async def text(self, text: str, depth: int, chunks: int = 1) -> None:
        return None

    async def message(self, message: ChatMessage) -> None:
        self.messages.append(message)
        if self.on_message:
            self.on_message(message)

    async def tool(self, call: ToolCall, state: str, depth: int, result: str | None = None) -> None:
        self.tools.append((call.name, state))
        if self.on_tool:
            self.on_tool(call.name, state)

    async def complete(self, turn_id: str, success: bool, message: str, ending: Ending) -> None:
        self.completions.append((turn_id, success, message))
        self.endings.append(ending)
        self.completed.set()


def service_for(
    peer: OpenAIPeer, recorder: Recorder, workdir: Path, **settings: Any
) -> AgentService:
    (workdir / "a.txt").write_text("contents of a")
    provider = OpenAIProvider("gpt-test", api_key="k", base_url=peer.base_url + "/v1")
    return AgentService(
        provider, recorder, root=AbortController().signal, tools=tools_in(workdir), **settings
    )


def tools_in(workdir: Path) -> ToolSettings:
    """Every tool runs at once (approvals have tests of their own)."""
    return ToolSettings(workdir, policy=ToolPolicy.allow_all())


def order(turn_id: str, prompt: str, history: list[ChatMessage] | None = None) -> WorkOrder:
    return WorkOrder(turn_id=turn_id, session_id="s_1", prompt=prompt, history=history or [])


async def finished(recorder: Recorder) -> tuple[str, bool, str]:
    await asyncio.wait_for(recorder.completed.wait(), 5)
    recorder.completed.clear()
    return recorder.completions[-1]


async def the_conversation_goes_on(
    service: AgentService, recorder: Recorder, peer: OpenAIPeer, first_prompt: str
) -> None:
    history = [ChatMessage(role="user", content=first_prompt), *recorder.messages]
    peer.script(Reply(chunks=["Carrying on."]))
    service.accept(order("t_2", "And now?", history))
    assert await finished(recorder) == ("t_2", True, "Carrying on.")
    assert peer.requests[-1].rejected is None


async def test_abort_of_a_queued_order_never_calls_the_provider(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path)

    assert service.accept(order("t_1", "Hello")) == {"ok": True}
    assert service.abort("t_1") == (True, "Abort signaled")

    assert await finished(recorder) == ("t_1", True, "aborted")
    assert openai_peer.requests == []
    assert recorder.messages == []
    await service.drain()


async def test_abort_after_the_model_asked_for_tools_runs_none_of_them(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path)
    openai_peer.script(TWO_CALLS)

    def abort_when_tools_are_asked_for(message: ChatMessage) -> None:
        if message.tool_calls:
            service.abort("t_1")

    recorder.on_message = abort_when_tools_are_asked_for
    service.accept(order("t_1", "Look around"))

    assert await finished(recorder) == ("t_1", True, "aborted")
    assert recorder.tools == [("read_file", "cancelled"), ("list_directory", "cancelled")]
    assert [(m.role, m.content) for m in recorder.messages] == [
        ("assistant", ""),
        ("tool", TOOL_CANCELLED),
        ("tool", TOOL_CANCELLED),
    ]
    calls = recorder.messages[0].tool_calls or []
    assert [m.tool_call_id for m in recorder.messages[1:]] == [c.id for c in calls]
    await the_conversation_goes_on(service, recorder, openai_peer, "Look around")


async def test_abort_between_the_tool_round_and_the_next_model_call_keeps_real_results(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path)
    openai_peer.script(TWO_CALLS)

    def abort_after_last_tool(name: str, state: str) -> None:
        if (name, state) == ("list_directory", "end"):
            service.abort("t_1")

    recorder.on_tool = abort_after_last_tool
    service.accept(order("t_1", "Look around"))

    assert await finished(recorder) == ("t_1", True, "aborted")
    assert len(openai_peer.requests) == 1, "no model call after the abort"
    assert [(m.role, m.content) for m in recorder.messages] == [
        ("assistant", ""),
        ("tool", "contents of a"),
        ("tool", "a.txt"),
    ]
    await the_conversation_goes_on(service, recorder, openai_peer, "Look around")


@pytest.mark.parametrize("workers", [0, 1], ids=["in the drone", "in a worker"])
async def test_an_abort_acked_as_the_answer_comes_in_ends_the_turn_aborted(
    openai_peer: OpenAIPeer, tmp_path: Path, workers: int
) -> None:
    """The drone answers "Abort signaled" the moment the whole answer reaches it: the turn ends
    aborted, as that answer promises (docs/protocol.md, "Aborting"), and keeps the answer. In a
    worker, the answer and its finished ending are already on their way to the drone then."""
    recorder = Recorder()
    openai_peer.script(Reply(chunks=["All ", "of ", "it."]))
    work: AgentService | WorkerPool
    if workers:
        config = DroneConfig(
            provider="openai", model="gpt-test", api_key="k", base_url=openai_peer.base_url + "/v1"
        )
        settings = settings_wire(config, None, log_level=logging.WARNING)
        root = AbortController().signal
        work = WorkerPool(settings, recorder, root=root, workers=workers, concurrency=2)
        await work.start()
    else:
        work = service_for(openai_peer, recorder, tmp_path)
    answers: list[tuple[bool, str]] = []
    recorder.on_message = lambda message: answers.append(work.abort("t_1"))
    try:
        assert work.accept(order("t_1", "Answer in full")) == {"ok": True}
        assert await finished(recorder) == ("t_1", True, "aborted")
    finally:
        await (work.close() if isinstance(work, WorkerPool) else work.drain())
    assert answers == [(True, "Abort signaled")]
    assert recorder.endings[-1].reason == "aborted"
    assert [(m.role, m.content) for m in recorder.messages] == [("assistant", "All of it.")]


@pytest.mark.parametrize("workers", [0, 1], ids=["in the drone", "in a worker"])
async def test_stop_after_this_step_before_the_order_arrives_stops_after_its_first_step(
    openai_peer: OpenAIPeer, tmp_path: Path, workers: int
) -> None:
    """Asked between the relay's sending the order and its arrival, "stop after this step" was
    answered "No active work order to abort" and forgotten: the turn ran every step. It now
    stops after the first, as if asked while the model's first token was awaited."""
    recorder = Recorder()
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("read_file", {"path": "a.txt"})]),
        Reply(chunks=["never asked"]),
    )
    work: AgentService | WorkerPool
    if workers:
        config = DroneConfig(
            provider="openai", model="gpt-test", api_key="k", base_url=openai_peer.base_url + "/v1"
        )
        settings = settings_wire(config, tools_in(tmp_path), log_level=logging.WARNING)
        work = WorkerPool(
            settings, recorder, root=AbortController().signal, workers=1, concurrency=2
        )
        await work.start()
    else:
        work = service_for(openai_peer, recorder, tmp_path)
    (tmp_path / "a.txt").write_text("contents of a")
    try:
        assert work.abort("t_1", "after_step") == (True, STOP_AFTER_STEP)
        assert work.accept(order("t_1", "Read it, then go on")) == {"ok": True}
        assert await finished(recorder) == ("t_1", True, ABORTED)
    finally:
        await (work.close() if isinstance(work, WorkerPool) else work.drain())
    # The step was the model's call (docs/protocol.md, "stop after this step"): its tool is not run.
    assert len(openai_peer.requests) == 1, "no model call after the step"
    assert [(m.role, m.content) for m in recorder.messages[1:]] == [("tool", TOOL_CANCELLED)]


async def test_stop_after_this_step_in_a_sub_agent_keeps_what_its_step_did(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """The sub-agent's step finished (its tool ran), but the turn's own call that started it
    was stored as cancelled: the next turn's model was told nothing had happened."""
    recorder = Recorder()
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": "read a"})]),
        Reply(chunks=[], tool_calls=[ScriptedToolCall("read_file", {"path": "a.txt"})]),
        Reply(chunks=["never asked"]),
    )
    service = service_for(openai_peer, recorder, tmp_path)
    answers: list[tuple[bool, str]] = []

    def stop_during_the_sub_agents_step(name: str, state: str) -> None:
        if (name, state) == ("read_file", "start"):
            answers.append(service.abort("t_1", "after_step"))

    recorder.on_tool = stop_during_the_sub_agents_step
    service.accept(order("t_1", "Have a sub-agent read a"))

    assert await finished(recorder) == ("t_1", True, ABORTED)
    await service.drain()
    assert answers == [(True, STOP_AFTER_STEP)]
    assert len(openai_peer.requests) == 2, "no model call after the sub-agent's step"
    spawned = recorder.messages[1]
    assert spawned.role == "tool" and "contents of a" in spawned.content, spawned.content
    assert spawned.content != TOOL_CANCELLED


DECLINE_BYTES = 200
"""Bytes a worker writes as it declines a call (its tool event and its log line); a pong is 12."""


def unread(fd: int) -> int:
    """Bytes waiting in a pipe, unread."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


async def test_an_approval_racing_its_workers_timeout_is_answered_as_the_worker_took_it(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """The drone answered an approval from its own copy of the waiting calls, {ok: true}, while
    the worker had declined the call (its wait for a person ran out) and the news was on its
    way: the call never ran, and the relay kept its "always"."""
    recorder = Recorder()
    write = ScriptedToolCall("write_file", {"path": "n.txt", "content": "hi"})
    openai_peer.script(Reply(chunks=[], tool_calls=[write]), Reply(chunks=["Done."]))
    config = DroneConfig(
        provider="openai", model="gpt-test", api_key="k", base_url=openai_peer.base_url + "/v1"
    )
    tools = ToolSettings(tmp_path, approval_timeout=0.5)  # write_file asks, by default
    settings = settings_wire(config, tools, log_level=logging.WARNING)
    pool = WorkerPool(settings, recorder, root=AbortController().signal, workers=1, concurrency=1)
    await pool.start()
    try:
        pool.accept(order("t_1", "Write a note"))
        await eventually(pool.waiting_calls, what="the write to wait for approval")
        ((_, call, _),) = pool.waiting_calls()
        # The drone's loop busy until the worker's decline (0.5 s on, a tool event and a log
        # line: more than a pong) waits in the pipe, unread.
        process: Any = pool.workers[0].process
        pipe = process._transport.get_pipe_transport(1).get_extra_info("pipe").fileno()
        deadline = time.monotonic() + 10
        while unread(pipe) < DECLINE_BYTES and time.monotonic() < deadline:
            select.select([], [], [], 0.005)  # the loop is the drone's, held on purpose

        refusal = await pool.decide("t_1", call.id, approve=True, always=True)

        assert (await finished(recorder))[:2] == ("t_1", True)
    finally:
        await pool.close()
    assert refusal == NO_SUCH_CALL
    assert not (tmp_path / "n.txt").exists()


async def test_a_busy_drone_refuses_a_second_order(openai_peer: OpenAIPeer, tmp_path: Path) -> None:
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path)
    openai_peer.script(Reply(chunks=["x"], stall_before=30))
    service.accept(order("t_1", "First"))

    assert service.accept(order("t_2", "Second")) == {"ok": False, "error": "The drone is busy."}

    service.abort("t_1")
    assert await finished(recorder) == ("t_1", True, "aborted")


async def test_an_order_sent_again_runs_once(openai_peer: OpenAIPeer, tmp_path: Path) -> None:
    """The relay sends an order again (``resent``) when its drone's answer was lost on the way;
    an order put back in line and sent anew (the drone had dropped it) runs again."""
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path)
    openai_peer.script(Reply(chunks=["Once", " only."], delay=0.2), Reply(chunks=["Anew."]))
    again = order("t_1", "Do it").model_copy(update={"resent": True})
    assert service.accept(order("t_1", "Do it")) == {"ok": True}

    assert service.accept(again) == {"ok": True}  # running: as before
    assert await finished(recorder) == ("t_1", True, "Once only.")
    assert service.accept(again) == {"ok": False, "error": RAN_ALREADY}
    assert len(openai_peer.requests) == 1

    assert service.accept(order("t_1", "Do it")) == {"ok": True}  # from the line: runs anew
    assert await finished(recorder) == ("t_1", True, "Anew.")


@pytest.mark.parametrize("stall_at", ["before the first chunk", "mid-answer"])
async def test_a_stalled_model_stream_is_closed_and_the_turn_fails_with_a_clear_error(
    upstream: Upstream, tmp_path: Path, stall_at: str
) -> None:
    recorder = Recorder()
    provider = provider_for(upstream.provider, upstream.peer.base_url)
    service = AgentService(
        provider, recorder, root=AbortController().signal, tools=tools_in(tmp_path), stall=0.5
    )
    if stall_at == "mid-answer":
        upstream.peer.script(Reply(chunks=["so ", "far ", "and"], stall_after=(2, 60)))
    else:
        upstream.peer.script(Reply(chunks=["never"], stall_before=60))
    try:
        service.accept(order("t_1", "Answer slowly"))

        assert await finished(recorder) == ("t_1", False, STALLED)
        assert recorder.endings[-1].reason == "stalled"
        await eventually(
            lambda: upstream.peer.requests[0].disconnected, timeout=5, what="the stream closed"
        )
        kept = [(m.role, m.content, m.aborted) for m in recorder.messages]
        assert kept == ([("assistant", "so far ", True)] if stall_at == "mid-answer" else [])
    finally:
        await provider.close()


async def test_a_thousand_finished_work_orders_leave_no_timer_or_callback_behind(
    openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """Each work order has a deadline; some run a shell command, some a sub-agent, some are
    aborted. Once all have ended, nothing they set up is still waiting for the drone's root."""
    loop = asyncio.get_running_loop()
    recorder = Recorder()
    root = AbortController()
    provider = OpenAIProvider("gpt-test", api_key="k", base_url=openai_peer.base_url + "/v1")
    service = AgentService(
        provider,
        recorder,
        root=root.signal,
        concurrency=50,
        deadline=1800,
        tools=tools_in(tmp_path),
    )
    shell = Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": "true"})])
    sub = Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": "look"})])
    try:
        for batch in range(20):
            for index in range(50):
                number = batch * 50 + index
                if number % 10 == 1:
                    openai_peer.script(shell, Reply(chunks=["ran"]))
                elif number % 10 == 2:
                    openai_peer.script(sub, Reply(chunks=["sub done"]), Reply(chunks=["ok"]))
                else:
                    openai_peer.script(Reply(chunks=["done"]))
                # Replies go to requests in arrival order: which order gets which does not
                # matter, the batch as a whole runs shell commands and sub-agents.
                assert service.accept(order(f"t_{number}", "Go")) == {"ok": True}
                if number % 10 == 3:
                    service.abort(f"t_{number}")
            assert len(hangar_timers(loop)) >= 45  # the running orders' deadlines, at least
            await service.drain()
        assert len(recorder.completions) == 1000
        assert all(success for _, success, _ in recorder.completions)
        assert ("run_shell", "end") in recorder.tools
        assert ("spawn_subagent", "end") in recorder.tools
    finally:
        await provider.close()

    assert service.running == {}
    assert root.signal.subscribers == 0
    assert hangar_timers(loop) == []


ENDINGS = {
    "aborted": ([Reply(chunks=["tok "] * 100, delay=0.05)], (True, ABORTED, "aborted")),
    "stalled": ([Reply(chunks=["never"], stall_before=60)], (False, STALLED, "stalled")),
    "past its deadline": (
        [Reply(chunks=["tok "] * 100, delay=0.1)],
        (False, "Timed out after 1 s", "deadline"),
    ),
    "finished": ([Reply(chunks=["All ", "done."])], (True, "All done.", "finished")),
    "failed": (
        [Reply(status=400, error_message="No such model.")],
        (False, "The model service answered 400: No such model.", "model_failed"),
    ),
    "after tools and a sub-agent": (
        [
            TWO_CALLS,
            Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": "look"})]),
            Reply(chunks=["sub done"]),
            Reply(chunks=["ok"]),
        ],
        (True, "ok", "finished"),
    ),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_turn_is_freed_as_it_ends_not_left_to_the_cyclic_collector(
    openai_peer: OpenAIPeer, tmp_path: Path, ending: str
) -> None:
    """Whatever ends a turn, what it set up (its agent, model stream, request and controllers)
    is freed with it. Kept in reference cycles (an abort reason holds the frames it was raised
    through, and they hold its signal), a burst of aborted turns set off a full walk of the
    cyclic collector in every worker at once, while other turns' aborts waited for the cores
    (docs/performance.md, "A burst of 200 aborts at once")."""
    replies, expected = ENDINGS[ending]
    recorder = Recorder()
    service = service_for(openai_peer, recorder, tmp_path, stall=0.5, deadline=1)
    openai_peer.script(*replies)
    gc.collect()
    gc.disable()
    try:
        assert service.accept(order("t_1", "Go")) == {"ok": True}
        running = service.running["t_1"]
        task, freed = running.task, weakref.ref(running)
        del running
        assert task is not None
        if ending == "aborted":
            await eventually(lambda: openai_peer.chunks_sent >= 2, what="the answer streaming")
            assert service.abort("t_1") == (True, "Abort signaled")
        await asyncio.wait_for(task, 5)
        assert (*recorder.completions[-1][1:], recorder.endings[-1].reason) == expected
        assert freed() is None, "the ended turn is still held, in reference cycles"
    finally:
        gc.enable()
        await service.close()


def hangar_timers(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
    """Timers Hangar's own code has scheduled and not cancelled (the standard loop's list)."""
    scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]
    return [
        handle
        for handle in scheduled
        if not handle.cancelled()
        and getattr(handle._callback, "__module__", "").startswith("hangar.")  # type: ignore[attr-defined]
    ]
