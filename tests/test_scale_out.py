"""Several relays on one PostgreSQL and one Redis, as real subprocesses: the person's view is the
same as on one relay, and every turn ends exactly once whatever dies."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import socketio

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from bench.services import OwnRedis
from hangar.server.access import LOGIN_COOKIE
from hangar.server.accounts import Accounts
from hangar.server.app import RelayConfig
from hangar.server.directory import DRONE_CALL_TIMEOUT
from hangar.server.postgres_store import CLAIM_LOCK, PostgresTurnStore
from hangar.server.store import TurnRecord
from hangar.server.turns import queue_full
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ALREADY_CONNECTED,
    DRONE_NAMESPACE,
    TERMINAL_STATUSES,
)
from tests.conftest import (
    DRONE_TOKEN,
    Browser,
    People,
    RelayProcess,
    Upstream,
    drone_hello,
    eventually,
)
from tests.test_cli import hangar

SLOW = Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03)
Start = Callable[..., Any]


@pytest.fixture
async def store(postgres_url: str) -> AsyncIterator[PostgresTurnStore]:
    store = PostgresTurnStore(postgres_url)
    await store.open()
    yield store
    await store.close()


@pytest.fixture
async def open_browser(store: PostgresTurnStore) -> AsyncIterator[Callable[..., Any]]:
    """A browser of a person (a new one of their own unless named) on the relay at ``url``."""
    opened: list[Browser] = []
    people = People(Accounts(store))

    async def connect(url: str, person: str | None = None) -> Browser:
        browser = await Browser(url, await people.token(person)).connect()
        opened.append(browser)
        return browser

    yield connect
    for browser in opened:
        await browser.close()


async def drones_seen_from(browser: Browser, count: int = 1) -> list[dict[str, Any]]:
    async def listed() -> list[dict[str, Any]]:
        answer = await browser.call("listDrones", {})
        drones: list[dict[str, Any]] = answer["drones"]
        return drones

    drones: list[dict[str, Any]] = []
    for _ in range(1000):
        drones = await listed()
        if len(drones) >= count:
            return drones
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} drone(s) never became visible; saw {drones}")


def relays_joined(log: Path) -> list[str]:
    """The relays a drone process connected to, in order, from its log."""
    return re.findall(r"connected to relay (\S+)", log.read_text())


async def stored(store: PostgresTurnStore, turn_id: str) -> TurnRecord:
    turn = await store.get_turn(turn_id)
    assert turn is not None
    return turn


async def test_a_browser_on_one_relay_aborts_a_drone_on_another(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    openai_peer.script(SLOW)
    drone_process(Upstream("openai", openai_peer), server=b.url)
    await drones_seen_from(await open_browser(b.url))

    browser: Browser = await open_browser(a.url)
    turn_id = (await browser.submit("Across relays"))["turnId"]
    await browser.wait_text(turn_id, pieces=3, timeout=10)
    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)

    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    assert browser.order_of(turn_id) == ["abortAck", "workOrderComplete"]
    await openai_peer.wait_for_disconnect()
    turn = await stored(store, turn_id)
    assert turn.status == "aborted"
    assert turn.text == browser.text(turn_id)
    assert turn.messages[-1].aborted is True


async def test_a_page_on_another_relay_gets_what_a_sub_agent_streamed_so_far(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
) -> None:
    """The drone's relay keeps its sub-agents' output in Redis, where every relay reads it for a
    snapshot (docs/protocol.md, ``openSession``)."""
    a, b = await relay_processes(), await relay_processes()
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": "look"})]),
        SLOW,
    )
    drone_process(Upstream("openai", openai_peer), server=b.url)
    await drones_seen_from(await open_browser(b.url))
    owner: Browser = await open_browser(a.url, "sub-agent-watcher")
    ack = await owner.submit("Delegate")
    await eventually(
        lambda: len([p for p in owner.progress(ack["turnId"]) if p["depth"] == 1]) >= 3,
        timeout=10,
        what="the sub-agent streaming",
    )

    tab: Browser = await open_browser(a.url, "sub-agent-watcher")
    [turn] = (await tab.call("openSession", {"sessionId": ack["sessionId"]}))["turns"]

    [run] = turn["subAgents"]
    [part] = run["parts"]
    assert part["depth"] == 1 and part["text"].startswith("w0 w1 w2 ")
    assert await owner.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    assert (await owner.completion(ack["turnId"], timeout=10))[1:] == (True, "aborted")


async def test_relays_listen_on_redis_from_the_start_before_any_client(
    relay_processes: Start, redis_url: str, postgres_url: str
) -> None:
    import redis.asyncio as aioredis

    await relay_processes()
    await relay_processes()
    client = aioredis.Redis.from_url(redis_url)
    channel = RelayConfig(database=postgres_url).deployment()
    try:
        # Otherwise a relay only listens once its first client connects, and acks aimed at
        # it from other relays are lost until then.
        async def listeners_at_least_two() -> int | None:
            count = int((await client.pubsub_numsub(channel))[0][1])
            return count if count >= 2 else None

        listeners = await eventually(
            listeners_at_least_two, timeout=10, what="both relays to subscribe"
        )
    finally:
        await client.aclose()
    assert listeners == 2


@pytest.mark.parametrize("aborted", [False, True], ids=["finishes", "aborted-later"])
async def test_killing_the_drones_relay_mid_turn_moves_the_drone_and_ends_the_turn_once(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
    aborted: bool,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    reply = SLOW if aborted else Reply(chunks=[f"c{i} " for i in range(80)], delay=0.03)
    openai_peer.script(reply)
    drone_process(Upstream("openai", openai_peer), server=f"{b.url},{a.url}")
    browser: Browser = await open_browser(a.url)
    await drones_seen_from(browser)
    turn_id = (await browser.submit("Survive a relay"))["turnId"]
    await browser.wait_text(turn_id, pieces=5, timeout=10)

    b.kill()
    if aborted:
        await eventually(
            lambda: len(browser.progress(turn_id)) > 40, timeout=15, what="the drone on relay A"
        )
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    _, success, message = await browser.completion(turn_id, timeout=20)

    assert success is True
    assert message == ("aborted" if aborted else reply.text.strip()[:199] + "…")
    turn = await stored(store, turn_id)
    assert turn.status == ("aborted" if aborted else "finished")
    assert len(browser.completions(turn_id)) == 1
    assert await store.processing_turns() == []


async def streaming_on_one_of_two(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    own_redis: OwnRedis,
    reply: Reply,
) -> tuple[RelayProcess, subprocess.Popen[bytes], Browser, str]:
    """Two relays on the test's own Redis, a drone on the second (its relay), a browser on the
    first: the drone's relay, the drone, the browser and the turn streaming ``reply``."""
    a = await relay_processes(redis=own_redis.url)
    b = await relay_processes(redis=own_redis.url)
    openai_peer.script(reply)
    drone = drone_process(Upstream("openai", openai_peer), server=f"{b.url},{a.url}")
    browser: Browser = await open_browser(a.url)
    await drones_seen_from(browser)
    turn_id = (await browser.submit("Survive both"))["turnId"]
    return b, drone, browser, turn_id


