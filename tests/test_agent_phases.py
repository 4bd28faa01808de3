"""Abort in every phase of the agent loop (the per-phase table of ``docs/architecture.md``),
through a real relay and drone.

For each phase: the turn ends ``aborted``, exactly the right messages are stored, and a second
work order in the same session is accepted by an upstream that rejects invalid histories.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.peers import OllamaPeer, OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.agent import MAX_TOOL_RESULT_CHARS
from hangar.shared.protocol import ABORT_SIGNALED, TOOL_CANCELLED, TOOL_LOST, ChatMessage
from tests.conftest import Browser, DroneHandle, RelayHandle, Upstream, eventually
from tests.test_tool_sandbox import processes_running, unique_sleep

SLOW = Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03)


def call(name: str, **arguments: str) -> ScriptedToolCall:
    return ScriptedToolCall(name, dict(arguments))


@pytest.fixture
async def drone(
    start_drone: Callable[..., Any], openai_peer: OpenAIPeer, tmp_path: Path
) -> DroneHandle:
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "a.txt").write_text("hello from a.txt")
    # The slow site of the fetch test is on this machine: private addresses are allowed here.
    handle: DroneHandle = await start_drone(
        Upstream("openai", openai_peer), workdir=str(workdir), allow_private_urls=True
    )
    return handle


def workdir_of(drone: DroneHandle) -> Path:
    assert drone.config.workdir is not None
    return Path(drone.config.workdir)


async def stored_messages(relay: RelayHandle, turn_id: str) -> list[tuple[str, str, list[str]]]:
    turn = await relay.relay.store.get_turn(turn_id)
    assert turn is not None
    return [(m.role, m.content, _links(m)) for m in turn.messages]


def _links(message: ChatMessage) -> list[str]:
    """The tool names an assistant message calls, or the call id a tool message answers."""
    if message.tool_calls:
        return [c.name for c in message.tool_calls]
    return [message.tool_call_id] if message.tool_call_id else []


async def tool_started(browser: Browser, turn_id: str, name: str) -> dict[str, Any]:
    def started() -> dict[str, Any] | None:
        return next(
            (
                p
                for p in browser.progress(turn_id, "tool")
                if p["name"] == name and p["state"] == "start"
            ),
            None,
        )

    found: dict[str, Any] = await eventually(started, what=f"{name} to start")
    return found


async def the_session_goes_on(
    relay: RelayHandle, browser: Browser, peer: OpenAIPeer, session_id: str
) -> None:
    """A second work order in the session is accepted by the upstream and finishes."""
    peer.script(Reply(chunks=["Carrying on."]))
    ack = await browser.submit("And now?", sessionId=session_id)
    assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, "Carrying on.")
    assert peer.requests[-1].rejected is None
    assert peer.requests[-1].messages[-1] == {"role": "user", "content": "And now?"}


async def test_abort_while_a_shell_tool_runs_kills_its_whole_process_tree(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    # Found from the host by their command lines: inside the command's own PID namespace,
    # ``$$`` and ``$!`` are not host pids.
    child, grandchild = unique_sleep(), unique_sleep()
    command = f"{' '.join(child)} & setsid {' '.join(grandchild)} & wait"
    openai_peer.script(Reply(chunks=[], tool_calls=[call("run_shell", command=command)]))
    ack = await browser.submit("Run the slow thing")
    turn_id = ack["turnId"]
    await tool_started(browser, turn_id, "run_shell")
    await eventually(
        lambda: processes_running(*child) and processes_running(*grandchild),
        what="the command's children",
    )

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)

    await eventually(
        lambda: not processes_running(*child) and not processes_running(*grandchild),
        timeout=2,
        what="no orphan",
    )
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    call_id = browser.progress(turn_id, "tool")[0]["callId"]
    assert await stored_messages(relay, turn_id) == [
        ("user", "Run the slow thing", []),
        ("assistant", "", ["run_shell"]),
        ("tool", TOOL_CANCELLED, [call_id]),
    ]
    cancelled = [p for p in browser.progress(turn_id, "tool") if p["state"] == "cancelled"]
    assert [p["name"] for p in cancelled] == ["run_shell"]
    await the_session_goes_on(relay, browser, openai_peer, ack["sessionId"])


async def test_abort_between_several_tool_calls_keeps_the_finished_results(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    openai_peer.script(
        Reply(
            chunks=["Reading first. "],
            tool_calls=[
                call("read_file", path="a.txt"),
                call("run_shell", command="sleep 60"),
                call("list_directory", path="."),
            ],
        )
    )
    ack = await browser.submit("Do three things")
    turn_id = ack["turnId"]
    await tool_started(browser, turn_id, "run_shell")

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)

    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    messages = await stored_messages(relay, turn_id)
    assert [(role, content) for role, content, _ in messages] == [
        ("user", "Do three things"),
        ("assistant", "Reading first. "),
        ("tool", "hello from a.txt"),
        ("tool", TOOL_CANCELLED),
        ("tool", TOOL_CANCELLED),
    ]
    assert messages[1][2] == ["read_file", "run_shell", "list_directory"]
    await the_session_goes_on(relay, browser, openai_peer, ack["sessionId"])


async def test_abort_during_a_slow_url_fetch_closes_the_connection(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone: DroneHandle,
    browser: Browser,
    stalling_site: StallingSite,
) -> None:
    openai_peer.script(Reply(chunks=[], tool_calls=[call("fetch_url", url=stalling_site.url)]))
    ack = await browser.submit("Fetch the slow page")
    turn_id = ack["turnId"]
    await asyncio.wait_for(stalling_site.requested.wait(), 5)

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)

    await asyncio.wait_for(stalling_site.disconnected.wait(), 2)
    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    messages = await stored_messages(relay, turn_id)
    assert [m[:2] for m in messages][-1] == ("tool", TOOL_CANCELLED)
    await the_session_goes_on(relay, browser, openai_peer, ack["sessionId"])


async def test_abort_during_a_sub_agent_two_levels_deep_stops_every_level(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    openai_peer.script(
        Reply(chunks=[], tool_calls=[call("spawn_subagent", task="level one")]),
        Reply(chunks=[], tool_calls=[call("spawn_subagent", task="level two")]),
        SLOW,
    )
    ack = await browser.submit("Delegate deeply")
    turn_id = ack["turnId"]
    await eventually(
        lambda: [p for p in browser.progress(turn_id) if p["depth"] == 2][2:],
        what="text from the grandchild",
    )

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)

    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    await openai_peer.wait_for_disconnect(index=2)
    for index in range(3):
        await openai_peer.wait_for_end(index=index)
    assert len(openai_peer.requests) == 3
    assert [r.messages[-1]["content"] for r in openai_peer.requests] == [
        "Delegate deeply",
        "level one",
        "level two",
    ]
    cancelled = [(p["name"], p["depth"]) for p in browser.progress(turn_id, "tool")
                 if p["state"] == "cancelled"]  # fmt: skip
    assert cancelled == [("spawn_subagent", 1), ("spawn_subagent", 0)]
    assert [m[:2] for m in await stored_messages(relay, turn_id)] == [
        ("user", "Delegate deeply"),
        ("assistant", ""),
        ("tool", TOOL_CANCELLED),
    ]
    assert len(browser.completions(turn_id)) == 1
    await the_session_goes_on(relay, browser, openai_peer, ack["sessionId"])


async def test_a_sub_agent_answer_comes_back_as_the_tool_result(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    openai_peer.script(
        Reply(chunks=[], tool_calls=[call("spawn_subagent", task="count the files")]),
        Reply(chunks=["There is ", "one file."]),
        Reply(chunks=["The sub-agent says: one file."]),
    )
    ack = await browser.submit("How many files?")

    _, success, message = await browser.completion(ack["turnId"])

    assert (success, message) == (True, "The sub-agent says: one file.")
    sub_text = "".join(p["text"] for p in browser.progress(ack["turnId"]) if p["depth"] == 1)
    assert sub_text == "There is one file."
    assert openai_peer.requests[2].messages[-1]["content"] == "There is one file."


async def test_a_failing_tool_gives_the_model_an_error_and_the_loop_goes_on(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                call("read_file", path="missing.txt"),
                call("read_file", path="../../etc/passwd"),
                call("no_such_tool"),
            ],
        ),
        Reply(chunks=["I could not read them."]),
    )
    ack = await browser.submit("Read the files")

    assert (await browser.completion(ack["turnId"]))[1:] == (True, "I could not read them.")
    results = [m["content"] for m in openai_peer.requests[1].messages if m["role"] == "tool"]
    assert results == [
        "Error: There is no file 'missing.txt'.",
        "Error: The path '../../etc/passwd' is outside the work directory.",
        "Error: There is no tool named 'no_such_tool'.",
    ]


async def test_tools_read_write_list_and_run_inside_the_work_directory(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                call("write_file", path="notes/b.txt", content="written"),
                call("list_directory", path="."),
                call("read_file", path="notes/b.txt"),
                call("run_shell", command="cat a.txt; exit 3"),
            ],
        ),
        Reply(chunks=["Done."]),
    )
    ack = await browser.submit("Use the tools")

    assert (await browser.completion(ack["turnId"]))[1:] == (True, "Done.")
    results = [m["content"] for m in openai_peer.requests[1].messages if m["role"] == "tool"]
    assert results == [
        "Wrote 7 characters to notes/b.txt.",
        "notes/\na.txt",
        "written",
        "exit code 3\nhello from a.txt",
    ]
    assert (workdir_of(drone) / "notes" / "b.txt").read_text() == "written"


async def test_the_deadline_ends_the_turn_in_error_and_closes_the_stream(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer), deadline=0.5, workdir=None)
    ack = await browser.submit("Take forever")

    assert await browser.completion(ack["turnId"]) == (
        ack["turnId"],
        False,
        "Timed out after 0.5 s",
    )
    await openai_peer.wait_for_disconnect()
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None and (turn.status, turn.reason) == ("error", "deadline")


async def test_ollama_tool_calls_run_and_their_results_go_back(
    relay: RelayHandle,
    ollama_peer: OllamaPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    tmp_path: Path,
) -> None:
    (tmp_path / "a.txt").write_text("ollama reads this")
    ollama_peer.script(
        Reply(chunks=[], tool_calls=[call("read_file", path="a.txt")]),
        Reply(chunks=["It says hello."]),
    )
    await start_drone(Upstream("ollama", ollama_peer), workdir=str(tmp_path))
    ack = await browser.submit("What does a.txt say?")

    assert (await browser.completion(ack["turnId"]))[1:] == (True, "It says hello.")
    tool_messages = [m for m in ollama_peer.requests[1].messages if m["role"] == "tool"]
    assert tool_messages[0]["content"] == "ollama reads this"
    assert tool_messages[0]["tool_name"] == "read_file"


# ---- helpers


class StallingSite:
    """A web page that never answers, and notices when the client hangs up."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.url = ""

    async def handler(self, request: web.Request) -> web.Response:
        self.requested.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        return web.Response()


