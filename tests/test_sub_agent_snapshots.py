"""A page opened while a sub-agent works shows what the sub-agent streamed before it came: the
snapshot of a running turn (``openSession``) holds its sub-agents' output (docs/protocol.md,
``openSession``). Before, it held only the turn's own text, and such a page showed the
sub-agent's output only from then on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply
from bench.services import OwnRedis
from hangar.server.accounts import Accounts
from hangar.server.live_state import LocalLiveState
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.sub_agents import runs
from tests.conftest import Browser, People, RelayHandle, Upstream, eventually
from tests.test_agent_phases import call

SUB_WORDS = [f"s{i} " for i in range(100)]
MAX_TEXT_EVENT = 65_536  # characters of one text event (docs/protocol.md)


@pytest.fixture
async def owner(
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browsers: Callable[..., Any],
    tmp_path: Path,
) -> Browser:
    """A person's browser, and a drone whose work directory holds ``a.txt``."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "a.txt").write_text("hello from a.txt")
    await start_drone(Upstream("openai", openai_peer), workdir=str(workdir))
    browser: Browser = await browsers("ada")
    return browser


async def test_a_page_opened_mid_sub_agent_gets_what_the_sub_agent_streamed_so_far(
    relay: RelayHandle, openai_peer: OpenAIPeer, owner: Browser, browsers: Callable[..., Any]
) -> None:
    openai_peer.script(
        Reply(chunks=["Asking a helper. "], tool_calls=[call("spawn_subagent", task="read a")]),
        Reply(chunks=["Reading. "], tool_calls=[call("read_file", path="a.txt")]),
        Reply(chunks=SUB_WORDS, delay=0.03),
        Reply(chunks=["The helper read it."]),
    )
    ack = await owner.submit("Read a.txt through a helper")
    turn_id = ack["turnId"]
    await eventually(
        lambda: len([p for p in owner.progress(turn_id) if p["depth"] == 1]) >= 4,
        what="the sub-agent streaming",
    )

    second_tab: Browser = await browsers("ada")
    snapshot = await second_tab.call("openSession", {"sessionId": ack["sessionId"]})

    [turn] = snapshot["turns"]
    assert turn["status"] == "processing"
    spawn = next(p for p in owner.progress(turn_id, "tool") if p["name"] == "spawn_subagent")
    [run] = turn["subAgents"]
    assert run["after"] == spawn["callId"]
    text, tool, streamed = run["parts"]
    assert text == {"text": "Reading. ", "depth": 1}
    assert tool["tool"]["name"] == "read_file" and tool["tool"]["depth"] == 1
    assert tool["tool"]["state"] == "end" and tool["tool"]["result"] == "hello from a.txt"
    assert streamed["depth"] == 1
    assert "".join(SUB_WORDS).startswith(streamed["text"]) and len(streamed["text"]) >= 3
    assert turn["text"] == "Asking a helper. "  # the turn's own text, apart
    # Progress says which kept event it is: a page skips those its snapshot holds already.
    sub = [p for p in owner.progress(turn_id) if p["depth"] == 1]
    held = [p for p in sub if p["subSeq"] <= turn["subAgentSeq"]]
    assert "".join(p["text"] for p in held) == text["text"] + streamed["text"]

    assert (await owner.completion(turn_id))[2] == "The helper read it."
    after = await second_tab.call("openSession", {"sessionId": ack["sessionId"]})
    assert after["turns"][0]["subAgents"] == []  # an ended turn: its messages say what it did
    live = relay.relay.rooms.live
    assert isinstance(live, LocalLiveState) and turn_id not in live.subs  # dropped as it ended