async def test_a_drone_whose_relay_and_redis_die_together_keeps_its_turn_and_its_text(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
    own_redis: OwnRedis,
    tmp_path: Path,
) -> None:
    """Redis and the drone's relay killed in one instant: the other relay refused the drone
    while Redis was away, and ended its turn as lost a second before the drone, its back-off
    grown, came in. The text the page had shown was only in the dead relay and in Redis: the
    stored turn kept none of it, and the drone's text, sent again, was refused."""
    reply = Reply(chunks=[f"c{i} " for i in range(200)], delay=0.05)
    b, _, browser, turn_id = await streaming_on_one_of_two(
        relay_processes, drone_process, openai_peer, open_browser, own_redis, reply
    )
    seen = await browser.wait_text(turn_id, pieces=5, timeout=10)

    b.kill()
    own_redis.kill()
    refused = "cannot do that just now"
    await eventually(
        lambda: refused in "".join(p.read_text() for p in tmp_path.glob("proc-drone-*.log")),
        timeout=15,
        what="the drone refused while Redis is away",
    )
    own_redis.start()
    _, success, _ = await browser.completion(turn_id, timeout=30)
    turn = await stored(store, turn_id)

    assert success is True and turn.status == "finished"
    assert turn.text.startswith(seen) and reply.text.startswith(turn.text.strip())


async def test_text_shown_before_redis_came_back_empty_is_stored_from_a_drone_back_late(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
    own_redis: OwnRedis,
) -> None:
    """The drone's relay and Redis died while the drone was frozen: the other relay ended its
    turn as lost with none of the text its page had shown (only the dead relay and Redis had
    it), and took nothing of the text the drone sent again once it was back."""
    reply = Reply(chunks=[f"c{i} " for i in range(600)], delay=0.05)  # 30 s
    b, drone, browser, turn_id = await streaming_on_one_of_two(
        relay_processes, drone_process, openai_peer, open_browser, own_redis, reply
    )
    seen = await browser.wait_text(turn_id, pieces=5, timeout=10)

    drone.send_signal(signal.SIGSTOP)
    try:
        b.kill()
        own_redis.restart()
        _, success, _ = await browser.completion(turn_id, timeout=30)
        assert success is False
    finally:
        drone.send_signal(signal.SIGCONT)

    async def kept() -> bool:
        return (await stored(store, turn_id)).text.startswith(seen)

    await eventually(kept, timeout=15, what="the text shown, stored")


