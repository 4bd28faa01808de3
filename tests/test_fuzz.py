"""Malformed, oversized and too-frequent payloads at every event of both namespaces.

Property-based: hypothesis generates arbitrary JSON values and near-valid payloads (wrong types,
extra or missing keys, strings over their limits, wrong argument counts). Each must get a prompt
error ack of the event's shape, leave the connections and the relay serving, and change nothing
stored. The relay and its clients run on an event loop in a background thread so that plain
``@given`` functions can drive them.
"""

from __future__ import annotations

import asyncio
import json
import re
import string
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import socketio
from aiohttp import web
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.limits import (
    MAX_EVENT_BYTES,
    TOO_MANY_ABORTS,
    TOO_MANY_SUBMITS,
)
from hangar.server.relay import Relay
from hangar.server.store import TurnRecord
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    DRONE_NAMESPACE,
    IDE_NAMESPACE,
    NO_ACTIVE_WORK_ORDER,
    PROGRESS,
    TURN_ENDED,
    UNKNOWN_TURN,
    AbortWorkOrderRequest,
    Completion,
    ListSessions,
    OpenSession,
    SubmitWorkOrder,
    Wire,
)
from tests.conftest import DRONE_TOKEN, Browser, People, RelayHandle, eventually

T = TypeVar("T")

ACK_TIMEOUT = 10.0
"""Every event must be answered well within this."""
TRANSPORT_BUDGET = 3_500_000
"""Generated messages stay below the 4 MB Engine.IO limit (past it the connection is dropped)."""
EXAMPLES = 60
DRONE_AUTH = {
    "instance": "fuzz-drone-instance-secret",
    "token": DRONE_TOKEN,
    "droneId": "fuzz-1",
    "name": "fuzz",
    "provider": "openai",
    "model": "m",
}
GENERIC_FAILURE = "The relay could not handle that event."
BROWSER_REFUSALS = {
    "Unknown session.",
    UNKNOWN_TURN,
    NO_ACTIVE_WORK_ORDER,
    TOO_MANY_ABORTS,
}
"""Refusals of well-formed requests the fuzzing person may not make (as opposed to malformed)."""
DRONE_REFUSALS = {UNKNOWN_TURN, TURN_ENDED}
ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]+$")
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- a relay on a loop of its own


