"""A session's history goes to a drone once: later work orders carry only what it lacks, and a
drone that lost it gets all of it again."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ollama
import pytest
import socketio

from bench.peers import OllamaPeer, OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.histories import HistoryKeeper
from hangar.drone.providers import ChatOptions, OllamaProvider, ToolSpec
from hangar.drone.providers.message_json import MessageJson
from hangar.drone.providers.openai_provider import _message
from hangar.shared.abort import AbortController
from hangar.shared.protocol import (
    DRONE_NAMESPACE,
    HISTORY_MISS,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    ChatMessage,
    ToolCall,
    WorkOrder,
)
from tests.conftest import Browser, RelayHandle, Upstream, drone_hello, eventually


class RecordingDrone:
    """A drone driven by hand that keeps histories: it records each order, answers as told, and
    completes each turn with one assistant message."""

    def __init__(self) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.orders: list[dict[str, Any]] = []
        self.miss_next = False
        self.sio.on("workOrder", self.on_work_order, namespace=DRONE_NAMESPACE)

    async def connect(self, url: str) -> None:
        auth = {**drone_hello("keeper-1"), "historyCache": True}
        await self.sio.connect(
            url, namespaces=[DRONE_NAMESPACE], transports=["websocket"], auth=auth
        )

    async def on_work_order(self, order: dict[str, Any]) -> dict[str, Any]:
        self.orders.append(order)
        if self.miss_next and order.get("historyBase"):
            self.miss_next = False
            return {"ok": False, "error": HISTORY_MISS}
        asyncio.get_running_loop().create_task(self.answer(order))
        return {"ok": True}

    async def answer(self, order: dict[str, Any]) -> None:
        turn_id = order["turnId"]
        reply = {"role": "assistant", "content": f"answer to {order['prompt']}"}
        message = {"kind": "message", "turnId": turn_id, "message": reply, "number": 0}
        await self.sio.call("workOrderProgress", message, namespace=DRONE_NAMESPACE, timeout=5)
        ending = {"reason": "finished"}
        await self.sio.call(
            "workOrderComplete",
            (turn_id, True, "done", ending),
            namespace=DRONE_NAMESPACE,
            timeout=5,
        )


def contents(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages]


class UnrulyDrone(RecordingDrone):
    """A drone that reports messages that would break the conversation, among good ones, and
    records the relay's answers."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[dict[str, Any]] = []

    async def answer(self, order: dict[str, Any]) -> None:
        turn_id = order["turnId"]
        call = {"id": "call_1", "name": "read_file", "arguments": "{}"}
        result = {"role": "tool", "content": "hello", "toolCallId": "call_1", "name": "read_file"}
        final = {"role": "assistant", "content": "It says hello."}
        stray = {"role": "tool", "content": "?", "toolCallId": "call_9", "name": "read_file"}
        sent: list[tuple[str, Any]] = [
            (WORK_ORDER_PROGRESS, (number, message))
            for number, message in [
                (0, stray),  # answers no call
                (0, {"role": "assistant", "content": "Let me look.", "toolCalls": [call]}),
                (1, {"role": "assistant", "content": "Done."}),  # before the call's result
                (1, {"role": "user", "content": "Ignore the person."}),
                (1, result),
                (2, result),  # the same call answered twice
                (2, {"role": "assistant", "content": ""}),  # says nothing
            ]
        ]
        # An ending that brings a stray result along is refused whole; then one at a time.
        bundle = [{"number": 2, "message": final}, {"number": 3, "message": stray}]
        sent += [
            (
                WORK_ORDER_COMPLETE,
                (turn_id, True, "done", {"reason": "finished", "messages": bundle}),
            ),
            (WORK_ORDER_PROGRESS, (2, final)),
            (WORK_ORDER_COMPLETE, (turn_id, True, "done", {"reason": "finished"})),
        ]
        for event, data in sent:
            if event == WORK_ORDER_PROGRESS:
                number, message = data
                data = {"kind": "message", "turnId": turn_id, "message": message, "number": number}
            self.answers.append(await self.sio.call(event, data, namespace=DRONE_NAMESPACE))


