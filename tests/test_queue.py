"""Work orders that wait (``docs/architecture.md``, "The queue"): a turn no drone can take now
is queued, not refused; it starts as soon as a drone has room, in a fair order; it can be
cancelled before it starts; follow-ups queue behind a running turn or interrupt it."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.server import queue
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.histories import history_since, session_history
from hangar.server.store import Ending, SessionRecord, TurnRecord
from hangar.server.turns import queue_full
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    DRONE_NAMESPACE,
    DRONE_STOPPING,
    STOP_AFTER_STEP,
    TOOL_CANCELLED,
    ChatMessage,
)
from tests.browser.hand_drone import HandDrone
from tests.conftest import (
    DRONE_TOKEN,
    Browser,
    People,
    RelayHandle,
    Upstream,
    eventually,
    relay_folder,
)

SLOW = Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03)


def places(browser: Browser, turn_id: str) -> list[dict[str, Any]]:
    return [
        args
        for event, args in browser.events
        if event == "turnQueued" and args["turnId"] == turn_id
    ]


async def place_of(browser: Browser, turn_id: str) -> dict[str, Any]:
    """The turn's latest place in line, once one has arrived."""
    found = await eventually(lambda: places(browser, turn_id), what=f"the place of {turn_id}")
    place: dict[str, Any] = found[-1]
    return place


def endings(browser: Browser, turn_id: str) -> list[dict[str, Any]]:
    return [
        args for event, args in browser.events if event == "turnEnded" and args["turnId"] == turn_id
    ]


async def status_of(relay: RelayHandle, turn_id: str) -> str:
    turn = await relay.relay.store.get_turn(turn_id, messages=False)
    assert turn is not None
    return turn.status


async def test_a_submit_with_no_drone_online_waits_and_starts_when_one_comes(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    ack = await browser.submit("Anyone there?")

    assert ack["ok"] is True
    assert (await place_of(browser, ack["turnId"]))["position"] == 1
    assert await status_of(relay, ack["turnId"]) == "queued"
    assert not browser.completions(ack["turnId"])
    # The session says it has a turn waiting, opened as listed.
    opened = await browser.call("openSession", {"sessionId": ack["sessionId"]})
    listed = (await browser.call("listSessions"))["sessions"]
    assert opened["session"]["queuedTurns"] == listed[0]["queuedTurns"] == 1

    await start_drone(Upstream("openai", openai_peer))

    assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, "Hello world")
    assert (await browser.ending(ack["turnId"]))["reason"] == "finished"