@pytest.fixture
async def stalling_site() -> AsyncIterator[StallingSite]:
    site = StallingSite()
    app = web.Application()
    app.router.add_get("/slow", site.handler)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    port = tcp._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    site.url = f"http://127.0.0.1:{port}/slow"
    yield site
    await runner.cleanup()


async def test_text_that_is_not_unicode_reaches_the_person_replaced_and_the_turn_ends(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    """Half a surrogate pair from the model (JSON's "\\ud83d" alone) or a file name that is not
    UTF-8 is no character: it shows as U+FFFD, and the turn, its history and the next turn go
    on as with any other text."""
    bad_name = bytes(workdir_of(drone)) + b"/bad\xffname.txt"
    os.close(os.open(bad_name, os.O_CREAT | os.O_WRONLY, 0o644))
    openai_peer.script(
        Reply(chunks=["Looking. "], tool_calls=[call("list_directory", path=".")]),
        Reply(chunks=["Half an emoji \ud83d", " here."]),
        Reply(chunks=["Next."]),
    )
    first = await browser.submit("List the files")

    answer = "Half an emoji \ufffd here."
    assert await browser.completion(first["turnId"]) == (first["turnId"], True, answer)
    assert browser.text(first["turnId"]) == "Looking. " + answer
    results = [m["content"] for m in openai_peer.requests[1].messages if m["role"] == "tool"]
    assert results == ["a.txt\nbad\ufffdname.txt"]
    second = await browser.submit("And now?", sessionId=first["sessionId"])
    assert await browser.completion(second["turnId"]) == (second["turnId"], True, "Next.")
    assert openai_peer.requests[-1].rejected is None
    turn = await relay.relay.store.get_turn(first["turnId"])
    assert turn is not None and turn.text == "Looking. " + answer


async def test_a_tool_result_longer_than_a_model_should_read_is_cut_and_the_turn_goes_on(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    """A sub-agent's answer of 1.2 million characters: the parent gets its first
    ``MAX_TOOL_RESULT_CHARS`` and a count of the rest; nothing else on the drone notices."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[call("spawn_subagent", task="write a lot")]),
        Reply(chunks=["y" * 100_000] * 12),
        Reply(chunks=["Done."]),
    )
    ack = await browser.submit("Delegate")

    assert await browser.completion(ack["turnId"], timeout=30) == (ack["turnId"], True, "Done.")
    results = [m["content"] for m in openai_peer.requests[2].messages if m["role"] == "tool"]
    left = 1_200_000 - MAX_TOOL_RESULT_CHARS
    assert results == ["y" * MAX_TOOL_RESULT_CHARS + f"\n[… {left} more characters not shown]"]


async def test_a_file_of_a_megabyte_written_by_the_model_is_written(
    relay: RelayHandle, openai_peer: OpenAIPeer, drone: DroneHandle, browser: Browser
) -> None:
    content = "a" * 1_100_000
    openai_peer.script(  # the content first: the path must still show, past the cut
        Reply(chunks=[], tool_calls=[call("write_file", content=content, path="big.txt")]),
        Reply(chunks=["Written."]),
    )
    ack = await browser.submit("Write a big file")

    assert await browser.completion(ack["turnId"], timeout=30) == (
        ack["turnId"],
        True,
        "Written.",
    )
    assert (workdir_of(drone) / "big.txt").read_text() == content
    tool = next(
        a for e, a in browser.events if e == "workOrderProgress" and a.get("state") == "start"
    )
    shown = json.loads(tool["arguments"])
    assert shown["path"] == "big.txt"
    assert shown["content"] == "a" * 20_000 + "[… 1080000 more characters not shown]"


async def test_a_tool_cut_short_by_the_deadline_says_so_in_the_history(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    tmp_path: Path,
) -> None:
    """Its result tells the model (and the person, on a retry) why it has none: the turn
    ended; not "cancelled by user", nobody cancelled it."""
    openai_peer.script(Reply(chunks=[], tool_calls=[call("run_shell", command="sleep 30")]))
    await start_drone(Upstream("openai", openai_peer), deadline=1.0, workdir=str(tmp_path))
    ack = await browser.submit("Wait for it")

    assert (await browser.completion(ack["turnId"], timeout=10))[1:] == (
        False,
        "Timed out after 1 s",
    )
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None
    assert [(m.role, m.content) for m in turn.messages[2:]] == [("tool", TOOL_LOST)]