@dataclass
class Harness:
    """A relay with a fuzzing browser, a drone, and one live turn another person owns."""

    loop: asyncio.AbstractEventLoop
    directory: Path
    runner: web.AppRunner | None = None
    relay: Relay | None = None
    url: str = ""
    fuzzer: Browser | None = None
    """Sends the malformed browser events; owns nothing."""
    watcher: Browser | None = None
    """Owns the live turn and has its session open."""
    drone: socketio.AsyncClient = field(
        default_factory=lambda: socketio.AsyncClient(reconnection=False)
    )
    live: TurnRecord | None = None
    """The live turn as stored before the fuzzing."""
    drone_calls: list[tuple[str, Any]] = field(default_factory=list)
    people: People | None = None
    fuzzer_id: str = ""

    def run(self, work: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run ``work`` on the relay's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    async def start(self) -> None:
        config = RelayConfig(
            port=0, database=str(self.directory / "fuzz.db"), drone_token=DRONE_TOKEN
        )
        self.runner, port = await start_relay(config)
        self.relay = self.runner.app[RELAY]
        self.url = f"http://127.0.0.1:{port}"

        def work_order(data: Any) -> dict[str, Any]:
            self.drone_calls.append(("workOrder", data))
            return {"ok": True}

        def abort(data: Any) -> tuple[bool, str]:
            self.drone_calls.append(("abortWorkOrder", data))
            return True, ABORT_SIGNALED

        self.drone.on("workOrder", work_order, namespace=DRONE_NAMESPACE)
        self.drone.on("abortWorkOrder", abort, namespace=DRONE_NAMESPACE)
        await self.drone.connect(
            self.url, namespaces=[DRONE_NAMESPACE], auth=DRONE_AUTH, transports=["websocket"]
        )
        self.people = People(self.relay.accounts)
        self.watcher = await Browser(self.url, await self.people.token("watcher")).connect()
        ack = await self.watcher.submit("A turn that stays live", droneId="fuzz-1")
        assert ack["ok"] is True, ack
        self.live = await self.relay.store.get_turn(ack["turnId"])
        assert self.live is not None and self.live.status == "processing"
        self.fuzzer = await Browser(self.url, await self.people.token("fuzzer")).connect()
        fuzzer = await self.relay.accounts.user("fuzzer")
        assert fuzzer is not None
        self.fuzzer_id = fuzzer.user_id

    async def close(self) -> None:
        for client in (self.fuzzer, self.watcher):
            if client is not None:
                await client.close()
        if self.drone.connected:
            await self.drone.disconnect()
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def live_turn(self) -> TurnRecord:
        assert self.live is not None
        return self.live

    def ids(self) -> list[str]:
        """Ids worth guessing: the live turn's and session's, which the fuzzer does not own."""
        return [self.live_turn.turn_id, self.live_turn.session_id, "fuzz-1"]

    def call(
        self, client: socketio.AsyncClient, namespace: str, event: str, args: tuple[Any, ...]
    ) -> Any:
        """Emit ``event`` with exactly ``args`` as its arguments; the ack (or a timeout)."""
        return self.run(client.call(event, args, namespace=namespace, timeout=ACK_TIMEOUT))

    def ide(self, event: str, args: tuple[Any, ...]) -> Any:
        assert self.fuzzer is not None
        return self.call(self.fuzzer.sio, IDE_NAMESPACE, event, args)

    def from_drone(self, event: str, args: tuple[Any, ...]) -> Any:
        return self.call(self.drone, DRONE_NAMESPACE, event, args)

    def assert_unchanged(self) -> None:
        """Nothing stored changed, everyone is still connected, and the relay still answers."""
        self.run(self._assert_unchanged())

    async def _assert_unchanged(self) -> None:
        assert self.relay is not None and self.fuzzer is not None and self.watcher is not None
        store = self.relay.store
        assert self.fuzzer.sio.connected and self.watcher.sio.connected and self.drone.connected
        assert "fuzz-1" in self.relay.directory.local
        assert await store.list_sessions(self.fuzzer_id) == []
        assert await store.processing_turns() == [
            TurnRecord(**{**vars(self.live_turn), "messages": []})
        ]
        assert await store.get_turn(self.live_turn.turn_id) == self.live_turn
        opened = await self.watcher.call(
            "openSession", {"sessionId": self.live_turn.session_id}, timeout=ACK_TIMEOUT
        )
        assert opened["ok"] is True, opened
        assert [(t["turnId"], t["status"], t["text"]) for t in opened["turns"]] == [
            (self.live_turn.turn_id, "processing", "")
        ]
        assert [name for name, _ in self.drone_calls] == ["workOrder"]
        listed = await self.fuzzer.call("listSessions", timeout=ACK_TIMEOUT)
        assert listed == {"ok": True, "sessions": []}

    def assert_still_serves(self) -> None:
        """A new person's valid submit is taken: it waits for the one drone, which is busy,
        and its person can cancel it."""
        self.run(self._assert_still_serves())

    async def _assert_still_serves(self) -> None:
        assert self.people is not None
        newcomer = await Browser(self.url, await self.people.token()).connect()
        try:
            ack = await newcomer.submit("Still there?")
            assert ack["ok"] is True, ack
            place = await eventually(
                lambda: [a for e, a in newcomer.events if e == "turnQueued"], what="its place"
            )
            assert place[-1]["position"] == 1
            assert await newcomer.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
            assert await newcomer.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
        finally:
            await newcomer.close()
        assert [name for name, _ in self.drone_calls] == ["workOrder"]
        assert self.watcher is not None
        await asyncio.sleep(0.1)
        live_events = [
            (event, args)
            for event, args in self.watcher.events
            if event in ("workOrderProgress", "workOrderComplete")
        ]
        assert live_events == []


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-relay", daemon=True)
    thread.start()
    harness = Harness(loop, tmp_path_factory.mktemp("fuzz"))
    try:
        harness.run(harness.start())
        yield harness
    finally:
        try:
            harness.run(harness.close())
        finally:
            harness.run(cancel_leftovers())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


async def cancel_leftovers() -> None:
    """Cancel what the clients and the server left running, as ``asyncio.run`` would."""
    leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in leftovers:
        task.cancel()
    await asyncio.gather(*leftovers, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


# ---- strategies

ID_ALPHABET = string.ascii_letters + string.digits + "_.:-"

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
"""Any JSON value."""

huge_text = st.builds(
    lambda char, size: char * size,
    st.sampled_from(["x", " ", "7", "\n"]),
    st.sampled_from([129, 100_001, 1_000_001, 1_100_000]),
) | st.builds(lambda char, size: char * size, st.characters(), st.sampled_from([129, 100_001]))
"""Strings past the limits of ids (128), prompts and completion messages (100 000) and streamed
text, tool arguments and results (1 000 000)."""

bad_ids = st.one_of(
    st.just(""),
    st.text(min_size=1, max_size=20).filter(lambda s: not ID_PATTERN.match(s)),
    st.text(ID_ALPHABET, min_size=129, max_size=140),
    huge_text,
)
good_ids = st.text(ID_ALPHABET, min_size=1, max_size=128)


def either(*valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, else a wrong type or an over-long string."""
    return st.one_of(*valid, json_values, huge_text)


def key_spelling(name: str) -> st.SearchStrategy[str]:
    """The camelCase key, or a near miss (snake_case is accepted too)."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    return st.sampled_from([name, name, snake, name.lower(), name.upper(), name + " "])


@st.composite
def near_valid(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """A payload with most of ``fields``, some keys misspelt, maybe a few unknown keys."""
    payload: dict[str, Any] = {}
    for name, values in fields.items():
        if draw(st.integers(0, 5)) > 0:
            payload[draw(key_spelling(name))] = draw(values)
    extra = draw(st.dictionaries(st.text(max_size=12), json_values, max_size=2))
    return {**extra, **payload} if draw(st.booleans()) else {**payload, **extra}


def arguments(payload: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, ...]]:
    """Usually one payload; sometimes none, or several, of anything."""
    return st.one_of(
        payload.map(lambda value: (value,)),
        payload.map(lambda value: (value,)),
        st.lists(st.one_of(payload, json_values), max_size=4).map(tuple),
    )


def id_values(harness: Harness) -> st.SearchStrategy[Any]:
    return either(good_ids, st.sampled_from(harness.ids()), bad_ids)


def chat_messages(harness: Harness) -> st.SearchStrategy[Any]:
    tool_call = near_valid(
        {
            "id": id_values(harness),
            "name": either(st.text(min_size=1, max_size=20)),
            "arguments": either(st.just("{}"), st.text(max_size=20)),
        }
    )
    return either(
        near_valid(
            {
                "role": either(st.sampled_from(["system", "user", "assistant", "tool", "robot"])),
                "content": either(st.text(max_size=40)),
                "toolCalls": either(st.lists(tool_call, max_size=3)),
                "toolCallId": id_values(harness),
                "name": either(st.text(max_size=20)),
                "aborted": either(st.booleans()),
            }
        )
    )


def browser_payloads(harness: Harness) -> dict[str, st.SearchStrategy[tuple[Any, ...]]]:
    ids = id_values(harness)
    return {
        "submitWorkOrder": arguments(
            either(
                near_valid(
                    {
                        "prompt": either(st.text(min_size=1, max_size=40), st.just("")),
                        "sessionId": ids,
                        "droneId": ids,
                    }
                )
            )
        ),
        "abortWorkOrder": arguments(either(near_valid({"turnId": ids, "sessionId": ids}))),
        "openSession": arguments(either(near_valid({"sessionId": ids}))),
        "listSessions": arguments(either(near_valid({"everyone": either(st.booleans())}))),
        "listDrones": arguments(json_values),
    }


def drone_payloads(harness: Harness) -> dict[str, st.SearchStrategy[tuple[Any, ...]]]:
    ids = id_values(harness)
    depth = either(st.integers(-2, 20), st.booleans(), st.floats(-1, 20))
    progress = either(
        near_valid(
            {
                "kind": either(st.sampled_from(["text", "message", "tool", "Text", "bogus"])),
                "turnId": ids,
                "text": either(st.text(max_size=40)),
                "depth": depth,
            }
        ),
        near_valid(
            {
                "kind": either(st.sampled_from(["message", "text", "tool"])),
                "turnId": ids,
                "message": chat_messages(harness),
            }
        ),
        near_valid(
            {
                "kind": either(st.sampled_from(["tool", "text", "message"])),
                "turnId": ids,
                "callId": ids,
                "name": either(st.text(min_size=1, max_size=20)),
                "state": either(st.sampled_from(["start", "end", "cancelled", "error", "done"])),
                "arguments": either(st.text(max_size=40)),
                "result": either(st.text(max_size=40)),
                "depth": depth,
            }
        ),
    )
    success = either(st.booleans(), st.sampled_from([0, 1, "true", "false", None]))
    message = either(st.text(max_size=40), st.just("aborted"))
    completion = st.one_of(
        st.tuples(ids, success, message),
        st.lists(st.one_of(ids, success, message, json_values), max_size=5).map(tuple),
    )
    return {"workOrderProgress": arguments(progress), "workOrderComplete": completion}


# ---- what a well-formed request is


def valid(model: Callable[[Any], Any], args: tuple[Any, ...]) -> bool:
    """Whether the relay would accept ``args`` as one payload of ``model``."""
    if len(args) > 1:
        return False
    try:
        model(args[0] if args else {})
    except ValidationError:
        return False
    return True


def valid_completion(args: tuple[Any, ...]) -> bool:
    if len(args) != 3:
        return False
    try:
        Completion(turn_id=args[0], success=args[1], message=args[2])
    except ValidationError:
        return False
    return True


def wire_size(args: tuple[Any, ...]) -> int:
    return len(json.dumps(list(args), separators=(",", ":")))


def refers_to(args: tuple[Any, ...], turn_id: str) -> bool:
    return turn_id in json.dumps(list(args))


# ---- the properties


def assert_error_ack(ack: Any, allowed: set[str]) -> None:
    """``{"ok": False, "error": <a refusal>}``; never the sign of an unhandled exception."""
    assert isinstance(ack, dict), ack
    assert set(ack) == {"ok", "error"} and ack["ok"] is False, ack
    assert isinstance(ack["error"], str) and ack["error"], ack
    assert ack["error"] != GENERIC_FAILURE
    assert ack["error"] in allowed or ack["error"].startswith(
        ("Invalid payload (", "The payload is too large (")
    ), ack["error"]


@pytest.mark.parametrize(
    "event", ["submitWorkOrder", "abortWorkOrder", "openSession", "listSessions", "listDrones"]
)
def test_browser_events_answer_any_payload_and_change_nothing(fuzz: Harness, event: str) -> None:
    strategy = browser_payloads(fuzz)[event]

    @FUZZ_SETTINGS
    @given(args=strategy)
    def answers(args: tuple[Any, ...]) -> None:
        assume(wire_size(args) < TRANSPORT_BUDGET)
        if event == "submitWorkOrder":
            assume(not valid(SubmitWorkOrder.model_validate, args))
        ack = fuzz.ide(event, args)
        if event == "abortWorkOrder":
            assert isinstance(ack, (tuple, list)) and len(ack) == 2, ack
            assert ack[0] is False and isinstance(ack[1], str) and ack[1], ack
            allowed_answer = ack[1] in BROWSER_REFUSALS or ack[1].startswith(
                ("Invalid payload (", "The payload is too large (")
            )
            assert allowed_answer, ack
            if valid(AbortWorkOrderRequest.model_validate, args):
                assert not ack[1].startswith("Invalid payload"), ack
        elif event == "listSessions":
            if valid(ListSessions.model_validate, args):
                # Everyone's sessions only for admins: a member asking still sees only theirs.
                assert ack == {"ok": True, "sessions": []}
            else:
                assert_error_ack(ack, set())
        elif event == "listDrones":
            if valid(Wire.model_validate, args):  # nothing to ask for: no payload, or {}
                assert isinstance(ack, dict) and ack["ok"] is True, ack
                assert [d["droneId"] for d in ack["drones"]] == ["fuzz-1"]
                assert ack["drones"][0]["running"] == 1
            else:
                assert_error_ack(ack, set())
        else:
            assert_error_ack(ack, BROWSER_REFUSALS)
            if event == "openSession" and valid(OpenSession.model_validate, args):
                assert ack["error"] == "Unknown session."
        fuzz.assert_unchanged()

    answers()
    fuzz.assert_still_serves()


@pytest.mark.parametrize("event", ["workOrderProgress", "workOrderComplete"])
def test_drone_events_answer_any_payload_and_change_nothing(fuzz: Harness, event: str) -> None:
    strategy = drone_payloads(fuzz)[event]

    @FUZZ_SETTINGS
    @given(args=strategy)
    def answers(args: tuple[Any, ...]) -> None:
        assume(wire_size(args) < TRANSPORT_BUDGET)
        well_formed = (
            valid(PROGRESS.validate_python, args)
            if event == "workOrderProgress"
            else valid_completion(args)
        )
        # A well-formed report on the drone's own live turn would rightly change it, as would
        # any ending of it: one the relay cannot read ends it in error (docs/protocol.md).
        live = fuzz.live_turn.turn_id
        ends_it = event == "workOrderComplete" and refers_to(args[:1], live)
        assume(not (well_formed and refers_to(args, live)) and not ends_it)

        ack = fuzz.from_drone(event, args)

        assert_error_ack(ack, DRONE_REFUSALS)
        if well_formed:
            assert ack["error"] in DRONE_REFUSALS, ack
        fuzz.assert_unchanged()

    answers()
    fuzz.assert_still_serves()


# ---- sizes and rates, against the standard relay fixture


def too_large(size: int) -> str:
    return f"The payload is too large ({size} bytes; the limit is {MAX_EVENT_BYTES} bytes)."


def exact_size(prompt_key: str, size: int) -> dict[str, str]:
    """``{prompt_key: "xxx…"}`` whose compact JSON is exactly ``size`` bytes."""
    overhead = len(json.dumps({prompt_key: ""}, separators=(",", ":")))
    payload = {prompt_key: "x" * (size - overhead)}
    assert len(json.dumps(payload, separators=(",", ":"))) == size
    return payload


def owner_of(browser: Browser, relay: RelayHandle) -> str:
    namespace = relay.relay.sio.namespace_handlers[IDE_NAMESPACE]
    owner: str = namespace.connections[browser.sio.get_sid(IDE_NAMESPACE)].owner
    return owner


async def assert_nothing_stored(relay: RelayHandle, browser: Browser) -> None:
    assert await relay.relay.store.list_sessions(owner_of(browser, relay)) == []
    assert await relay.relay.store.processing_turns() == []


async def test_an_oversized_payload_is_refused_with_its_size(
    relay: RelayHandle, browser: Browser
) -> None:
    payload = {"prompt": "x" * 1_500_000, "sessionId": "s_1"}
    size = len(json.dumps(payload, separators=(",", ":")))
    assert MAX_EVENT_BYTES < size < 4_000_000

    assert await browser.call("submitWorkOrder", payload) == {
        "ok": False,
        "error": too_large(size),
    }
    assert await browser.call("openSession", {"sessionId": "x" * size}) == {
        "ok": False,
        "error": too_large(size + len('{"sessionId":""}')),
    }
    assert await browser.call("abortWorkOrder", {"turnId": "x" * size}) == (
        False,
        too_large(size + len('{"turnId":""}')),
    )
    await assert_nothing_stored(relay, browser)
    assert (await browser.call("listSessions"))["ok"] is True


async def test_large_events_over_long_polling_arrive_whole(relay: RelayHandle) -> None:
    """The page starts on long-polling (and stays there behind a proxy without websockets):
    an event's body comes in several reads, and was cut at the first one."""
    client = socketio.AsyncClient(reconnection=False)
    await client.connect(
        relay.url,
        namespaces=[IDE_NAMESPACE],
        auth={"token": await relay.people.token()},
        transports=["polling"],
    )
    try:
        prompt = "שלום עולם, " * 9_000 + "ok?"  # 99,003 characters, 180 kB of UTF-8
        ack = await client.call("submitWorkOrder", {"prompt": prompt}, namespace=IDE_NAMESPACE)
        assert ack["ok"] is True, ack
        turn = await relay.relay.store.get_turn(ack["turnId"], messages=False)
        assert turn is not None and turn.prompt == prompt

        payload = {"prompt": "x" * 1_500_000}
        size = len(json.dumps(payload, separators=(",", ":")))
        answer = await client.call("submitWorkOrder", payload, namespace=IDE_NAMESPACE)
        assert answer == {"ok": False, "error": too_large(size)}
    finally:
        await client.eio.disconnect(abort=True)


async def test_the_size_limit_counts_compact_json_bytes(
    relay: RelayHandle, browser: Browser
) -> None:
    at_limit = await browser.call("submitWorkOrder", exact_size("prompt", MAX_EVENT_BYTES))
    over_limit = await browser.call("submitWorkOrder", exact_size("prompt", MAX_EVENT_BYTES + 1))

    assert at_limit["ok"] is False
    assert at_limit["error"].startswith("Invalid payload (prompt: String should have at most")
    assert over_limit == {"ok": False, "error": too_large(MAX_EVENT_BYTES + 1)}
    await assert_nothing_stored(relay, browser)


async def test_a_message_over_the_transport_limit_drops_only_that_connection(
    relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    bystander: Browser = await browsers()
    client = socketio.AsyncClient(reconnection=False)
    await client.connect(
        relay.url,
        namespaces=[IDE_NAMESPACE],
        auth={"token": await relay.people.token()},
        transports=["websocket"],
    )
    try:
        await client.emit("submitWorkOrder", {"prompt": "x" * 4_100_000}, namespace=IDE_NAMESPACE)
        await eventually(lambda: not client.connected, timeout=10, what="the drop")
    finally:
        await client.disconnect()

    assert bystander.sio.connected
    ack = await bystander.submit("Still here")
    assert ack["ok"] is True
    assert await bystander.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    assert (await bystander.completion(ack["turnId"]))[1:] == (True, "aborted")


async def emit_quickly(
    browser: Browser, event: str, payloads: list[dict[str, Any]], timeout: float = 10.0
) -> list[Any]:
    """Send every payload at once, in order, then collect their acks (in sending order)."""
    loop = asyncio.get_running_loop()
    answers: list[asyncio.Future[Any]] = []
    for payload in payloads:
        answer: asyncio.Future[Any] = loop.create_future()

        def on_ack(*args: Any, answer: asyncio.Future[Any] = answer) -> None:
            answer.set_result(args[0] if len(args) == 1 else args)

        answers.append(answer)
        await browser.sio.emit(event, payload, namespace=IDE_NAMESPACE, callback=on_ack)
    return list(await asyncio.wait_for(asyncio.gather(*answers), timeout))


async def test_the_eleventh_quick_submit_is_refused(relay: RelayHandle, browser: Browser) -> None:
    # Sent at once, well within the second a refill takes, whatever a submit costs here.
    acks = await emit_quickly(
        browser, "submitWorkOrder", [{"prompt": f"Order {i}"} for i in range(11)]
    )

    assert all(ack["ok"] is True for ack in acks[:10]), acks
    assert acks[10] == {"ok": False, "error": TOO_MANY_SUBMITS}
    for ack in acks[:10]:  # no drone is online: they wait in line
        turn = await relay.relay.store.get_turn(ack["turnId"], messages=False)
        assert turn is not None and turn.status == "queued"
    stored = await relay.relay.store.list_sessions(owner_of(browser, relay))
    assert sorted(s.session_id for s in stored) == sorted(ack["sessionId"] for ack in acks[:10])
    assert await relay.relay.store.processing_turns() == []


async def test_the_twenty_first_quick_abort_is_refused(
    relay: RelayHandle, browser: Browser
) -> None:
    answers = await emit_quickly(browser, "abortWorkOrder", [{}] * 21)

    assert answers[:20] == [(False, NO_ACTIVE_WORK_ORDER)] * 20
    assert answers[20] == (False, TOO_MANY_ABORTS)


async def test_malformed_payloads_do_not_use_up_the_rate_limits(
    relay: RelayHandle, browser: Browser
) -> None:
    refused = await emit_quickly(browser, "submitWorkOrder", [{"prompt": 1}] * 30)
    aborts = await emit_quickly(browser, "abortWorkOrder", [{"turnId": ""}] * 30)

    assert all(ack["error"].startswith("Invalid payload") for ack in refused)
    assert all(answer[1].startswith("Invalid payload") for answer in aborts)
    ack = await browser.submit("Now a real one")
    assert ack["ok"] is True
    assert await browser.abort() == (False, NO_ACTIVE_WORK_ORDER)


# ---- nesting too deep for the JSON decoder


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def send_raw(client: socketio.AsyncClient, namespace: str, body: str) -> asyncio.Future[Any]:
    """Send an event packet whose JSON is ``body``, verbatim; the future is its ack."""
    answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    ack_id = client._generate_ack_id(namespace, lambda *args: answer.set_result(args))
    await client.eio.send(f"2{namespace},{ack_id}{body}")
    return answer


async def test_a_payload_nested_too_deeply_leaves_the_connection_serving(
    relay: RelayHandle, browser: Browser
) -> None:
    await send_raw(browser.sio, IDE_NAMESPACE, f'["submitWorkOrder",{nested(5000)}]')

    assert await browser.call("listSessions") == {"ok": True, "sessions": []}
    assert browser.sio.connected
    await assert_nothing_stored(relay, browser)


async def test_a_payload_nested_too_deeply_gets_an_error_ack(
    relay: RelayHandle, browser: Browser
) -> None:
    answer = await send_raw(browser.sio, IDE_NAMESPACE, f'["submitWorkOrder",{nested(5000)}]')

    (ack,) = await asyncio.wait_for(answer, 3)
    assert ack == {"ok": False, "error": "Malformed packet."}