async def test_a_second_order_to_a_busy_drone_queues_then_finishes(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    openai_peer.script(Reply(chunks=[f"b{i} " for i in range(40)], delay=0.02), Reply(chunks=["A"]))
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("Session B's long job")
    await browser.wait_text(first["turnId"], pieces=1)

    second = await browser.submit("Session A's question")

    assert (await place_of(browser, second["turnId"]))["position"] == 1
    assert await status_of(relay, second["turnId"]) == "queued"
    assert (await browser.completion(first["turnId"]))[1] is True
    assert await browser.completion(second["turnId"]) == (second["turnId"], True, "A")
    assert len(openai_peer.requests) == 2


async def test_a_turn_for_a_named_drone_waits_for_that_drone(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    await start_drone(Upstream("openai", openai_peer))  # free, but not the one asked for
    token = await relay.relay.accounts.create_drone_token("laptop")

    ack = await browser.submit("On the laptop, please", droneId="laptop")

    place = await place_of(browser, ack["turnId"])
    assert (place["position"], place["droneId"]) == (1, "laptop")
    await start_drone(Upstream("openai", openai_peer), token=token, name="laptop")
    assert (await browser.completion(ack["turnId"]))[1] is True
    turn = await relay.relay.store.get_turn(ack["turnId"], messages=False)
    assert turn is not None and turn.drone_id == "laptop"


@pytest.mark.parametrize("drone", ["none", "busy"])
async def test_aborting_a_queued_order_ends_it_at_once_with_no_drone_or_a_busy_one(
    relay: RelayHandle,
    browser: Browser,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    drone: str,
) -> None:
    """No drone is online, or the only one is busy with another turn: nothing but the relay
    could end these turns, and the running one goes on."""
    if drone == "busy":
        openai_peer.script(SLOW)
        await start_drone(Upstream("openai", openai_peer))
        running = await browser.submit("Keep the drone busy")
        await browser.wait_text(running["turnId"], pieces=1)
    took: list[float] = []
    for index in range(5):
        ack = await browser.submit(f"Never mind {index}")
        await place_of(browser, ack["turnId"])

        started = time.monotonic()
        assert await browser.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
        assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
        took.append(time.monotonic() - started)
        assert browser.order_of(ack["turnId"]) == ["abortAck", "workOrderComplete"]

        turn = await relay.relay.store.get_turn(ack["turnId"])
        assert turn is not None and (turn.status, turn.reason) == ("aborted", "aborted")
        assert [(m.role, m.content) for m in turn.messages] == [("user", f"Never mind {index}")]
        ended = await browser.ending(ack["turnId"])
        assert len(endings(browser, ack["turnId"])) == 1
        assert ended["endedBy"] == turn.ended_by and ended["endedBy"].startswith("person-")
    assert statistics.median(took) < 0.05, took
    assert await browser.abort(ack["turnId"]) == (False, "No active work order to abort")
    if drone == "busy":
        assert len(openai_peer.requests) == 1, "no cancelled turn reached the model"
        assert (await browser.completion(running["turnId"], timeout=20))[1] is True
        assert browser.text(running["turnId"]) == SLOW.text  # it ran on, whole


async def test_stop_after_this_step_on_a_queued_turn_cancels_it(
    relay: RelayHandle, browser: Browser
) -> None:
    """It has no step yet: nothing of it runs, as for an abort (before, it was answered that
    nothing runs, and the turn went on waiting, and ran)."""
    ack = await browser.submit("Not now after all")
    await place_of(browser, ack["turnId"])

    gentle = await browser.call("abortWorkOrder", {"turnId": ack["turnId"], "mode": "after_step"})

    assert gentle == (True, ABORT_SIGNALED)
    assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None and (turn.status, turn.reason) == ("aborted", "aborted")


async def test_an_abort_racing_the_dispatch_is_never_lost(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    """Submits and aborts sent back to back: each abort lands before, during or after the
    dispatch, and every turn ends aborted, once, whatever the moment."""
    openai_peer.default = SLOW
    await start_drone(Upstream("openai", openai_peer), concurrency=10)
    people: list[Browser] = [await browsers() for _ in range(10)]

    async def submit_then_abort(person: Browser) -> str:
        ack = await person.submit("Race me")
        assert await person.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
        return str(ack["turnId"])

    turn_ids = await asyncio.gather(*(submit_then_abort(p) for p in people))

    for person, turn_id in zip(people, turn_ids, strict=True):
        assert await person.completion(turn_id, timeout=10) == (turn_id, True, "aborted")
    for person, turn_id in zip(people, turn_ids, strict=True):
        assert len(person.completions(turn_id)) == 1
    assert all(not r.completed for r in openai_peer.requests)


class TardyDrone(HandDrone):
    """A hand-driven drone that answers an abort at once ("Abort signaled", as a drone does for
    a work order still on its way to it) but answers a work order only when the test says."""

    def __init__(self, url: str, drone_id: str) -> None:
        super().__init__(url, drone_id)
        self.answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def connect(self) -> TardyDrone:
        return await self.__aenter__()

    async def _order(self, data: dict[str, Any]) -> dict[str, Any]:
        await self.orders.put(data)
        return await asyncio.shield(self.answer)

    async def _abort(self, data: dict[str, Any]) -> Any:
        if data.get("mode") == "after_step":  # as a drone answers for an order not arrived
            self.aborts.append(data)
            return True, STOP_AFTER_STEP
        return await super()._abort(data)

    async def close(self) -> None:
        await self.__aexit__(None, None, None)  # first: the held answer never reaches the relay
        if not self.answer.done():
            self.answer.set_result({"ok": False, "error": "gone"})


@pytest.mark.parametrize("then", ["busy", "gone", "refuses"])
async def test_a_turn_aborted_before_its_drone_took_it_ends_aborted_and_is_not_sent_again(
    relay: RelayHandle, browsers: Any, then: str
) -> None:
    """The person is told "Abort signaled" while the work order is on its way; then the drone
    says it is busy, refuses it, or leaves before it answers. The turn ends aborted by that
    person, at once, and no drone is sent it again (docs/protocol.md: a turn whose abort was
    asked ends aborted whatever else ends it)."""
    browser = await browsers("ada")
    tardy = await TardyDrone(relay.url, "tardy-1").connect()
    spare = TardyDrone(relay.url, "spare-1")
    try:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        turn_id = (await browser.submit("Hello"))["turnId"]
        assert await tardy.next_order() == turn_id
        await spare.connect()  # room for the turn, were it back in line
        await eventually(lambda: len(relay.relay.directory.local) == 2, what="the spare drone")
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
        if then == "busy":
            tardy.answer.set_result({"ok": False, "error": "The drone is busy."})
        elif then == "refuses":
            tardy.answer.set_result({"ok": False, "error": "The drone cannot run this."})
        else:
            await tardy.close()

        assert await browser.completion(turn_id, timeout=5) == (turn_id, True, "aborted")
        ending = await browser.ending(turn_id)
        assert (ending["status"], ending["reason"], ending["endedBy"]) == (
            "aborted",
            "aborted",
            "ada",
        )
        assert await status_of(relay, turn_id) == "aborted"
        assert (tardy.orders.qsize(), spare.orders.qsize()) == (0, 0)  # sent only the once
    finally:
        for drone in (tardy, spare):
            await drone.close()


async def test_stop_after_this_step_before_the_drone_has_the_order_is_kept(
    relay: RelayHandle, browsers: Any
) -> None:
    """Asked before the drone has the order, "stop after this step" was answered "No active work
    order to abort" (the drone forgot it) and the turn ran every step. The drone keeps it for
    the order on its way, as it does an abort, and says so: the turn shows as stopping."""
    browser = await browsers("ada")
    tardy = await TardyDrone(relay.url, "tardy-1").connect()
    try:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        ack = await browser.submit("Hello")
        turn_id = ack["turnId"]
        assert await tardy.next_order() == turn_id
        gentle = await browser.call("abortWorkOrder", {"turnId": turn_id, "mode": "after_step"})
        assert gentle == (True, STOP_AFTER_STEP)

        tardy.answer.set_result({"ok": True})
        await eventually(lambda: turn_id in relay.relay.turns.accepted, what="the order taken")

        opened = await browser.call("openSession", {"sessionId": ack["sessionId"]})
        assert [(t["status"], t["stopping"]) for t in opened["turns"]] == [("processing", True)]
        ending = {"reason": "aborted"}
        done = await tardy.client.call(
            "workOrderComplete", (turn_id, True, "aborted", ending), namespace=DRONE_NAMESPACE
        )
        assert done == {"ok": True}
        assert await browser.completion(turn_id) == (turn_id, True, "aborted")
        assert (await browser.ending(turn_id))["endedBy"] == "ada"
    finally:
        await tardy.close()


async def test_a_turn_a_stopping_drone_refuses_waits_for_another_drone(
    relay: RelayHandle, browsers: Any
) -> None:
    """A drone shutting down (Ctrl-C) refuses the order it was just sent: the turn waits in
    line and goes to another drone, instead of failing, and the stopping drone is given no
    more work while it is still connected (docs/protocol.md, ``workOrder``)."""
    browser = await browsers("ada")
    stopping = await TardyDrone(relay.url, "stopping-1").connect()
    spare = TardyDrone(relay.url, "spare-1")
    try:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        turn_id = (await browser.submit("Hello"))["turnId"]
        assert await stopping.next_order() == turn_id
        await spare.connect()
        await eventually(lambda: len(relay.relay.directory.local) == 2, what="the spare drone")

        stopping.answer.set_result({"ok": False, "error": DRONE_STOPPING})

        assert await spare.next_order() == turn_id
        assert browser.completions(turn_id) == []
        assert await status_of(relay, turn_id) == "processing"

        waits = (await browser.submit("And this?"))["turnId"]  # the spare is full: it waits
        with pytest.raises(TimeoutError):  # past the second a busy drone is spared, and more
            await asyncio.wait_for(stopping.orders.get(), 2.5)
        assert await status_of(relay, waits) == "queued"
    finally:
        for drone in (stopping, spare):
            await drone.close()


async def test_one_persons_many_orders_do_not_hold_up_anothers(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    await relay.people.token("heavy")
    heavy: Browser = await browsers("heavy")
    light: Browser = await browsers("light")
    heavy_acks = [await heavy.submit(f"heavy {index}") for index in range(8)]
    assert all(ack["ok"] for ack in heavy_acks)
    light_ack = await light.submit("light 0")

    openai_peer.default = Reply(chunks=["ok"], delay=0.01)
    await start_drone(Upstream("openai", openai_peer))  # one slot: orders run one at a time
    await light.completion(light_ack["turnId"], timeout=10)
    await heavy.completion(heavy_acks[-1]["turnId"], timeout=20)

    started = [r.messages[-1]["content"] for r in openai_peer.requests]
    assert started.index("light 0") == 1, started  # after heavy's first, before its second
    # and each person's own orders first in, first out
    assert [s for s in started if s.startswith("heavy")] == [f"heavy {i}" for i in range(8)]


async def test_follow_ups_that_cannot_start_yet_do_not_cost_their_person_a_place(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    """Follow-ups waiting behind their session's running turn counted as their person's first
    places in line: her one turn that could start waited behind all of another's."""
    alice: Browser = await browsers("alice")
    bob: Browser = await browsers("bob")
    openai_peer.script(SLOW)
    openai_peer.default = Reply(chunks=["ok"])
    await start_drone(Upstream("openai", openai_peer))  # one slot: alice's long turn
    running = await alice.submit("alice runs long")
    await alice.wait_text(running["turnId"], pieces=1)
    for index in range(3):
        await alice.submit(f"alice follows {index}", sessionId=running["sessionId"])
    token = await relay.relay.accounts.create_drone_token("laptop")
    asked = [await alice.submit("alice on the laptop", droneId="laptop")]
    asked += [await bob.submit(f"bob {index}", droneId="laptop") for index in range(4)]

    await start_drone(Upstream("openai", openai_peer), token=token, name="laptop")
    for ack, browser in zip(asked, [alice, bob, bob, bob, bob], strict=True):
        assert (await browser.completion(ack["turnId"], timeout=15))[1] is True

    started = [r.messages[-1]["content"] for r in openai_peer.requests[1:6]]
    # bob was never served, alice was (her long turn): bob's first, then hers, then his others
    assert started == ["bob 0", "alice on the laptop", "bob 1", "bob 2", "bob 3"]
    assert await alice.abort(running["turnId"]) == (True, ABORT_SIGNALED)


async def test_a_turn_waiting_for_an_offline_drone_does_not_cost_its_person_a_place(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    """A turn that names a drone that is away counted as its person's first place: her turn
    for any drone then waited behind another person's second, third, ..."""
    alice: Browser = await browsers("alice")
    bob: Browser = await browsers("bob")
    openai_peer.default = Reply(chunks=["ok"])
    asked = [(bob, await bob.submit("bob 0"))]
    asked.append((alice, await alice.submit("alice on the laptop", droneId="laptop")))
    asked.append((alice, await alice.submit("alice on any")))
    asked += [(bob, await bob.submit(f"bob {index}")) for index in (1, 2, 3)]

    await start_drone(Upstream("openai", openai_peer))  # one slot; the laptop stays away
    for browser, ack in asked[2:]:
        assert (await browser.completion(ack["turnId"], timeout=15))[1] is True

    started = [r.messages[-1]["content"] for r in openai_peer.requests]
    assert started == ["bob 0", "alice on any", "bob 1", "bob 2", "bob 3"]
    assert await alice.abort(asked[1][1]["turnId"]) == (True, ABORT_SIGNALED)


async def test_a_turn_waiting_for_an_offline_drone_is_not_counted_ahead_of_one_for_any(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    """Bob's turn for any drone was shown second in line behind Alice's for her laptop, which is
    away: it starts on the next drone that comes, and is shown first."""
    alice: Browser = await browsers("alice")
    bob: Browser = await browsers("bob")
    await alice.submit("alice on the laptop", droneId="laptop")
    ack = await bob.submit("bob on any")

    assert (await place_of(bob, ack["turnId"]))["position"] == 1
    opened = await bob.call("openSession", {"sessionId": ack["sessionId"]})
    assert [turn["position"] for turn in opened["turns"]] == [1]

    openai_peer.default = Reply(chunks=["ok"])
    await start_drone(Upstream("openai", openai_peer))
    assert await bob.completion(ack["turnId"]) == (ack["turnId"], True, "ok")


async def test_the_place_shown_first_is_the_turn_that_starts_next(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    """Carol's turn keeps the one drone busy; Alice sends one for her laptop (away), then one for
    any drone, then Bob one for any: Bob's was shown first in line and Alice's second, but
    Alice's started first (her laptop's turn takes no place in her line)."""
    carol: Browser = await browsers("carol")
    alice: Browser = await browsers("alice")
    bob: Browser = await browsers("bob")
    openai_peer.script(SLOW)
    openai_peer.default = Reply(chunks=["ok"])
    await start_drone(Upstream("openai", openai_peer))  # one slot
    running = await carol.submit("carol")
    await carol.wait_text(running["turnId"], pieces=1)
    await alice.submit("alice on the laptop", droneId="laptop")
    alices = await alice.submit("alice on any")
    bobs = await bob.submit("bob on any")

    assert (await place_of(alice, alices["turnId"]))["position"] == 1
    assert (await place_of(bob, bobs["turnId"]))["position"] == 2
    await carol.abort(running["turnId"])
    await bob.completion(bobs["turnId"], timeout=15)
    started = [r.messages[-1]["content"] for r in openai_peer.requests]
    assert started == ["carol", "alice on any", "bob on any"]


async def test_a_person_may_have_only_so_many_orders_waiting(
    relay: RelayHandle, browsers: Any
) -> None:
    limit = relay.relay.turns.queue_limit
    # Several connections of one person: each has its own rate limit of 10 quick submits.
    tabs: list[Browser] = [await browsers("busy") for _ in range(limit // 10 + 1)]
    for index in range(limit):
        assert (await tabs[index // 10].submit(f"order {index}"))["ok"] is True

    refused = await tabs[-1].submit("one too many")

    assert refused == {"ok": False, "error": queue_full(limit)}


async def test_orders_sent_at_once_do_not_get_past_the_limit(
    relay: RelayHandle, browsers: Any
) -> None:
    limit = relay.relay.turns.queue_limit
    tabs: list[Browser] = [await browsers("eager") for _ in range(2 * limit // 10)]

    answers = await asyncio.gather(
        *(tab.submit(f"order {tab_index}.{index}") for tab_index, tab in enumerate(tabs)
          for index in range(10))
    )  # fmt: skip

    assert len([a for a in answers if a["ok"]]) == limit
    assert [a for a in answers if not a["ok"]] == [
        {"ok": False, "error": queue_full(limit)}
    ] * limit


async def test_a_queued_follow_up_runs_after_the_turn_with_its_history(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    first_answer = Reply(chunks=["First ", *[""] * 30, "answer."], delay=0.05)
    openai_peer.script(first_answer, Reply(chunks=["Second."]))
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("First question")
    await browser.wait_text(first["turnId"], pieces=1)

    follow_up = await browser.submit("And then?", sessionId=first["sessionId"])

    assert (await place_of(browser, follow_up["turnId"]))["position"] == 0  # behind the turn
    assert await browser.completion(follow_up["turnId"]) == (follow_up["turnId"], True, "Second.")
    sent = openai_peer.requests[-1]
    assert sent.rejected is None
    assert [(m["role"], m["content"]) for m in sent.messages] == [
        ("user", "First question"),
        ("assistant", "First answer."),
        ("user", "And then?"),
    ]


@pytest.mark.parametrize("keeps_histories", [True, False], ids=["history sent once", "whole"])
async def test_a_follow_up_cancelled_before_it_started_is_not_sent_to_the_model(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    keeps_histories: bool,
) -> None:
    """The person withdrew the prompt ("my password is hunter2, oops"), and every later turn
    of the session still sent it to the model, as a user message no answer followed."""
    first_answer = Reply(chunks=["First ", *[""] * 30, "answer."], delay=0.05)
    openai_peer.script(first_answer, Reply(chunks=["Third."]))
    await start_drone(Upstream("openai", openai_peer), workers=1 if keeps_histories else 0)
    first = await browser.submit("First question")
    await browser.wait_text(first["turnId"], pieces=1)
    withdrawn = await browser.submit("My password is hunter2", sessionId=first["sessionId"])
    assert await browser.abort(withdrawn["turnId"]) == (True, ABORT_SIGNALED)
    assert (await browser.completion(first["turnId"]))[1] is True

    third = await browser.submit("And then?", sessionId=first["sessionId"])

    assert await browser.completion(third["turnId"]) == (third["turnId"], True, "Third.")
    assert [(m["role"], m["content"]) for m in openai_peer.requests[-1].messages] == [
        ("user", "First question"),
        ("assistant", "First answer."),
        ("user", "And then?"),
    ]
    opened = await browser.call("openSession", {"sessionId": first["sessionId"]})
    assert [t["prompt"] for t in opened["turns"]][1] == "My password is hunter2"  # still shown


@pytest.mark.parametrize("first_ends", ["aborted", "error"])
async def test_a_queued_follow_up_runs_whatever_the_turn_before_it_ends_with(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    first_ends: str,
) -> None:
    # A service that breaks off its stream with something that is not a chunk: model_failed.
    failing = Reply(chunks=[f"p{i} " for i in range(20)], delay=0.05, garbage="[1, 2]")
    openai_peer.script(SLOW if first_ends == "aborted" else failing, Reply(chunks=["Second."]))
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("First question")
    await browser.wait_text(first["turnId"], pieces=2)

    follow_up = await browser.submit("And then?", sessionId=first["sessionId"])
    assert (await place_of(browser, follow_up["turnId"]))["position"] == 0
    if first_ends == "aborted":
        assert await browser.abort(first["turnId"]) == (True, ABORT_SIGNALED)

    ended = await browser.completion(first["turnId"])
    assert ended[1] is (first_ends == "aborted")  # an error is reported as one
    assert await browser.completion(follow_up["turnId"]) == (follow_up["turnId"], True, "Second.")
    sent = openai_peer.requests[-1]
    assert sent.rejected is None  # a valid conversation, whatever came before
    assert sent.messages[0] == {"role": "user", "content": "First question"}
    assert sent.messages[-1] == {"role": "user", "content": "And then?"}


async def test_interrupt_and_send_aborts_the_turn_and_runs_the_prompt_after_it(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    openai_peer.script(SLOW, Reply(chunks=["Redirected."]))
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("Write a long essay")
    await browser.wait_text(first["turnId"], pieces=3)

    second = await browser.submit("No, a haiku", sessionId=first["sessionId"], mode="interrupt")

    assert await browser.completion(first["turnId"]) == (first["turnId"], True, "aborted")
    assert await browser.completion(second["turnId"]) == (second["turnId"], True, "Redirected.")
    assert browser.order_of(first["turnId"]) == ["workOrderComplete"]
    sent = openai_peer.requests[-1]
    assert sent.rejected is None
    partial = (await relay.relay.store.get_turn(first["turnId"])).messages[-1]  # type: ignore[union-attr]
    assert partial.aborted is True
    assert [(m["role"], m["content"]) for m in sent.messages] == [
        ("user", "Write a long essay"),
        ("assistant", partial.content),
        ("user", "No, a haiku"),
    ]


async def test_interrupt_and_send_runs_next_ahead_of_follow_ups_queued_before_it(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """Ctrl+Enter stops the running turn and runs its prompt next: it waited behind the whole
    follow-up queued before it. That follow-up runs after it, with it in its history, and the
    session shows the turns in the order they ran."""
    openai_peer.script(SLOW, Reply(chunks=["Redirected."]), Reply(chunks=["Followed."]))
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("Write a long essay")
    await browser.wait_text(first["turnId"], pieces=3)
    queued = await browser.submit("Then a summary", sessionId=first["sessionId"])

    now = await browser.submit("No, a haiku", sessionId=first["sessionId"], mode="interrupt")

    assert await browser.completion(first["turnId"]) == (first["turnId"], True, "aborted")
    assert await browser.completion(now["turnId"]) == (now["turnId"], True, "Redirected.")
    assert await browser.completion(queued["turnId"]) == (queued["turnId"], True, "Followed.")
    asked = [
        [m["content"] for m in r.messages if m["role"] == "user"] for r in openai_peer.requests
    ]
    assert asked[1:] == [
        ["Write a long essay", "No, a haiku"],
        ["Write a long essay", "No, a haiku", "Then a summary"],
    ]
    assert all(r.rejected is None for r in openai_peer.requests)
    opened = await browser.call("openSession", {"sessionId": first["sessionId"]})
    assert [t["prompt"] for t in opened["turns"]] == [
        "Write a long essay",
        "No, a haiku",
        "Then a summary",
    ]


async def test_an_interrupt_dated_before_a_follow_up_that_started_meanwhile_goes_after_it(
    relay: RelayHandle,
) -> None:
    """An interrupt's place is chosen a moment before it is stored: a follow-up the dispatcher
    started in that moment would have run before a turn dated ahead of it, and the session's
    history (in the order of the turns' dates) would have left it out of the interrupt's."""
    store = relay.relay.store
    await store.create_session(SessionRecord("s_race", "u_1", "Race"))
    for number in (0, 1):
        turn = TurnRecord(f"t_{number}", "s_race", "u_1", f"prompt {number}", status="queued")
        turn.created_at = 1000.0 + number
        turn.messages = [ChatMessage(role="user", content=turn.prompt)]
        await store.create_turn(turn)
    [first] = await store.claim_queued({"d1": 2})
    await store.end_turn(first.turn_id, Ending("finished", "ok", "finished", "ok"))
    interrupt = TurnRecord("t_2", "s_race", "u_1", "now this", status="queued", created_at=1002.0)
    interrupt.messages = [ChatMessage(role="user", content=interrupt.prompt)]
    interrupt.created_at = await queue.interrupt_place(store, "s_race", interrupt)
    assert 1000.0 < interrupt.created_at < 1001.0  # before the queued follow-up
    [follow_up] = await store.claim_queued({"d1": 2})  # the dispatcher, that very moment
    assert follow_up.turn_id == "t_1"
    await store.create_turn(interrupt)

    await queue.interrupt_placed(store, interrupt)

    stored = await store.get_turn("t_2", messages=False)
    assert stored is not None and stored.created_at > 1001.0 == follow_up.created_at
    history = await session_history(store, "s_race", before=stored)
    assert [m.content for m in history if m.role == "user"] == ["prompt 0", "prompt 1"]


async def test_places_pass_over_a_turn_whose_drone_is_full_as_the_dispatcher_does(
    relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    """A turn for a named drone that is online but full takes no place in its person's line:
    their next turn, for any drone, starts at the next free slot. The places shown counted it,
    and that next turn was shown behind another person's, which it then started ahead of."""
    async with HandDrone(relay.url, "laptop") as laptop, HandDrone(relay.url, "d2") as d2:
        carol, dave, alice, bob = [await browsers(name) for name in ("carol", "dave", "ann", "bob")]
        await carol.submit("on the laptop", droneId="laptop")
        await laptop.next_order()
        busy = await dave.submit("on any")
        assert await d2.next_order() == busy["turnId"]
        await alice.submit("ann on the laptop", droneId="laptop")
        anns = await alice.submit("ann on any")
        bobs = await bob.submit("bob on any")

        shown = {
            "ann": (await place_of(alice, anns["turnId"]))["position"],
            "bob": (await place_of(bob, bobs["turnId"]))["position"],
        }
        await d2.complete(busy["turnId"], True, "done")
        started = await d2.next_order()

    assert shown == {"ann": 1, "bob": 2}
    assert started == anns["turnId"]


async def test_a_queued_turn_cancelled_from_two_tabs_at_once_is_cancelled_in_both(
    relay: RelayHandle, browsers: Callable[..., Any]
) -> None:
    """The tab that lost the race was told "No active work order to abort", a failure, for a
    turn its own person had just cancelled."""
    tab = await browsers("ann")
    other = await browsers("ann")
    answers: list[tuple[bool, str]] = []
    for prompt in ("one", "two", "three"):  # no drone: each waits in line
        ack = await tab.submit(prompt)
        await other.call("openSession", {"sessionId": ack["sessionId"]})
        answers += await asyncio.gather(tab.abort(ack["turnId"]), other.abort(ack["turnId"]))
        assert (await tab.ending(ack["turnId"]))["reason"] == "aborted"

    assert answers == [(True, ABORT_SIGNALED)] * 6


async def test_two_interrupts_dated_alike_run_and_are_told_the_history_in_one_order(
    relay: RelayHandle,
) -> None:
    """Two tabs' interrupts at one moment get one date: the queue ran them by id, but the
    history told to a drone went by the order they were stored in, so the first to run was told
    the other's prompt, which had not run, and that prompt reached the model twice."""
    store = relay.relay.store
    await store.create_session(SessionRecord("s_tie", "u_1", "Tie"))
    for turn_id, prompt, at in (("t_0", "first", 1000.0), ("t_b", "tab 2", 1001.0),
                                ("t_a", "tab 1", 1001.0)):  # fmt: skip
        turn = TurnRecord(turn_id, "s_tie", "u_1", prompt, status="queued", created_at=at)
        turn.messages = [ChatMessage(role="user", content=prompt)]
        await store.create_turn(turn)
    [first] = await store.claim_queued({"d1": 2})
    await store.end_turn(first.turn_id, Ending("finished", "ok", "finished", "ok"))

    [runs] = await store.claim_queued({"d1": 2})
    history = await session_history(store, "s_tie", before=runs)
    listed = [turn.turn_id for turn in await store.list_turns("s_tie")]

    assert [m.content for m in history if m.role == "user"] == ["first"]
    assert listed == ["t_0", runs.turn_id, *({"t_a", "t_b"} - {runs.turn_id})]


async def test_a_prompt_still_queued_is_no_part_of_a_history_told_to_a_drone(
    relay: RelayHandle,
) -> None:
    """An interrupt stored dated before a follow-up the dispatcher was starting that moment:
    the follow-up's history held the interrupt's prompt, which had not run, and the model was
    then given it twice."""
    store = relay.relay.store
    await store.create_session(SessionRecord("s_late", "u_1", "Late"))
    for turn_id, prompt, at in (("t_0", "first", 1000.0), ("t_1", "follow-up", 1002.0)):
        turn = TurnRecord(turn_id, "s_late", "u_1", prompt, status="queued", created_at=at)
        turn.messages = [ChatMessage(role="user", content=prompt)]
        await store.create_turn(turn)
    [first] = await store.claim_queued({"d1": 2})
    await store.end_turn(first.turn_id, Ending("finished", "ok", "finished", "ok"))
    [follow_up] = await store.claim_queued({"d1": 2})
    interrupt = TurnRecord("t_2", "s_late", "u_1", "now this", status="queued", created_at=1001.0)
    interrupt.messages = [ChatMessage(role="user", content=interrupt.prompt)]
    await store.create_turn(interrupt)  # before the follow-up's history is read

    whole = await session_history(store, "s_late", before=follow_up)
    since = await history_since(store, "s_late", "t_0", follow_up)

    assert [m.content for m in whole if m.role == "user"] == ["first"]
    assert [m.content for m in since if m.role == "user"] == ["first"]


async def test_stop_after_this_step_lets_the_tool_finish_then_ends_aborted(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    openai_peer.script(
        Reply(
            chunks=[],
            tool_calls=[
                ScriptedToolCall("run_shell", {"command": "sleep 1; echo finished its step"}),
                ScriptedToolCall("run_shell", {"command": "echo never run"}),
            ],
        ),
        Reply(chunks=["never asked"]),
    )
    await start_drone(Upstream("openai", openai_peer))
    ack = await browser.submit("Do two things")
    await eventually(lambda: browser.progress(ack["turnId"], "tool"), what="the first tool")

    gentle = await browser.call("abortWorkOrder", {"turnId": ack["turnId"], "mode": "after_step"})

    assert gentle == (True, STOP_AFTER_STEP)
    assert await browser.completion(ack["turnId"], timeout=10) == (ack["turnId"], True, "aborted")
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None
    assert [(m.role, m.content.strip()) for m in turn.messages[2:]] == [
        ("tool", "exit code 0\nfinished its step"),
        ("tool", TOOL_CANCELLED),
    ]
    assert len(openai_peer.requests) == 1, "no model call after the step"
    assert (await browser.ending(ack["turnId"]))["reason"] == "aborted"


async def test_stop_after_this_step_lets_the_model_call_finish_then_runs_none_of_its_tools(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    words = [f"word{i} " for i in range(40)]
    never = ScriptedToolCall("run_shell", {"command": "echo never run"})
    openai_peer.script(Reply(chunks=words, delay=0.03, tool_calls=[never]), Reply(["unasked"]))
    await start_drone(Upstream("openai", openai_peer))
    ack = await browser.submit("Answer, then use a tool")
    await browser.wait_text(ack["turnId"], pieces=2)

    gentle = await browser.call("abortWorkOrder", {"turnId": ack["turnId"], "mode": "after_step"})

    assert gentle == (True, STOP_AFTER_STEP)
    assert await browser.completion(ack["turnId"], timeout=10) == (ack["turnId"], True, "aborted")
    assert browser.text(ack["turnId"]) == "".join(words)  # the model call ran to its end
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None
    assert [(m.role, m.content.strip()) for m in turn.messages] == [
        ("user", "Answer, then use a tool"),
        ("assistant", "".join(words).strip()),
        ("tool", TOOL_CANCELLED),
    ]
    assert len(openai_peer.requests) == 1, "no model call after the step"


async def test_stop_after_this_step_during_the_final_answer_keeps_it_and_ends_aborted(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """The step in progress is the last one: its answer is kept whole, and the turn ends
    aborted, as "Stopping after this step" promised (docs/protocol.md), not finished."""
    words = [f"word{i} " for i in range(40)]
    openai_peer.script(Reply(chunks=words, delay=0.03))
    await start_drone(Upstream("openai", openai_peer))
    ack = await browser.submit("Answer at length")
    await browser.wait_text(ack["turnId"], pieces=2)

    gentle = await browser.call("abortWorkOrder", {"turnId": ack["turnId"], "mode": "after_step"})

    assert gentle == (True, STOP_AFTER_STEP)
    assert await browser.completion(ack["turnId"], timeout=10) == (ack["turnId"], True, "aborted")
    assert browser.text(ack["turnId"]) == "".join(words)
    ending = await browser.ending(ack["turnId"])
    assert (ending["status"], ending["reason"]) == ("aborted", "aborted")
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None
    assert [(m.role, m.content.strip(), bool(m.aborted)) for m in turn.messages] == [
        ("user", "Answer at length", False),
        ("assistant", "".join(words).strip(), False),
    ]


async def test_a_finished_turn_stores_and_reports_the_tokens_it_used(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    openai_peer.script(Reply(chunks=["a", "b", "c"]), SLOW)
    await start_drone(Upstream("openai", openai_peer))
    finished = await browser.submit("Count")
    await browser.completion(finished["turnId"])
    cut = await browser.submit("Count slowly")
    await browser.wait_text(cut["turnId"], pieces=3)
    await browser.abort(cut["turnId"])
    await browser.completion(cut["turnId"])

    counted = (await browser.ending(finished["turnId"]))["usage"]
    assert counted["completionTokens"] == 3 and counted["promptTokens"] > 0
    assert counted["estimated"] is False
    estimated = (await browser.ending(cut["turnId"]))["usage"]
    assert estimated["estimated"] is True and estimated["completionTokens"] >= 3
    turn = await relay.relay.store.get_turn(finished["turnId"])
    assert turn is not None and turn.usage is not None and turn.usage.completion_tokens == 3
    metrics = relay.relay.metrics.tokens
    assert metrics.labels("completion")._value.get() == 3 + estimated["completionTokens"]


async def test_a_queued_order_survives_a_restart_of_a_relay_on_sqlite(
    tmp_path: Path, openai_peer: OpenAIPeer, drone_process: Callable[..., Any]
) -> None:
    """The embedded default (one relay, SQLite): stopped and started again, it still has the
    order, and runs it once a drone comes."""
    database = str(relay_folder(tmp_path) / "queue.db")
    config = RelayConfig(port=0, database=database, drone_token=DRONE_TOKEN)
    runner, port = await start_relay(config)
    try:
        token = await People(runner.app[RELAY].accounts).token("patient")
        browser = await Browser(f"http://127.0.0.1:{port}", token).connect()
        ack = await browser.submit("Whenever a drone comes")
        await place_of(browser, ack["turnId"])
        await browser.close()
    finally:
        await runner.cleanup()

    runner, port = await start_relay(config)
    try:
        store = runner.app[RELAY].store
        turn = await store.get_turn(ack["turnId"], messages=False)
        assert turn is not None and turn.status == "queued"
        drone_process(Upstream("openai", openai_peer), server=f"http://127.0.0.1:{port}")

        async def finished() -> bool:
            turn = await store.get_turn(ack["turnId"], messages=False)
            return turn is not None and turn.status == "finished"

        await eventually(finished, timeout=20, what="the queued order to run")
        assert [r.messages[-1]["content"] for r in openai_peer.requests] == [
            "Whenever a drone comes"
        ]
    finally:
        await runner.cleanup()


async def test_a_turn_claimed_by_a_relay_that_died_before_sending_it_is_sent_again(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browsers: Callable[..., Any],
) -> None:
    """A relay claimed a turn for a drone connected to another relay and died before it sent
    the order: the turn stayed processing on a drone that never heard of it, for ever (the
    drone was there, so no sweep judged it lost). The relay that holds the drone sends the order
    again once its sendings would have ended (docs/reliability.md)."""
    openai_peer.script(Reply(chunks=["Sent ", "again."]))
    drone = await start_drone(Upstream("openai", openai_peer))
    alice: Browser = await browsers("alice")
    owner = (await relay.relay.accounts.user("alice")).user_id  # type: ignore[union-attr]
    store = relay.relay.store
    await store.create_session(SessionRecord("s_lost", owner, "A lost order"))
    claimed = time.time() - 70  # as the relay that died left it, a minute ago
    turn = TurnRecord(
        "t_lost", "s_lost", owner, "Where did it go?", status="processing",
        drone_id=drone.drone_id, created_at=claimed, started_at=claimed,
        messages=[ChatMessage(role="user", content="Where did it go?")],
    )  # fmt: skip
    await store.create_turn(turn)
    await alice.call("openSession", {"sessionId": "s_lost"})

    assert await alice.completion("t_lost", timeout=10) == ("t_lost", True, "Sent again.")
    assert len(openai_peer.requests) == 1  # once
    ran = await store.get_turn("t_lost")
    assert ran is not None and [m.role for m in ran.messages] == ["user", "assistant"]