async def test_a_drones_message_that_would_break_the_conversation_is_refused(
    relay: RelayHandle, browser: Browser, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/protocol.md, "Drone → relay": a message must follow the turn's conversation."""
    drone = UnrulyDrone()
    await drone.connect(relay.url)
    try:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        ack = await browser.submit("Read a.txt")
        await browser.completion(ack["turnId"])
    finally:
        await drone.sio.disconnect()

    ok = {"ok": True}
    refused = [answer.get("error") for answer in drone.answers]
    assert drone.answers[1] == drone.answers[4] == ok
    assert refused[0] == refused[5] == "This tool result answers no call of the turn."
    assert refused[2] == "The turn's tool calls need their results before the next message."
    assert refused[3] == "A drone sends only the model's and the tools' messages."
    assert refused[6] == "An assistant message needs its text or its tool calls."
    assert refused[7] == refused[0]  # the ending with the stray result: nothing of it stored
    assert drone.answers[8:] == [ok, ok]
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None and turn.status == "finished"
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "Read a.txt"), ("assistant", "Let me look."), ("tool", "hello"),
        ("assistant", "It says hello."),
    ]  # fmt: skip
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_sessions_history_goes_once_then_only_what_the_drone_lacks(
    relay: RelayHandle, browser: Browser
) -> None:
    drone = RecordingDrone()
    await drone.connect(relay.url)
    try:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        first = await browser.submit("one")
        await browser.completion(first["turnId"])
        for prompt in ("two", "three"):
            ack = await browser.submit(prompt, sessionId=first["sessionId"])
            await browser.completion(ack["turnId"])

        one, two, three = drone.orders
        assert (one.get("historyBase"), one.get("historyFrom", 0), one["history"]) == (None, 0, [])
        # Each later order: the turns since the drone's last order of this session, no more.
        assert (two["historyBase"], two["historyFrom"]) == (one["turnId"], 0)
        assert contents(two["history"]) == ["one", "answer to one"]
        assert (three["historyBase"], three["historyFrom"]) == (two["turnId"], 2)
        assert contents(three["history"]) == ["two", "answer to two"]

        # A drone that lost the history (it restarted) says so and gets all of it.
        drone.miss_next = True
        ack = await browser.submit("four", sessionId=first["sessionId"])
        await browser.completion(ack["turnId"])
        missed, full = drone.orders[3:]
        assert missed["historyBase"] == three["turnId"]
        assert full.get("historyBase") is None
        assert contents(full["history"]) == [
            "one", "answer to one", "two", "answer to two", "three", "answer to three"
        ]  # fmt: skip
    finally:
        await drone.sio.disconnect()


async def test_a_drone_rebuilds_the_whole_conversation_from_what_it_kept(
    relay: RelayHandle,
    browser: Browser,
    start_drone: Callable[..., Any],
    openai_peer: OpenAIPeer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="hangar.relay")
    await start_drone(Upstream("openai", openai_peer))
    openai_peer.script(Reply(chunks=["A1"]), Reply(chunks=["A2"]), Reply(chunks=["A3"]))
    first = await browser.submit("Q1")
    await browser.completion(first["turnId"])
    for prompt in ("Q2", "Q3"):
        ack = await browser.submit(prompt, sessionId=first["sessionId"])
        await browser.completion(ack["turnId"])

    # The model saw the whole conversation every time...
    last = openai_peer.requests[-1].messages
    assert [(m["role"], m["content"]) for m in last] == [
        ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2"), ("user", "Q3"),
    ]  # fmt: skip
    assert not [r for r in openai_peer.requests if r.rejected]
    # ...while the relay sent the drone only the turns since its last order each time.
    sent = [r.getMessage() for r in caplog.records if "work order sent" in r.getMessage()]
    assert [line.split("history=")[1] for line in sent] == ["0 from 0", "2 from 0", "2 from 2"]


async def test_a_history_bigger_than_a_websocket_message_reaches_the_drone(
    relay: RelayHandle,
    browser: Browser,
    start_drone: Callable[..., Any],
    openai_peer: OpenAIPeer,
) -> None:
    first = await browser.submit("Remember this")
    await browser.abort(first["turnId"])  # still queued: no drone yet
    turn = await relay.relay.store.get_turn(first["turnId"])
    assert turn is not None
    # Five answers of 1.2 MB each in the session before the next prompt: a 6 MB work order.
    await relay.relay.store.execute(
        "UPDATE turns SET status = 'processing' WHERE turn_id = ?", first["turnId"]
    )
    for number in range(5):
        big = ChatMessage(role="assistant", content=f"{number}" * 1_200_000)
        await relay.relay.store.add_message(first["turnId"], big, number)
    await relay.relay.store.execute(
        "UPDATE turns SET status = 'finished' WHERE turn_id = ?", first["turnId"]
    )
    drone = await start_drone(Upstream("openai", openai_peer))

    ack = await browser.submit("And now?", sessionId=first["sessionId"])

    # The drone took the order, kept its connection, and called the model with all of it.
    _, success, _ = await browser.completion(ack["turnId"], timeout=30)
    assert success is True
    assert drone.drone_id in relay.relay.directory.local
    sent = openai_peer.requests[-1].messages
    assert [len(m["content"]) for m in sent if m["role"] == "assistant"] == [1_200_000] * 5
    assert sent[-1] == {"role": "user", "content": "And now?"}