async def test_a_turn_without_sub_agents_has_none_in_its_snapshot(
    openai_peer: OpenAIPeer, owner: Browser
) -> None:
    """The turn's own tool calls are no sub-agent output."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[call("read_file", path="a.txt")]),
        Reply(chunks=SUB_WORDS, delay=0.03),
    )
    ack = await owner.submit("Read a.txt")
    await eventually(lambda: len(owner.progress(ack["turnId"])) >= 4, what="the answer streaming")

    snapshot = await owner.call("openSession", {"sessionId": ack["sessionId"]})

    assert snapshot["turns"][0]["status"] == "processing"
    assert snapshot["turns"][0]["subAgents"] == []


async def test_a_snapshot_holds_a_bounded_part_of_a_long_sub_agent_output(
    openai_peer: OpenAIPeer, owner: Browser
) -> None:
    """810,000 characters from a sub-agent: the snapshot holds at most its first 500,000 (the pages
    open at the time get all of it), so it stays far under what a connection carries."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[call("spawn_subagent", task="write a lot")]),
        Reply(chunks=["y" * 90_000] * 9 + SUB_WORDS, delay=0.03),
        Reply(chunks=["Done."]),
    )
    ack = await owner.submit("Delegate a long text")
    turn_id = ack["turnId"]
    await eventually(
        lambda: "s3 " in "".join(p["text"] for p in owner.progress(turn_id)),
        what="the sub-agent past its long text",
    )

    snapshot = await owner.call("openSession", {"sessionId": ack["sessionId"]})

    [run] = snapshot["turns"][0]["subAgents"]
    kept = "".join(part["text"] for part in run["parts"])
    assert 500_000 - MAX_TEXT_EVENT < len(kept) <= 500_000 and set(kept) == {"y"}
    assert len("".join(p["text"] for p in owner.progress(turn_id))) > 800_000
    assert (await owner.completion(turn_id, timeout=15))[2] == "Done."


def test_two_sub_agents_that_name_their_calls_alike_keep_each_its_own() -> None:
    """Ollama numbers each request's calls from ``call_1``: each sub-agent's call stays in its
    run, after the call that started it."""

    def call_1(name: str, state: str, **result: str) -> dict[str, Any]:
        return {"callId": "call_1", "depth": 1, "name": name, "state": state, **result}

    events = [
        {"kind": "tool", "callId": "spawn_a", "depth": 0},
        {"kind": "tool", **call_1("read_file", "start")},
        {"kind": "tool", **call_1("read_file", "end", result="A")},
        {"kind": "tool", "callId": "spawn_b", "depth": 0},
        {"kind": "tool", **call_1("list_directory", "start")},
        {"kind": "tool", **call_1("list_directory", "end", result="B")},
    ]

    assert runs(events) == [
        {"after": "spawn_a", "parts": [{"tool": call_1("read_file", "end", result="A")}]},
        {"after": "spawn_b", "parts": [{"tool": call_1("list_directory", "end", result="B")}]},
    ]


async def test_sub_agent_output_outlasts_a_redis_restarted_empty(
    relay_processes: Callable[..., Any],
    drone_process: Callable[..., Any],
    openai_peer: OpenAIPeer,
    postgres_url: str,
    own_redis: OwnRedis,
) -> None:
    """The relay keeps its own copy of what it kept, and writes it back to a Redis that lost it
    (as it does a turn's text): a page opened after the restart still gets the whole sub-agent
    output, and the kept events' numbers go on instead of starting again."""
    relay = await relay_processes(redis=own_redis.url)
    openai_peer.script(
        Reply(chunks=["Asking a helper. "], tool_calls=[call("spawn_subagent", task="list")]),
        Reply(chunks=["Listing. "], tool_calls=[call("list_directory", path=".")]),
        Reply(chunks=SUB_WORDS, delay=0.05),
        Reply(chunks=["The helper listed it."]),
    )
    drone_process(Upstream("openai", openai_peer), server=relay.url)
    store = PostgresTurnStore(postgres_url)
    await store.open()
    people = People(Accounts(store))
    owner = await Browser(relay.url, await people.token("ada")).connect()
    try:
        ack = await owner.submit("List the files through a helper")
        turn_id = ack["turnId"]

        def sub_agent() -> list[dict[str, Any]]:
            return [p for p in owner.progress(turn_id) if p["depth"] == 1]

        await eventually(lambda: len(sub_agent()) >= 6, timeout=15, what="the sub-agent streaming")
        before = len(sub_agent())
        own_redis.restart()
        await eventually(lambda: len(sub_agent()) >= before + 5, what="more after the restart")

        second_tab = await Browser(relay.url, await people.token("ada")).connect()
        try:
            snapshot = await second_tab.call("openSession", {"sessionId": ack["sessionId"]})
        finally:
            await second_tab.close()
        [turn] = snapshot["turns"]
        [run] = turn["subAgents"]
        text, tool, streamed = run["parts"]
        assert text == {"text": "Listing. ", "depth": 1}
        assert tool["tool"]["name"] == "list_directory" and tool["tool"]["state"] == "end"
        assert streamed["text"].startswith("s0 s1 s2 ")
        numbers = [p["subSeq"] for p in sub_agent()]
        assert numbers == sorted(set(numbers)), numbers
        assert (await owner.completion(turn_id, timeout=20))[2] == "The helper listed it."
    finally:
        await owner.close()
        await store.close()
