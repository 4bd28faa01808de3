"""The relay's work and memory follow what changes, not what exists: a browser that stops
reading costs a bounded amount and is told to resync, a running turn's text is a few strings,
and the sweep over ten thousand running turns takes milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from bench.stalled_browser import StalledBrowser, TextDrone
from hangar.server.accounts import Accounts
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.live_state import LiveState, LocalLiveState
from hangar.server.redis_state import RedisLiveState
from hangar.server.relay import Relay
from hangar.server.sqlite_store import SqliteTurnStore
from tests.browser.hand_drone import HandDrone
from tests.conftest import DRONE_TOKEN, HANGAR, ROOT, Browser, People, eventually, need

STALLED_GROWTH_MIB = 12
"""What a browser that stops reading may cost the relay at most (its queue is bounded by
2 MB of events; the rest is allocator slack). Without the bound it grew by the whole stream."""
STREAMED_MB = 60
SWEEP_BOUND_MS = 40.0
"""A sweep with 10,000 turns running on a present drone (it took 110 ms in memory and about a
second with Redis when it looked at every turn)."""
RUNNING = 10_000


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert found is not None
    return int(found.group(1)) / 1024


async def person_token(database: Path, name: str) -> str:
    store = SqliteTurnStore(database)
    await store.open()
    try:
        accounts = Accounts(store)
        await accounts.add_user(name, None)
        return await accounts.create_api_token(name, "tests")
    finally:
        await store.close()


@pytest.fixture
async def relay_process(tmp_path: Path) -> AsyncIterator[tuple[str, int, str]]:
    """A ``hangar serve`` subprocess on SQLite (its RSS is its own) and a person's token. The
    ping is long, so a browser that stops reading is not dropped for its missing pongs."""
    database = tmp_path / "relay.db"
    token = await person_token(database, "reader")
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *HANGAR, "serve", "--port", "0", "--database", str(database),
            "--drone-token", DRONE_TOKEN, "--drone-grace", "120",
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def listening() -> str | None:
            found = re.search(r"listening on (http://\S+)/", log.read_text())
            assert process.returncode is None, log.read_text()
            return found.group(1) if found else None

        url = await eventually(listening, timeout=20, what="the relay to listen")
        yield url, process.pid, token
    finally:
        process.kill()
        await process.wait()


async def test_a_browser_that_stops_reading_costs_the_relay_a_bounded_memory_and_resyncs(
    relay_process: tuple[str, int, str],
) -> None:
    url, pid, token = relay_process
    drone = await TextDrone(url, DRONE_TOKEN).connect()
    reader = await Browser(url, token).connect()
    stalled = await StalledBrowser(url, token).connect()
    try:
        ack = await reader.submit("Stream a long answer")
        turn_id = await asyncio.wait_for(drone.orders.get(), 10)
        await drone.text(turn_id, "The answer so far. ")
        opened = await stalled.call("openSession", {"sessionId": ack["sessionId"]})
        assert opened["turns"][-1]["text"] == "The answer so far. "
        base = peak = rss_mib(pid)
        # From here on the stalled browser reads nothing; a sub-agent's text streams to the
        # session (the relay forwards it and keeps none of it), a megabyte every ten events.
        piece = "y" * 100_000
        for sent in range(STREAMED_MB * 10):
            await drone.text(turn_id, piece, depth=1)
            if sent % 20 == 0:
                peak = max(peak, rss_mib(pid))
        await drone.text(turn_id, "And the rest.")
        peak = max(peak, rss_mib(pid))

        # The browser that reads got everything, in order, and was never told to resync.
        await eventually(lambda: len(reader.progress(turn_id)) == STREAMED_MB * 10 + 2, 30)
        assert reader.text(turn_id) == "The answer so far. And the rest."
        assert not [event for event, _ in reader.events if event == "resync"]
        assert peak - base < STALLED_GROWTH_MIB, f"relay RSS {base:.1f} -> {peak:.1f} MiB"

        # Reading again, the stalled browser is told once to resync; its fresh snapshot has
        # the whole text, and the text that streams next lands after it.
        await stalled.read(lambda: stalled.received("resync"), 30)
        reopened = await stalled.call("openSession", {"sessionId": ack["sessionId"]})
        turn = reopened["turns"][-1]
        assert (turn["text"], turn["textSeq"]) == ("The answer so far. And the rest.", 2)
        await drone.text(turn_id, " More.")
        await stalled.read(
            lambda: any(p.get("seq") == 3 for p in stalled.received("workOrderProgress")), 10
        )
        assert len(stalled.received("resync")) == 1
    finally:
        await stalled.close()
        await reader.close()
        await drone.close()


FLOOD = 10_000


async def test_a_drone_flooding_text_reaches_a_reading_browser_whole_and_in_order(
    relay_process: tuple[str, int, str],
) -> None:
    """The relay reads a drone's frames in runs, as many as have arrived, and between runs
    lets its writers send: a browser that keeps reading gets every delta, in order, and is
    never told to resync (read without a pause, 10,000 deltas outran the browser's queue and
    it lost four fifths of them)."""
    url, _, token = relay_process
    drone = await TextDrone(url, DRONE_TOKEN).connect()
    reader = await Browser(url, token).connect()
    try:
        await reader.submit("Stream as fast as you can")
        turn_id = await asyncio.wait_for(drone.orders.get(), 10)
        for i in range(FLOOD):  # no waiting for the relay's answers
            delta = {"kind": "text", "turnId": turn_id, "text": f"{i} ", "depth": 0}
            await drone.client.emit("workOrderProgress", delta, namespace="/drone")
            if i % 64 == 63:
                await asyncio.sleep(0)  # the client's writer sends what is queued
        await drone.client.emit("workOrderComplete", (turn_id, True, "done"), namespace="/drone")

        assert await reader.completion(turn_id, timeout=60) == (turn_id, True, "done")
        assert reader.text(turn_id) == "".join(f"{i} " for i in range(FLOOD))
        assert [p["seq"] for p in reader.progress(turn_id)] == list(range(1, FLOOD + 1))
        assert not [event for event, _ in reader.events if event == "resync"]
    finally:
        await reader.close()
        await drone.close()


# ---- the live text


@asynccontextmanager
async def redis_for(wanted: bool) -> AsyncIterator[str | None]:
    """The test Redis database, emptied before and after (None when not ``wanted``)."""
    if not wanted:
        yield None
        return
    url = os.environ.get("HANGAR_TEST_REDIS", "redis://127.0.0.1:6379/15")
    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
    except (OSError, aioredis.RedisError) as error:
        await client.aclose()
        need("Redis", f"{url}: {error}")
    await client.flushdb()
    try:
        yield url
    finally:
        await client.flushdb()
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def live_state(request: pytest.FixtureRequest) -> AsyncIterator[LiveState]:
    async with redis_for(request.param == "redis") as url:
        state: LiveState = RedisLiveState(url, "hangar-test") if url else LocalLiveState()
        await state.start()
        try:
            yield state
        finally:
            await state.close()


async def test_a_turns_kept_sub_agent_output_has_one_bound_and_goes_when_the_turn_ends(
    live_state: LiveState,
) -> None:
    """The bound is the live state's (with Redis, every relay's), not a drone connection's: a
    drone that reconnects, here or to another relay, does not start it again."""
    event = {"kind": "text", "text": "x" * 40, "depth": 1}
    kept = [await live_state.keep_sub_agent("t_subs", event, 40, 100) for _ in range(3)]
    assert kept == [1, 2, None]
    assert await live_state.keep_sub_agent("t_subs", event, 1, 100) is None  # none after it
    assert await live_state.sub_agent_events("t_subs") == [event, event]
    await live_state.forget_turn("t_subs")
    assert await live_state.sub_agent_events("t_subs") == []


async def test_a_snapshot_mid_stream_and_the_later_deltas_rebuild_the_text_exactly(
    live_state: LiveState,
) -> None:
    deltas = [f"word {i} «ünï» 🚀 " for i in range(3000)]
    seqs = [await live_state.append_text("t_live", delta) for delta in deltas[:1200]]
    snapshot, count = await live_state.text("t_live")
    seqs += [await live_state.append_text("t_live", delta) for delta in deltas[1200:]]
    assert seqs == list(range(1, 3001))
    later = "".join(d for d, seq in zip(deltas, seqs, strict=True) if seq > count)
    assert (snapshot + later, count) == ("".join(deltas), 1200)
    assert await live_state.text("t_live") == ("".join(deltas), 3000)
    await live_state.forget_turn("t_live")
    assert await live_state.text("t_live") == ("", 0)


async def test_a_long_answer_is_kept_as_a_few_strings_not_one_per_delta() -> None:
    live = LocalLiveState()
    for i in range(100_000):
        await live.append_text("t_long", "x" * (1 + i % 7))
    assert len(live.texts["t_long"].pieces) <= 20
    text, count = await live.text("t_long")
    assert (len(text), count) == (sum(1 + i % 7 for i in range(100_000)), 100_000)


# ---- the sweep


@pytest.fixture(params=["memory", "redis"])
async def loaded_relay(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, Relay, People]]:
    """An in-process relay (live state in memory or in Redis) with ``RUNNING`` turns
    processing on the drone ``hand-1``."""
    async with redis_for(request.param == "redis") as redis:
        config = RelayConfig(
            port=0,
            database=str(tmp_path / "hangar.db"),
            drone_token=DRONE_TOKEN,
            drone_grace=0.5,
            redis=redis,
        )
        runner, port = await start_relay(config)
        relay = runner.app[RELAY]
        try:
            yield f"http://127.0.0.1:{port}", relay, People(relay.accounts)
        finally:
            await runner.cleanup()


LOAD_SESSIONS = """
    WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
    INSERT INTO sessions (session_id, owner, title, created_at, last_activity)
    SELECT 's_load_' || i, ?, 'load', ?, ? FROM n