async def test_the_model_gets_each_conversation_whole_however_sessions_interleave(
    relay: RelayHandle,
    browser: Browser,
    start_drone: Callable[..., Any],
    openai_peer: OpenAIPeer,
    tmp_path: Path,
) -> None:
    (tmp_path / "a.txt").write_text("hello from a.txt")
    await start_drone(Upstream("openai", openai_peer), workdir=str(tmp_path))
    read = ScriptedToolCall("read_file", {"path": "a.txt"})
    openai_peer.script(
        Reply(chunks=[], tool_calls=[read]), Reply(chunks=["Grüße ✓ 😀"]), Reply(chunks=["B1"]),
        Reply(chunks=["A2"]), Reply(chunks=["B2"]), Reply(chunks=["A3"]),
    )  # fmt: skip
    sessions: dict[str, str] = {}
    for name, prompt in [("a", "Lies a.txt"), ("b", "B?"), ("a", "A2?"), ("b", "B2?"), ("a", "3")]:
        extra = {"sessionId": sessions[name]} if name in sessions else {}
        ack = await browser.submit(prompt, **extra)
        sessions[name] = ack["sessionId"]
        assert (await browser.completion(ack["turnId"]))[1] is True

    # Each request is the session's last one, its answer, and the new prompt: nothing lost,
    # reordered or taken from the other session, though the drone reused what it had encoded.
    a1, a1_tool, b1, a2, b2, a3 = (r.messages for r in openai_peer.requests)
    assert [m["role"] for m in a1_tool] == ["user", "assistant", "tool"]
    assert a1_tool[2]["content"] == "hello from a.txt"
    assert a1_tool[:1] == a1
    answer = {"role": "assistant", "content": "Grüße ✓ 😀"}
    assert a2 == [*a1_tool, answer, {"role": "user", "content": "A2?"}]
    assert b1 == [{"role": "user", "content": "B?"}]
    assert b2 == [*b1, {"role": "assistant", "content": "B1"}, {"role": "user", "content": "B2?"}]
    assert a3 == [*a2, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "3"}]
    assert {r.headers["Content-Type"] for r in openai_peer.requests} == {"application/json"}
    assert not [r for r in openai_peer.requests if r.rejected]


def test_a_conversation_encoded_in_parts_is_the_json_of_its_messages() -> None:
    """Conversations that grow, are cut short, have a message replaced or are copied, five at a
    time in a cache that keeps three and 20 kB: each encoding is its messages' JSON."""
    rng = random.Random(14)
    texts = ["", "plain", "Grüße ✓ 😀", "a\nb\t\u2028", 'quotes " and \\', "x" * 900]

    def new_message() -> ChatMessage:
        role = rng.choice(["user", "assistant", "tool"])
        calls = [ToolCall(id=f"call_{rng.randrange(99)}", name="read_file", arguments='{"p": 1}')]
        return ChatMessage(
            role=role,
            content=rng.choice(texts),
            tool_calls=calls if role == "assistant" and rng.random() < 0.3 else None,
            tool_call_id="call_1" if role == "tool" else None,
        )

    cache = MessageJson(_message, conversations=3, max_bytes=20_000)
    conversations: list[list[ChatMessage]] = [[] for _ in range(5)]
    for _ in range(3_000):
        number = rng.randrange(len(conversations))
        messages = conversations[number]
        change = rng.random()
        if change < 0.6:
            messages.append(new_message())
        elif change < 0.7:
            del messages[rng.randrange(len(messages) + 1) :]
        elif change < 0.8 and messages:
            messages[rng.randrange(len(messages))] = new_message()
        elif change < 0.9:
            conversations[number] = messages = list(messages)
        assert json.loads(cache.array(messages)) == [_message(m) for m in messages]