async def test_a_drone_leaves_a_frozen_relay_for_another_and_its_work_goes_on(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    tmp_path: Path,
) -> None:
    # A relay that stops (SIGSTOP) keeps its TCP connections open: only the silence of its
    # engine.io pings (every 0.5 s, answered within 1 s here) tells its drones it is gone.
    a, b = await relay_processes(), await relay_processes()
    drone_process(Upstream("openai", openai_peer), server=f"{a.url},{b.url}", concurrency=2)
    browser: Browser = await open_browser(b.url)
    await drones_seen_from(browser)
    log = tmp_path / "proc-drone-0.log"

    joined = await eventually(lambda: relays_joined(log), timeout=10, what="the drone on a relay")
    assert joined == [a.url]
    openai_peer.script(SLOW, Reply(chunks=["still ", "here"]))
    running = (await browser.submit("Outlast a frozen relay"))["turnId"]
    await browser.wait_text(running, pieces=5, timeout=10)
    a.process.send_signal(signal.SIGSTOP)
    try:
        moved = await eventually(
            lambda: relays_joined(log)[1:], timeout=15, what="the drone to leave the frozen relay"
        )
        assert moved == [b.url]
        turn_id = (await browser.submit("Work after a relay froze"))["turnId"]
        assert await browser.completion(turn_id, timeout=10) == (turn_id, True, "still here")
        ending = await browser.completion(running, timeout=15)
        assert ending == (running, True, SLOW.text.strip()[:199] + "…")
    finally:
        a.process.send_signal(signal.SIGCONT)
    # The connection it left is closed, not found open later by the garbage collector.
    assert not re.findall(r" (?:ERROR|CRITICAL) |Traceback|Unclosed", log.read_text())