"""
LOAD_TURNS = """
    WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
    INSERT INTO turns (turn_id, session_id, owner, prompt, status, drone_id, created_at,
        started_at)
    SELECT 't_load_' || i, 's_load_' || i, ?, 'load', 'processing', ?, ?, ? FROM n
"""


async def running_on(relay: Relay, drone_id: str) -> int:
    rows = await relay.store.fetch(
        "SELECT count(*) AS n FROM turns WHERE status = 'processing' AND drone_id = ?", drone_id
    )
    return int(rows[0]["n"])


async def test_a_sweep_with_ten_thousand_turns_running_takes_milliseconds(
    loaded_relay: tuple[str, Relay, People],
) -> None:
    url, relay, people = loaded_relay
    await people.token("heavy")
    heavy = await relay.accounts.user("heavy")
    assert heavy is not None
    async with HandDrone(url, "hand-1"):
        await eventually(lambda: "hand-1" in relay.directory.local, what="the drone")
        now = time.time()
        store = relay.store
        await store.execute(LOAD_SESSIONS, RUNNING, heavy.user_id, now, now)
        await store.execute(LOAD_TURNS, RUNNING, heavy.user_id, "hand-1", now, now)
        # One more turn, on a drone that is gone: the sweep ends it.
        await store.execute(
            "INSERT INTO sessions (session_id, owner, title, created_at, last_activity)"
            " VALUES ('s_gone', ?, 'gone', ?, ?)",
            heavy.user_id,
            now,
            now,
        )
        await store.execute(
            "INSERT INTO turns (turn_id, session_id, owner, prompt, status, drone_id,"
            " created_at, started_at) VALUES ('t_gone', 's_gone', ?, 'p', 'processing',"
            " 'gone-1', ?, ?)",
            heavy.user_id,
            now,
            now,
        )
        took = []
        for _ in range(5):
            start = time.perf_counter()
            await relay.reaper.sweep()
            took.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.2)

        async def gone_ended() -> bool:
            turn = await store.get_turn("t_gone", messages=False)
            return turn is not None and turn.reason == "drone_lost"

        await eventually(gone_ended, timeout=5, what="the gone drone's turn to end")
        assert await running_on(relay, "hand-1") == RUNNING
        assert sorted(took)[2] < SWEEP_BOUND_MS, f"sweeps took {took} ms"


async def test_a_turn_another_relay_ended_is_refused_and_aborted_on_the_drones_relay(
    postgres_url: str, redis_url: str
) -> None:
    """The drone's relay hears of the ending from the live state (not from a scan of every
    running turn): the drone's next text is refused and the drone is told to abort."""
    config = RelayConfig(
        port=0,
        database=postgres_url,
        redis=redis_url,
        drone_token=DRONE_TOKEN,
        drone_grace=0.5,
        abort_answer=0.5,
    )
    runners = [await start_relay(config) for _ in range(2)]
    (here, here_port), (_, there_port) = runners
    relay: Relay = here.app[RELAY]
    people = People(relay.accounts)
    token = await people.token("alice")
    try:
        async with HandDrone(f"http://127.0.0.1:{here_port}", "hand-1") as drone:
            drone.answer_aborts.clear()  # frozen: the other relay's abort goes unanswered
            near = await Browser(f"http://127.0.0.1:{here_port}", token).connect()
            far = await Browser(f"http://127.0.0.1:{there_port}", token).connect()
            turn_id = (await near.submit("Keep going"))["turnId"]
            assert await drone.next_order() == turn_id
            await drone.text(turn_id, "Streaming")
            assert turn_id in relay.turns.live
            assert await far.abort(turn_id) == (True, "Abort signaled")
            assert (await near.ending(turn_id))["reason"] == "unanswered"
            await eventually(lambda: turn_id not in relay.turns.live, what="the relay to hear")
            drone.answer_aborts.set()
            payload = {"kind": "text", "turnId": turn_id, "text": " more", "depth": 0}
            ack = await drone.client.call("workOrderProgress", payload, namespace="/drone")
            assert ack == {"ok": False, "error": "The turn has already ended."}
            await eventually(lambda: len(drone.aborts) == 2, what="the drone told to abort")
            assert " more" not in near.text(turn_id)
            await near.close()
            await far.close()
    finally:
        for runner, _ in runners:
            await runner.cleanup()