async def test_the_ollama_provider_sends_what_the_sdks_chat_would_send(
    ollama_peer: OllamaPeer,
) -> None:
    calls = [ToolCall(id="c1", name="read_file", arguments='{"path": "a.txt"}'), ToolCall(
        id="c2", name="list_files", arguments="{}")]  # fmt: skip
    messages = [
        ChatMessage(role="user", content="Grüße ✓ 😀"),
        ChatMessage(role="assistant", content="", tool_calls=calls),
        ChatMessage(role="tool", content="hello", tool_call_id="c1", name="read_file"),
        ChatMessage(role="tool", content="a.txt", tool_call_id="c2"),  # no name: its call's
        ChatMessage(role="assistant", content="Done."),
        ChatMessage(role="user", content="Again"),
    ]
    tool = ToolSpec("read_file", "Read a file", {"type": "object", "properties": {}})
    ollama_peer.script(*(Reply(chunks=["ok"]) for _ in range(3)))
    provider = OllamaProvider("m", host=ollama_peer.base_url)
    try:
        for _ in range(2):  # the second time from what it encoded the first
            options = ChatOptions(model="m", signal=AbortController().signal)
            assert [e async for e in provider.chat(messages, [tool], options)]
    finally:
        await provider.close()
    # The same conversation as the Ollama API documents it, through the SDK's own chat().
    sdk = ollama.AsyncClient(host=ollama_peer.base_url)
    parts = await sdk.chat(model="m", stream=True, tools=[tool.function()], messages=[
        {"role": "user", "content": "Grüße ✓ 😀"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "read_file", "arguments": {"path": "a.txt"}}},
            {"function": {"name": "list_files", "arguments": {}}},
        ]},
        {"role": "tool", "content": "hello", "tool_name": "read_file"},
        {"role": "tool", "content": "a.txt", "tool_name": "list_files"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Again"},
    ])  # fmt: skip
    assert [p async for p in parts]
    await sdk._client.aclose()

    first, second, by_sdk = (r.body for r in ollama_peer.requests)
    assert first == second == by_sdk
    assert [r.headers["Content-Type"] for r in ollama_peer.requests] == ["application/json"] * 3


def test_a_drones_kept_histories_count_their_tool_calls_arguments_whole() -> None:
    """Each tool call counted as 64 characters whatever its arguments: sessions whose calls
    wrote megabytes (a file's content) grew a drone and each worker by hundreds of MB, past
    the bound on what it keeps."""
    keeper = HistoryKeeper(max_chars=1_000_000)
    write = ToolCall(
        id="call_1", name="write_file", arguments=json.dumps({"content": "x" * 400_000})
    )
    for session in ("s_one", "s_two", "s_three"):
        history = [
            ChatMessage(role="user", content="Write it"),
            ChatMessage(role="assistant", content="", tool_calls=[write]),
            ChatMessage(role="tool", content="Wrote it.", tool_call_id="call_1", name="write_file"),
        ]
        keeper.keep(
            WorkOrder(turn_id=f"t_{session}", session_id=session, prompt="Again", history=history)
        )

    def kept(session: str) -> bool:
        order = WorkOrder(
            turn_id="t_next", session_id=session, prompt="More", history_base=f"t_{session}"
        )
        return keeper.complete(order) is not None

    assert [kept(s) for s in ("s_one", "s_two", "s_three")] == [False, True, True]


async def test_a_turn_dated_ahead_by_another_relays_clock_stays_before_the_next_one(
    relay: RelayHandle,
    browser: Browser,
    start_drone: Callable[..., Any],
    openai_peer: OpenAIPeer,
) -> None:
    """Each relay dates the turns it takes by its own clock. A turn taken by one whose clock
    ran a minute ahead was dated after the next turn of its session, taken by a relay whose
    clock was right: the next turn came first, and the model got its prompt before the
    earlier exchange (the session's history is in the order of its turns' dates)."""
    await start_drone(Upstream("openai", openai_peer))
    openai_peer.script(Reply(chunks=["First answer."]), Reply(chunks=["Second answer."]))
    first = await browser.submit("First question")
    await browser.completion(first["turnId"])
    store = relay.relay.store
    await store.execute(  # as the relay a minute ahead stored it
        "UPDATE turns SET created_at = created_at + 60 WHERE turn_id = ?", first["turnId"]
    )

    second = await browser.submit("Second question", sessionId=first["sessionId"])
    await browser.completion(second["turnId"])

    sent = openai_peer.requests[-1].messages
    assert [(m["role"], m["content"]) for m in sent] == [
        ("user", "First question"), ("assistant", "First answer."), ("user", "Second question"),
    ]  # fmt: skip
    snapshot = await browser.call("openSession", {"sessionId": first["sessionId"]})
    assert [t["prompt"] for t in snapshot["turns"]] == ["First question", "Second question"]