async def test_a_drone_that_starts_while_its_first_relay_is_frozen_goes_to_the_next(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    tmp_path: Path,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    a.process.send_signal(signal.SIGSTOP)  # its kernel still completes the TCP handshake
    try:
        drone_process(Upstream("openai", openai_peer), server=f"{a.url},{b.url}")
        log = tmp_path / "proc-drone-0.log"
        connected = await eventually(
            lambda: relays_joined(log),
            timeout=15,
            what="the drone to give up on the frozen relay",
        )
        assert connected == [b.url]
        browser: Browser = await open_browser(b.url)
        openai_peer.script(Reply(chunks=["on ", "the next"]))
        turn_id = (await browser.submit("Work beside a frozen relay"))["turnId"]
        assert await browser.completion(turn_id, timeout=10) == (turn_id, True, "on the next")
    finally:
        a.process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("fate", ["freezes", "dies"])
async def test_an_order_sent_through_a_relay_that_freezes_or_dies_follows_the_drone(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    tmp_path: Path,
    fate: str,
) -> None:
    # The order goes through Redis to the drone's relay, which is stopped and never hands it on;
    # then it stays frozen (the drone leaves it within a second and a half) or is killed (the
    # drone leaves at once). The order must follow the drone then, not when the sending relay
    # gives up waiting for the lost answer (``DRONE_CALL_TIMEOUT``).
    a, b = await relay_processes(), await relay_processes()
    drone_process(Upstream("openai", openai_peer), server=f"{b.url},{a.url}")
    browser: Browser = await open_browser(a.url)
    await drones_seen_from(browser)
    log = tmp_path / "proc-drone-0.log"
    assert await eventually(lambda: relays_joined(log), timeout=10, what="a relay") == [b.url]
    openai_peer.script(Reply(chunks=["followed ", "the drone"]))
    b.process.send_signal(signal.SIGSTOP)
    try:
        sent = time.monotonic()
        turn_id = (await browser.submit("Follow the drone"))["turnId"]
        await eventually(
            lambda: f"work order sent turn={turn_id}" in a.log.read_text(),
            timeout=10,
            what="the order on its way through the stopped relay",
        )
        if fate == "dies":
            b.kill()
        ending = await browser.completion(turn_id, timeout=DRONE_CALL_TIMEOUT + 10)
        took = browser.progress_times(turn_id)[0] - sent
    finally:
        if fate == "freezes":  # a killed relay is ended by the fixture
            b.process.send_signal(signal.SIGCONT)
    assert ending == (turn_id, True, "followed the drone")
    assert relays_joined(log) == [b.url, a.url]
    assert took < DRONE_CALL_TIMEOUT * 0.7, f"the order reached the drone after {took:.1f} s"
    assert len(browser.completions(turn_id)) == 1
    assert "Traceback" not in a.log.read_text()


CLAIM_TAKER = """
    SELECT string_agg(CASE WHEN l.granted THEN 'holds' ELSE 'waits' END, ',')
    FROM pg_locks l JOIN pg_stat_activity a USING (pid)
    WHERE l.locktype = 'advisory' AND l.objid = $1 AND a.application_name = $2
"""
"""Whether the relay named ``$2`` holds the claim lock ``$1``, waits for it, or neither (NULL)."""


async def claim_is(store: PostgresTurnStore, name: str, state: str) -> bool:
    return bool(await store.pool.fetchval(CLAIM_TAKER, CLAIM_LOCK, name) == state)


async def test_a_relay_frozen_in_the_middle_of_a_claim_does_not_stop_the_other_relays_queue(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
    postgres_url: str,
) -> None:
    # Relay b freezes (stopped, its machine paused) inside its claim of queued turns, holding the
    # lock that lets one relay claim at a time; relay a's drone must still get a's work.
    a, b = await relay_processes(), await relay_processes()
    drone_process(Upstream("openai", openai_peer), server=a.url)
    browser: Browser = await open_browser(a.url)
    await drones_seen_from(browser)
    name = f"hangar relay {b.process.pid}"
    holder = await asyncpg.connect(postgres_url)  # not a relay's: no bound on its transaction
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT pg_advisory_xact_lock($1)", CLAIM_LOCK)
        # b's sweep claims every second: it waits for the lock held here, and is stopped then.
        await eventually(
            lambda: claim_is(store, name, "waits"), timeout=10, what="b to wait for the lock"
        )
        b.process.send_signal(signal.SIGSTOP)
        await tx.rollback()
    finally:
        await holder.close()
    try:
        await eventually(lambda: claim_is(store, name, "holds"), what="b to hold the lock")
        openai_peer.script(Reply(chunks=["not held ", "up"]))
        turn_id = (await browser.submit("Past the frozen relay"))["turnId"]
        assert await browser.completion(turn_id, timeout=15) == (turn_id, True, "not held up")
    finally:
        b.process.send_signal(signal.SIGCONT)
    # b, woken, claims again on a new connection: a turn sent through it runs too.
    other: Browser = await open_browser(b.url)
    openai_peer.script(Reply(chunks=["b is ", "back"]))
    turn_id = (await other.submit("Through the relay that froze"))["turnId"]
    assert await other.completion(turn_id, timeout=15) == (turn_id, True, "b is back")
    assert "Traceback" not in b.log.read_text()


async def test_a_relay_started_again_sends_no_work_to_the_drone_that_died_with_it(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    """A relay took every drone entry in Redis for a live one in its first seconds: started
    again after it died with its drone, it sent that drone's queued turn to it (the turn ended
    in error, never run) and refused the drone, started again too, as "connected already"."""
    token = await Accounts(store).create_drone_token("d1")
    a, b = await relay_processes(), await relay_processes()
    drone = drone_process(Upstream("openai", openai_peer), server=a.url, name="d1", token=token)
    browser: Browser = await open_browser(b.url)
    await drones_seen_from(browser)
    openai_peer.script(SLOW, Reply(chunks=["ran ", "after all"]))
    first = (await browser.submit("Keep the drone busy"))["turnId"]
    await browser.wait_text(first, pieces=1, timeout=10)
    waiting = (await browser.submit("Wait for the drone"))["turnId"]  # its one slot is taken
    a.kill()
    drone.kill()
    assert (await browser.completion(first, timeout=15))[1] is False  # its drone is gone

    again = await relay_processes()
    drone_process(Upstream("openai", openai_peer), server=again.url, name="d1", token=token)

    assert await browser.completion(waiting, timeout=20) == (waiting, True, "ran after all")
    assert len(openai_peer.requests) == 2


async def test_a_drone_started_again_while_its_earlier_self_hangs_comes_in_once_let_go(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
    tmp_path: Path,
) -> None:
    """Its machine hung, the drone is started again (elsewhere): the relay still holds the hung
    connection for its grace and refuses the drone's id meanwhile. The new drone exited at once,
    for good; it comes again until the relay lets the old connection go."""
    token = await Accounts(store).create_drone_token("d1")
    relay = await relay_processes(drone_grace=5.0)
    hung = drone_process(Upstream("openai", openai_peer), server=relay.url, name="d1", token=token)
    browser: Browser = await open_browser(relay.url)
    await drones_seen_from(browser)
    hung.send_signal(signal.SIGSTOP)
    try:
        new = drone_process(
            Upstream("openai", openai_peer), server=relay.url, name="d1", token=token
        )
        log = tmp_path / "d1-1.log"
        await eventually(lambda: ALREADY_CONNECTED in log.read_text(), 15, "a refusal")
        await eventually(lambda: relays_joined(log), timeout=20, what="the drone let in")
        openai_peer.script(Reply(chunks=["the new ", "one"]))
        turn_id = (await browser.submit("Who runs this?"))["turnId"]
        assert await browser.completion(turn_id, timeout=10) == (turn_id, True, "the new one")
        assert new.poll() is None
    finally:
        hung.kill()


async def test_a_drone_killed_mid_stream_ends_its_turn_in_error(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    a, b = await relay_processes(drone_grace=1.0), await relay_processes(drone_grace=1.0)
    openai_peer.script(SLOW)
    process: subprocess.Popen[bytes] = drone_process(Upstream("openai", openai_peer), server=b.url)
    browser: Browser = await open_browser(a.url)
    await drones_seen_from(browser)
    turn_id = (await browser.submit("Then the drone dies"))["turnId"]
    await browser.wait_text(turn_id, pieces=3, timeout=10)

    process.kill()

    assert await browser.completion(turn_id, timeout=10) == (
        turn_id,
        False,
        "The drone disconnected.",
    )
    assert (await stored(store, turn_id)).status == "error"


async def test_the_abort_watchdog_ends_a_turn_whose_drone_never_completes(
    relay_processes: Start, open_browser: Start, store: PostgresTurnStore
) -> None:
    stubborn, browser, first = await a_turn_on_a_stubborn_drone(relay_processes, open_browser)

    assert await browser.abort(first["turnId"]) == (True, ABORT_SIGNALED)
    assert await browser.completion(first["turnId"], timeout=10) == (
        first["turnId"],
        True,
        "aborted",
    )
    ending = await browser.ending(first["turnId"])
    assert (ending["reason"], ending["endedBy"]) == ("unanswered", browser_name(ending))

    second = await browser.submit("Next one", sessionId=first["sessionId"])
    await eventually(lambda: len(stubborn.orders) == 2, what="the second work order")
    late = await stubborn.call("workOrderComplete", (first["turnId"], True, "done at last"))
    await stubborn.call(
        "workOrderProgress", {"kind": "text", "turnId": second["turnId"], "text": "marker"}
    )
    await browser.wait_text(second["turnId"], pieces=1)

    assert late == {"ok": False, "error": "The turn has already ended."}
    assert len(browser.completions(first["turnId"])) == 1
    assert (await stored(store, first["turnId"])).status == "aborted"
    await stubborn.close()


async def test_orders_sent_at_once_through_two_relays_do_not_get_past_the_queue_limit(
    relay_processes: Start, open_browser: Start
) -> None:
    a, b = await relay_processes(), await relay_processes()
    tabs: list[Browser] = [await open_browser(url, "eager") for url in (a.url, a.url, b.url, b.url)]

    answers = await asyncio.gather(
        *(tab.submit(f"order {number}.{index}") for number, tab in enumerate(tabs)
          for index in range(10))
    )  # fmt: skip

    assert len([a for a in answers if a["ok"]]) == 20  # the relays' default limit
    assert {a.get("error") for a in answers if not a["ok"]} == {queue_full(20)}


async def test_of_drones_connecting_under_one_id_to_two_relays_at_once_only_one_is_let_in(
    relay_processes: Start,
) -> None:
    """Each relay read Redis before either had written the drone there, and both let theirs in:
    the drone was listed online from two places, and the one that did not hold its route could
    send text into its turns and end them."""
    a, b = await relay_processes(), await relay_processes()
    refusals: list[Any] = []

    async def connect(url: str, drone_id: str, instance: str) -> socketio.AsyncClient | None:
        client = socketio.AsyncClient(reconnection=False)
        client.on("connect_error", refusals.append, namespace=DRONE_NAMESPACE)
        hello = {**drone_hello(drone_id), "instance": f"instance-secret-{instance}"}
        try:
            await client.connect(
                url, namespaces=[DRONE_NAMESPACE], auth=hello, transports=["websocket"]
            )
        except socketio.exceptions.ConnectionError:
            return None
        return client

    for round_ in range(12):  # the two connects cross in most rounds
        drone_id = f"twin{round_}-0"
        clients = await asyncio.gather(connect(a.url, drone_id, "a"), connect(b.url, drone_id, "b"))
        try:
            let_in = [client is not None for client in clients]
            assert let_in.count(True) == 1, (round_, let_in, refusals)
        finally:
            for client in clients:
                if client is not None:
                    await client.disconnect()
    assert refusals == [{"message": ALREADY_CONNECTED}] * 12


async def test_output_streamed_after_another_relay_ended_the_turn_is_not_left_in_redis(
    relay_processes: Start, open_browser: Start, redis_url: str
) -> None:
    import redis.asyncio as aioredis

    stubborn, browser, ack = await a_turn_on_a_stubborn_drone(relay_processes, open_browser)
    turn_id = ack["turnId"]
    early = {"kind": "text", "turnId": turn_id, "text": "streaming "}
    assert await stubborn.call("workOrderProgress", early) == {"ok": True}
    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
    assert (await browser.completion(turn_id, timeout=10))[1:] == (True, "aborted")

    # Ended by relay A's watchdog; relay B, which the drone streams through, hears of it
    # within its next sweep and keeps what streams meanwhile.
    late = {"kind": "text", "turnId": turn_id, "text": "said too late"}
    sub_agent = {**late, "depth": 1, "text": "a sub-agent, too late"}
    assert await stubborn.call("workOrderProgress", late) == {"ok": True}
    assert await stubborn.call("workOrderProgress", sub_agent) == {"ok": True}

    async def refused() -> bool:
        return (await stubborn.call("workOrderProgress", late))["ok"] is False

    await eventually(refused, timeout=5, what="relay B to hear the turn ended")
    client = aioredis.Redis.from_url(redis_url)
    try:

        async def kept() -> list[bytes]:
            return [key async for key in client.scan_iter(match=f"*{turn_id}*")]

        leftover = await kept()
        if leftover:  # dropped right after relay B forgot the turn, not 30 days later
            await eventually(lambda: _none(kept()), timeout=1, what=f"{leftover} to go")
    finally:
        await client.aclose()
    await stubborn.close()


async def _none(found: Any) -> bool:
    return not await found


async def test_a_relay_restart_ends_orphaned_turns_and_keeps_those_a_live_drone_runs(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    port = _free_port()
    relay = await relay_processes(port=port, redis=False)
    openai_peer.script(SLOW)
    drone_process(Upstream("openai", openai_peer), server=relay.url)
    browser: Browser = await open_browser(relay.url, "restarting-person")
    await drones_seen_from(browser)
    ack = await browser.submit("Keep going")
    running = ack["turnId"]
    await browser.wait_text(running, pieces=3, timeout=10)
    orphan = TurnRecord(
        turn_id="t_orphan", session_id="s_orphan", owner="someone", prompt="Left behind",
        drone_id="gone-drone",
    )  # fmt: skip
    await _store_orphan(store, orphan)

    relay.kill()
    await relay.process.wait()
    await browser.close()
    relay = await relay_processes(port=port, redis=False)
    browser = await open_browser(relay.url, "restarting-person")
    await drones_seen_from(browser)
    reopened = await browser.call("openSession", {"sessionId": ack["sessionId"]})
    assert [t["status"] for t in reopened["turns"]] == ["processing"]

    assert await browser.abort(running) == (True, ABORT_SIGNALED)
    assert (await browser.completion(running, timeout=10))[1:] == (True, "aborted")
    assert (await stored(store, running)).status == "aborted"
    orphaned = await eventually(
        lambda: _ended(store, "t_orphan"), timeout=10, what="the orphan to end"
    )
    assert (orphaned.status, orphaned.result, orphaned.reason) == (
        "error",
        "The relay restarted.",
        "relay_restarted",
    )


async def test_five_hundred_work_orders_with_random_aborts_each_end_exactly_once(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    openai_peer.default = Reply(chunks=[f"p{i} " for i in range(16)], delay=0.05)
    full = openai_peer.default.text
    for index, relay in enumerate((a, b)):
        drone_process(
            Upstream("openai", openai_peer), server=relay.url, name=f"d{index}", concurrency=50
        )
    browsers: list[Browser] = [await open_browser((a, b)[i % 2].url) for i in range(50)]
    await drones_seen_from(browsers[0], count=2)
    rng = random.Random(20261122)
    seen: dict[str, tuple[str, bool, str]] = {}
    answers: list[tuple[bool, str]] = []

    async def person(browser: Browser) -> None:
        for _ in range(10):
            ack = await browser.call("submitWorkOrder", {"prompt": "Race me"}, timeout=30)
            assert ack["ok"] is True, ack
            if rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.6))  # a person's random moment, not a wait
                answers.append(await browser.abort(ack["turnId"], timeout=30))
            seen[ack["turnId"]] = await browser.completion(ack["turnId"], timeout=30)

    await asyncio.wait_for(asyncio.gather(*(person(b) for b in browsers)), 120)

    assert len(seen) == 500
    for browser in browsers:
        for turn_id in {args[0] for event, args in browser.events if event == "workOrderComplete"}:
            assert len(browser.completions(turn_id)) == 1, turn_id
    statuses: dict[str, int] = {}
    for turn_id, (_, success, message) in seen.items():
        turn = await stored(store, turn_id)
        expected = "error" if not success else ("aborted" if message == "aborted" else "finished")
        assert turn.status == expected, (turn_id, turn.status, message)
        statuses[turn.status] = statuses.get(turn.status, 0) + 1
        assert [m.role for m in turn.messages] in (["user"], ["user", "assistant"])
        for reply in turn.messages[1:]:  # the answer so far: partial and flagged, or whole
            assert full.startswith(reply.content)
            assert reply.aborted or reply.content == full
            assert not reply.aborted or turn.status == "aborted", (turn.result, turn.reason)
    assert statuses.get("error", 0) == 0, statuses
    assert statuses.get("aborted", 0) > 50 and statuses.get("finished", 0) > 50, statuses
    assert answers.count((True, ABORT_SIGNALED)) == statuses["aborted"], answers
    assert await store.processing_turns() == []
    assert not [r for r in openai_peer.requests if r.rejected]


# ---- helpers


async def theirs_token(database: str) -> str:
    """An API token of a person of the deployment whose database is ``database`` (SQLite)."""
    from hangar.server.sqlite_store import SqliteTurnStore

    store = SqliteTurnStore(database)
    await store.open()
    try:
        return await People(Accounts(store)).token("stranger")
    finally:
        await store.close()


def browser_name(ending: dict[str, Any]) -> str:
    """A test person's name (``person-N``), as a turn ended on their abort names them."""
    name = str(ending.get("endedBy", ""))
    assert name.startswith("person-"), ending
    return name


async def a_turn_on_a_stubborn_drone(
    relay_processes: Start, open_browser: Start
) -> tuple[StubbornDrone, Browser, dict[str, Any]]:
    """Relay A with a person's browser, relay B with a drone that never completes a turn (both
    with a 1 s abort watchdog), and a turn of the person's the drone took."""
    a, b = await relay_processes(abort_grace=1.0), await relay_processes(abort_grace=1.0)
    stubborn = StubbornDrone()
    await stubborn.connect(b.url)
    browser: Browser = await open_browser(a.url)
    await drones_seen_from(browser)
    ack = await browser.submit("Never ends")
    await eventually(lambda: stubborn.orders, what="the work order at the drone")
    return stubborn, browser, ack


class StubbornDrone:
    """A drone that accepts work and acknowledges aborts, but never completes a turn."""

    def __init__(self) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.orders: list[dict[str, Any]] = []
        self.sio.on("workOrder", self.on_work_order, namespace=DRONE_NAMESPACE)
        self.sio.on("abortWorkOrder", self.on_abort, namespace=DRONE_NAMESPACE)

    async def connect(self, url: str) -> None:
        await self.sio.connect(
            url,
            namespaces=[DRONE_NAMESPACE],
            transports=["websocket"],
            auth=drone_hello("stubborn-1", concurrency=5),
        )

    async def on_work_order(self, order: dict[str, Any]) -> dict[str, Any]:
        self.orders.append(order)
        return {"ok": True}

    async def on_abort(self, request: dict[str, Any]) -> tuple[bool, str]:
        return True, ABORT_SIGNALED

    async def call(self, event: str, data: Any) -> Any:
        return await self.sio.call(event, data, namespace=DRONE_NAMESPACE, timeout=5)

    async def close(self) -> None:
        await self.sio.disconnect()


async def _store_orphan(store: PostgresTurnStore, turn: TurnRecord) -> None:
    from hangar.server.store import SessionRecord

    await store.create_session(SessionRecord(turn.session_id, turn.owner, "orphan"))
    await store.create_turn(turn)


async def _ended(store: PostgresTurnStore, turn_id: str) -> TurnRecord | None:
    turn = await store.get_turn(turn_id, messages=False)
    return turn if turn is not None and turn.status in TERMINAL_STATUSES else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_a_login_on_one_relay_works_on_another(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    store: PostgresTurnStore,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    await Accounts(store).add_user("ada", "correct horse battery staple")
    # unsafe: keep cookies of an IP address host (127.0.0.1) as a browser does
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        form = {"username": "ada", "password": "correct horse battery staple"}
        async with http.post(a.url + "/login", data=form, allow_redirects=False) as answer:
            assert answer.status == 303
            login = answer.cookies[LOGIN_COOKIE].value
    openai_peer.script(SLOW)
    drone_process(Upstream("openai", openai_peer), server=a.url)
    on_b = await Browser(b.url, login=login).connect()
    on_a: Browser | None = None
    try:
        await drones_seen_from(on_b)
        ack = await on_b.submit("Started through relay B")
        await on_b.wait_text(ack["turnId"], pieces=2, timeout=10)

        on_a = await Browser(a.url, login=login).connect()
        listed = (await on_a.call("listSessions", {}))["sessions"]
        assert [(s["sessionId"], s["processingTurnId"]) for s in listed] == [
            (ack["sessionId"], ack["turnId"])
        ]
        assert await on_a.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
        assert await on_b.completion(ack["turnId"], timeout=10) == (ack["turnId"], True, "aborted")
    finally:
        await on_b.close()
        if on_a is not None:
            await on_a.close()


async def test_two_hundred_orders_at_once_on_four_drones_over_two_relays_run_once_each(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    openai_peer.default = Reply(chunks=[f"q{i} " for i in range(8)], delay=0.02)
    for index, relay in enumerate((a, b, a, b)):
        drone_process(
            Upstream("openai", openai_peer), server=relay.url, name=f"d{index}", concurrency=10
        )
    browsers: list[Browser] = [await open_browser((a, b)[i % 2].url) for i in range(20)]
    await drones_seen_from(browsers[0], count=4)

    acks = await asyncio.gather(
        *(browser.submit(f"order {i}-{n}") for i, browser in enumerate(browsers) for n in range(10))
    )
    assert all(ack["ok"] for ack in acks), acks
    owners = {ack["turnId"]: browsers[i // 10] for i, ack in enumerate(acks)}
    for turn_id, browser in owners.items():
        assert (await browser.completion(turn_id, timeout=60))[1] is True

    for turn_id, browser in owners.items():
        assert len(browser.completions(turn_id)) == 1, turn_id
    prompts = [r.messages[-1]["content"] for r in openai_peer.requests]
    assert len(prompts) == len(set(prompts)) == 200, "every order ran exactly once"
    turns = [await stored(store, turn_id) for turn_id in owners]
    assert {t.status for t in turns} == {"finished"}
    for drone in {t.drone_id for t in turns}:
        spans = [(t.started_at or 0, t.ended_at or 0) for t in turns if t.drone_id == drone]
        most = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
        assert most <= 10, f"{drone} ran {most} at once with 10 slots"
    assert len({t.drone_id for t in turns}) == 4


async def test_simultaneous_orders_fill_every_free_slot_across_relays(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    openai_peer.default = SLOW
    drone_process(Upstream("openai", openai_peer), server=a.url, name="left", concurrency=4)
    drone_process(Upstream("openai", openai_peer), server=b.url, name="right", concurrency=4)
    browsers: list[Browser] = [await open_browser((a, b)[i % 2].url) for i in range(8)]
    await drones_seen_from(browsers[0], count=2)

    acks = await asyncio.gather(*(browser.submit("All at once") for browser in browsers))

    async def started() -> list[TurnRecord] | None:
        turns = [await stored(store, ack["turnId"]) for ack in acks]
        return turns if all(t.status == "processing" for t in turns) else None

    # Each submit is acknowledged once stored; the claims follow at once, in the background.
    turns: list[TurnRecord] = await eventually(started, timeout=5, what="all eight to start")
    per_drone = sorted(
        sum(1 for t in turns if t.drone_id == drone) for drone in {t.drone_id for t in turns}
    )
    assert per_drone == [4, 4]
    for browser, ack in zip(browsers, acks, strict=True):
        assert await browser.abort(ack["turnId"]) == (True, ABORT_SIGNALED)


async def test_a_queued_order_survives_a_relay_restart_and_runs(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    store: PostgresTurnStore,
) -> None:
    port = _free_port()
    relay = await relay_processes(port=port, redis=False)
    browser: Browser = await open_browser(relay.url, "patient")
    ack = await browser.submit("Whenever a drone comes")
    assert (await stored(store, ack["turnId"])).status == "queued"

    relay.kill()
    await relay.process.wait()
    relay = await relay_processes(port=port, redis=False)
    drone_process(Upstream("openai", openai_peer), server=relay.url)

    finished = await eventually(
        lambda: _ended(store, ack["turnId"]), timeout=20, what="the queued order to run"
    )
    assert (finished.status, finished.result) == ("finished", "Hello world")


async def test_two_deployments_on_one_redis_do_not_hear_each_other(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    open_browser: Start,
    redis_url: str,
    tmp_path: Path,
) -> None:
    import redis.asyncio as aioredis

    ours = await relay_processes()
    drone_process(Upstream("openai", openai_peer), server=ours.url, name="ours")
    await drones_seen_from(await open_browser(ours.url))
    theirs_db = str(tmp_path / "theirs.db")
    theirs = await relay_processes(database=theirs_db)
    stranger = await Browser(theirs.url, await theirs_token(theirs_db)).connect()
    try:
        assert (await stranger.call("listDrones", {}))["drones"] == []
        ack = await stranger.submit("Whose drone is this?")
        place = await eventually(
            lambda: [a for e, a in stranger.events if e == "turnQueued"], what="its place"
        )
        assert place[-1]["position"] == 1  # it waits: the other deployment's drone is not its
    finally:
        await stranger.close()
    client = aioredis.Redis.from_url(redis_url)
    try:
        channels = {RelayConfig(database=db).deployment() for db in (theirs_db, ours.database)}
        assert len(channels) == 2
        for channel in channels:
            assert int((await client.pubsub_numsub(channel))[0][1]) == 1
    finally:
        await client.aclose()
    assert ack["ok"] is True


async def test_relays_that_do_not_hear_each_other_are_refused_on_one_postgres_database(
    relay_processes: Start, postgres_url: str, redis_url: str
) -> None:
    """A relay without Redis, or on another Redis channel, beside a deployment's relays would
    take their running turns for orphans and end them (docs/architecture.md, "Storage and
    several relays"): it is refused, as a second relay on one SQLite file is."""
    serve = ("serve", "--port", "0", "--database", postgres_url, "--drone-token", DRONE_TOKEN)
    first = await relay_processes()

    alone = await hangar(*serve)
    elsewhere = await hangar(*serve, "--redis", redis_url, "--redis-prefix", "another-one")
    server, number = redis_url.rsplit("/", 1)
    other_number = await hangar(*serve, "--redis", f"{server}/{(int(number) + 1) % 16}")
    same = await relay_processes()  # the same deployment is welcome

    assert alone == (
        1,
        "",
        "hangar serve: cannot open the database: other relays use this PostgreSQL database: "
        "relays that share a database share a Redis (--redis); one relay alone uses SQLite or "
        "a database of its own.\n",
    )
    assert elsewhere[0] == 1 and "they would end each other's turns" in elsewhere[2]
    assert other_number[0] == 1 and "they would end each other's turns" in other_number[2]
    for relay in (first, same):
        relay.kill()
        await relay.process.wait()
    # Once they are gone, one relay without Redis may have the database, and only one.
    await relay_processes(redis=False)
    assert (await hangar(*serve))[0] == 1
    assert (await hangar(*serve, "--redis", redis_url))[0] == 1