@pytest.mark.parametrize("with_redis", [False, True], ids=["memory", "redis"])
async def test_a_relay_that_stops_leaves_nothing_running(tmp_path: Path, with_redis: bool) -> None:
    """Stopped, a relay ends every task it started (engine.io's watch over the connections,
    the listener on the Redis channel): none lingers to run on after it, or to hold up the
    loop's end (a lost cancel once kept engine.io's watch going forever)."""
    before = asyncio.all_tasks()

    def lingering() -> list[asyncio.Task[Any]]:
        return [task for task in asyncio.all_tasks() - before if not task.done()]

    async with redis_for(with_redis) as redis:
        database = str(tmp_path / "hangar.db")
        config = RelayConfig(
            port=0, database=database, drone_token=DRONE_TOKEN, redis=redis, ping=(0.5, 1.0)
        )
        runner, port = await start_relay(config)
        relay = runner.app[RELAY]
        async with HandDrone(f"http://127.0.0.1:{port}", "hand-1"):
            await eventually(lambda: "hand-1" in relay.directory.local, what="the drone")
        await runner.cleanup()
    # engine.io's ping timer of a closed connection ends by itself within a ping interval.
    with contextlib.suppress(AssertionError):
        await eventually(lambda: not lingering(), timeout=3, what="the relay's tasks to end")
    assert lingering() == [], [task.get_coro() for task in lingering()]


async def test_browsers_that_come_and_go_leave_no_timers_behind(tmp_path: Path) -> None:
    """Each connection by a login holds a timer (it is logged out when the login expires),
    cancelled as it closes: a relay that sees thousands of page loads keeps none of them."""
    config = RelayConfig(port=0, database=str(tmp_path / "hangar.db"))
    runner, port = await start_relay(config)
    relay: Relay = runner.app[RELAY]
    try:
        user = await relay.accounts.add_user("ada", "a long password")
        login = await relay.accounts.log_in(user)
        for _ in range(150):
            browser = await Browser(f"http://127.0.0.1:{port}", login=login).connect()
            await browser.close()
        await eventually(lambda: relay.metrics.browsers._value.get() == 0, what="the last to go")

        assert len(relay.background._timers) < 100
    finally:
        await runner.cleanup()
