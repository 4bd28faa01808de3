"""Faults, for real: frozen and killed drones, relays that die or restart, Redis and PostgreSQL
that stall or crash. Whatever fails, every turn ends exactly once, within a stated bound, with
its text and a history the model service accepts. Redis and PostgreSQL servers that must die
are the test's own (``bench/services.py``); the machine's shared ones are never touched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import socketio
from aiohttp import web

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from bench.services import OwnPostgres, OwnRedis, free_port
from hangar.drone.worker import DroneConfig, run_drone
from hangar.server.accounts import Accounts
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import RelayStartError, start_relay
from hangar.server.connections import UNAVAILABLE
from hangar.server.drone_entries import PRESENCE_FLOOR
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.reaper import DRONE_LOST, SILENT_REJOIN
from hangar.server.redis_state import CALL_TIMEOUT, RedisLiveState
from hangar.server.redis_state import FAILURES as REDIS_FAILURES
from hangar.server.sqlite_store import SqliteTurnStore
from hangar.server.store import TurnRecord, TurnStore
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    CUT_OFF,
    DRONE_NAMESPACE,
    NO_ACTIVE_WORK_ORDER,
    RESYNC,
    TOOL_CANCELLED,
    TOOL_LOST,
)
from tests.bare_relay import BareRelay
from tests.browser.hand_drone import HandDrone
from tests.conftest import (
    DRONE_TOKEN,
    HANGAR,
    Browser,
    People,
    RelayHandle,
    Upstream,
    eventually,
    relay_folder,
)
from tests.test_access import refusal_of
from tests.test_drone_workers import alive, children_of

SLOW = Reply(chunks=[f"w{i} " for i in range(400)], delay=0.03)
Start = Callable[..., Any]


def reply_text(reply: Reply) -> str:
    return "".join(reply.chunks)


async def stored(store: TurnStore, turn_id: str) -> TurnRecord:
    turn = await store.get_turn(turn_id)
    assert turn is not None
    return turn


def roles(turn: TurnRecord) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in turn.messages]


async def a_next_turn_works(browser: Browser, session_id: str | None, peer: OpenAIPeer) -> None:
    """The session (or a new one) goes on: the model service accepts its history (the OpenAI
    peer refuses an assistant tool call without a result, as the real service does)."""
    peer.script(Reply(chunks=["still ", "here"]))
    ack = await browser.submit("And now?", **({"sessionId": session_id} if session_id else {}))
    assert ack["ok"], ack
    turn_id = ack["turnId"]

    async def ended() -> tuple[str, bool, str] | None:
        if found := browser.completions(turn_id):
            return found[0]
        # Its ending may have come through another relay before this one listened again after
        # Redis came back: told to resync, a page opens the session again (docs/reliability.md).
        if not any(event == "resync" for event, _ in browser.events):
            return None
        opened = await browser.call("openSession", {"sessionId": ack["sessionId"]})
        shown = [t for t in opened.get("turns", ()) if t["turnId"] == turn_id]
        return (turn_id, True, shown[0]["text"]) if shown[0]["status"] == "finished" else None

    assert await eventually(ended, 20, f"the end of {turn_id}") == (turn_id, True, "still here")
    assert not [r for r in peer.requests if r.rejected]


# ---- a frozen drone


async def test_an_abort_to_a_frozen_drone_lands_and_the_drone_drops_the_turn_when_it_wakes(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Start,
    browser: Browser,
) -> None:
    openai_peer.script(SLOW)
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    turn_id = (await browser.submit("Stream for a while"))["turnId"]
    await browser.wait_text(turn_id, pieces=3, timeout=10)

    drone.send_signal(signal.SIGSTOP)
    try:
        loop = asyncio.get_running_loop()
        asked = loop.time()
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
        assert await browser.completion(turn_id) == (turn_id, True, ABORTED)
        # Bound: the relay's wait for the drone's answer (2 s), and a margin for a busy machine.
        assert loop.time() - asked < relay.config.abort_answer + 1.5
        assert (await browser.ending(turn_id))["reason"] == "unanswered"
        turn = await stored(relay.relay.store, turn_id)
        assert turn.status == "aborted" and turn.text == browser.text(turn_id)
        assert roles(turn) == [("user", "Stream for a while"), ("assistant", turn.text)]
        await eventually(lambda: not relay.relay.directory.local, what="the drone dropped")
    finally:
        drone.send_signal(signal.SIGCONT)

    # Awake again, the drone finds its connection cut (the relay does not wait for a frozen
    # peer's answer to its close), reconnects, hears of the abort and closes the model's stream.
    await eventually(lambda: openai_peer.requests[0].disconnected, timeout=3, what="upstream")
    assert not openai_peer.requests[0].completed
    # Its slot is free: the next order runs on it and finishes.
    openai_peer.script(Reply(chunks=["next ", "one"]))
    ack = await browser.submit("Next", sessionId=turn.session_id)
    assert await browser.completion(ack["turnId"], timeout=20) == (ack["turnId"], True, "next one")
    assert not [r for r in openai_peer.requests if r.rejected]


async def test_a_frozen_drone_is_noticed_within_the_grace_and_its_turn_ends(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Start,
    browser: Browser,
) -> None:
    openai_peer.script(SLOW)
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    turn_id = (await browser.submit("Stream for a while"))["turnId"]
    await browser.wait_text(turn_id, pieces=3, timeout=10)

    drone.send_signal(signal.SIGSTOP)
    try:
        loop = asyncio.get_running_loop()
        frozen = loop.time()
        assert await browser.completion(turn_id, timeout=10) == (
            turn_id,
            False,
            "The drone disconnected.",
        )
        # Noticed within engine.io's ping (0.5 s + 1 s at the tests' 0.5 s grace), then the
        # grace to come back; a margin for a busy machine.
        assert loop.time() - frozen < 1.5 + relay.config.drone_grace + 1.5
    finally:
        drone.send_signal(signal.SIGCONT)
    await eventually(lambda: openai_peer.requests[0].disconnected, timeout=10, what="upstream")
    turn = await stored(relay.relay.store, turn_id)
    assert turn.status == "error" and turn.text == browser.text(turn_id)


# ---- drones that die mid-tool


async def test_a_drone_killed_mid_tool_leaves_a_history_the_model_accepts(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Start,
    browser: Browser,
) -> None:
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": "sleep 30"})])
    )
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    turn_id = (await browser.submit("Run something long"))["turnId"]
    await eventually(lambda: browser.progress(turn_id, "tool"), timeout=10, what="the tool")

    drone.send_signal(signal.SIGKILL)
    _, success, message = await browser.completion(turn_id, timeout=10)

    assert (success, message) == (False, "The drone disconnected.")
    turn = await stored(relay.relay.store, turn_id)
    assert [m.role for m in turn.messages] == ["user", "assistant", "tool"]
    assert turn.messages[2].content == TOOL_LOST
    assert turn.messages[2].tool_call_id == turn.messages[1].tool_calls[0].id  # type: ignore[index]
    drone_process(Upstream("openai", openai_peer), server=relay.url, name="second")
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="a second drone")
    await a_next_turn_works(browser, turn.session_id, openai_peer)


async def test_an_abort_while_the_drone_is_away_mid_tool_cancels_the_tool_call(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Start,
    browser: Browser,
) -> None:
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": "sleep 30"})])
    )
    drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    turn_id = (await browser.submit("Run something long"))["turnId"]
    await eventually(lambda: browser.progress(turn_id, "tool"), timeout=10, what="the tool")

    drone.send_signal(signal.SIGSTOP)
    try:
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
        assert await browser.completion(turn_id) == (turn_id, True, ABORTED)
    finally:
        drone.send_signal(signal.SIGKILL)
    turn = await stored(relay.relay.store, turn_id)
    assert [m.role for m in turn.messages] == ["user", "assistant", "tool"]
    assert turn.messages[2].content == TOOL_CANCELLED
    drone_process(Upstream("openai", openai_peer), server=relay.url, name="second")
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="a second drone")
    await a_next_turn_works(browser, turn.session_id, openai_peer)


async def test_a_turn_its_drone_says_it_no_longer_runs_ends_when_aborted(
    relay: RelayHandle, browser: Browser
) -> None:
    """A hand-driven drone takes an order, then, asked to abort, says it runs no such turn: as a
    drone whose completion of the turn was lost. The turn does not stay processing."""
    forgetful = HandDrone(relay.url, "forgetful", abort_answer=(False, NO_ACTIVE_WORK_ORDER))
    async with forgetful:
        turn_id = (await browser.submit("Lose my ending"))["turnId"]
        assert await forgetful.next_order() == turn_id

        assert await browser.abort(turn_id) == (False, NO_ACTIVE_WORK_ORDER)

        within = relay.config.abort_grace + 2.0  # the abort watchdog, and a margin
        assert await browser.completion(turn_id, timeout=within) == (turn_id, True, ABORTED)
        turn = await stored(relay.relay.store, turn_id)
        assert (turn.status, turn.reason) == ("aborted", "unanswered")


async def test_an_abort_while_the_drone_is_away_is_acked_before_the_turn_ends(
    relay: RelayHandle, browser: Browser
) -> None:
    """A hand-driven drone takes an order and drops its connection: within its grace it may
    come back, and an abort meanwhile is honoured by the relay. The ack still comes first."""
    async with HandDrone(relay.url, "away") as drone:
        turn_id = (await browser.submit("Wait for me"))["turnId"]
        assert await drone.next_order() == turn_id
    await eventually(
        lambda: not relay.relay.directory.local, timeout=5, what="the relay to see it gone"
    )

    assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)

    assert await browser.completion(turn_id) == (turn_id, True, ABORTED)
    assert browser.order_of(turn_id) == ["abortAck", "workOrderComplete"]
    turn = await stored(relay.relay.store, turn_id)
    assert (turn.status, turn.reason) == ("aborted", "unanswered")


@pytest.mark.parametrize(
    ("result", "answer"),
    [("Done.", (False, NO_ACTIVE_WORK_ORDER)), (ABORTED, (True, ABORT_SIGNALED))],
    ids=["finished", "aborted"],
)
async def test_an_abort_the_drone_leaves_unanswered_is_answered_as_the_turn_ended(
    relay: RelayHandle, browser: Browser, result: str, answer: tuple[bool, str]
) -> None:
    """A hand-driven drone, asked to abort, ends the turn (finished, or aborted as told) and
    never answers: the relay, honouring the abort itself once the answer is overdue, finds the
    turn ended. "Abort signaled" only if it ended aborted, never for a turn shown finished."""
    reason = "finished" if result == "Done." else "aborted"
    said = {
        "role": "assistant",
        "content": "Done.",
        **({"aborted": True} if reason != "finished" else {}),
    }
    async with HandDrone(relay.url, "finisher") as drone:
        drone.answer_aborts.clear()  # its answer is lost
        turn_id = (await browser.submit("Finish it"))["turnId"]
        assert await drone.next_order() == turn_id
        abort = asyncio.ensure_future(browser.abort(turn_id, timeout=relay.config.abort_answer + 5))
        await asyncio.wait_for(drone.abort_asked.wait(), 5)
        ending = {"reason": reason, "messages": [{"number": 0, "message": said}]}
        await drone.complete(turn_id, True, result, ending)

        assert await abort == answer

    assert await browser.completion(turn_id) == (turn_id, True, result)
    turn = await stored(relay.relay.store, turn_id)
    assert (turn.status, turn.reason) == (reason, reason)
    assert roles(turn) == [("user", "Finish it"), ("assistant", "Done.")]


async def test_a_work_order_whose_drone_dies_before_accepting_it_runs_on_another(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Start,
    browser: Browser,
) -> None:
    """A drone killed while its work order is on the way never had it: the turn goes back in
    line and runs on the next drone, instead of ending in error."""
    first = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    first.send_signal(signal.SIGSTOP)
    try:
        openai_peer.script(Reply(chunks=["on ", "the second"]))
        turn_id = (await browser.submit("Hello"))["turnId"]

        async def claimed() -> bool:
            return (await stored(relay.relay.store, turn_id)).status == "processing"

        await eventually(claimed, timeout=10, what="the turn given to the frozen drone")
    finally:
        first.send_signal(signal.SIGKILL)
    drone_process(Upstream("openai", openai_peer), server=relay.url, name="second")
    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "on the second")
    assert len(openai_peer.requests) == 1


# ---- relays that stop, die and restart


@pytest.fixture
async def sqlite_relay(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``hangar serve`` on SQLite, as a subprocess on a fixed port, to stop and start again."""
    port = free_port()
    database = relay_folder(tmp_path) / "hangar.db"
    started: list[asyncio.subprocess.Process] = []

    async def start(grace: float = 2.0) -> tuple[str, asyncio.subprocess.Process, Path]:
        log = tmp_path / f"relay-{len(started)}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *HANGAR, "serve", "--port", str(port), "--database", str(database),
                "--drone-token", DRONE_TOKEN, "--drone-grace", str(grace),
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        started.append(process)
        await eventually(lambda: b"listening on" in log.read_bytes(), 20, "the relay to listen")
        return f"http://127.0.0.1:{port}", process, log

    yield start
    for process in started:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def person_token(database: Path) -> str:
    store = SqliteTurnStore(database)
    await store.open()
    try:
        return await People(Accounts(store)).token("ada")
    finally:
        await store.close()


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
async def test_a_relay_restart_mid_turn_loses_no_text(
    sqlite_relay: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    tmp_path: Path,
    how: signal.Signals,
) -> None:
    reply = Reply(chunks=[f"t{i} " for i in range(150)], delay=0.03)
    openai_peer.script(reply)
    url, process, _ = await sqlite_relay()
    drone_process(Upstream("openai", openai_peer), server=url)
    token = await person_token(relay_folder(tmp_path) / "hangar.db")
    browser = await Browser(url, token).connect()
    await eventually(lambda: listed_drones(browser), timeout=15, what="the drone to be listed")
    turn_id = (await browser.submit("Say a lot"))["turnId"]
    await browser.wait_text(turn_id, pieces=5, timeout=10)

    process.send_signal(how)
    await asyncio.wait_for(process.wait(), 10)
    await browser.close()
    url, _, _ = await sqlite_relay()
    again = await Browser(url, token).connect()
    try:
        await eventually(
            lambda: _ended_turn(relay_folder(tmp_path) / "hangar.db", turn_id),
            timeout=20,
            what="the end",
        )
        turn = await _ended_turn(relay_folder(tmp_path) / "hangar.db", turn_id)
        assert turn is not None and turn.status == "finished"
        assert turn.text == reply_text(reply)
        assert roles(turn) == [("user", "Say a lot"), ("assistant", reply_text(reply))]
        await a_next_turn_works(again, turn.session_id, openai_peer)
    finally:
        await again.close()


async def test_an_abort_after_a_relay_restart_before_the_drone_is_back_keeps_the_text(
    sqlite_relay: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    tmp_path: Path,
) -> None:
    """The restarted relay had none of the text that streamed (it was in its memory), and
    ended the turn with none of it; the drone, back, sent the text again and was refused. What
    the person saw is kept, as README says of an abort."""
    openai_peer.script(SLOW)
    url, process, _ = await sqlite_relay()
    drone = drone_process(Upstream("openai", openai_peer), server=url)
    database = relay_folder(tmp_path) / "hangar.db"
    browser = await Browser(url, await person_token(database)).connect()
    await eventually(lambda: listed_drones(browser), timeout=15, what="the drone to be listed")
    turn_id = (await browser.submit("Say a lot"))["turnId"]
    await browser.wait_text(turn_id, pieces=5, timeout=10)
    seen = browser.text(turn_id)
    await browser.close()

    drone.send_signal(signal.SIGSTOP)  # it is away while the relay restarts and the abort comes
    try:
        process.kill()
        await asyncio.wait_for(process.wait(), 10)
        url, _, _ = await sqlite_relay()
        again = await Browser(url, await person_token(database)).connect()
        assert await again.abort(turn_id) == (True, ABORT_SIGNALED)
    finally:
        drone.send_signal(signal.SIGCONT)
    try:

        async def text_kept() -> TurnRecord | None:
            turn = await _ended_turn(database, turn_id)
            return turn if turn is not None and turn.text.startswith(seen) else None

        turn = await eventually(text_kept, timeout=15, what="the text seen, stored")
        assert turn.status == "aborted" and reply_text(SLOW).startswith(turn.text)
        assert roles(turn) == [("user", "Say a lot"), ("assistant", turn.text)]
        await a_next_turn_works(again, turn.session_id, openai_peer)
    finally:
        await again.close()


def _written(database: Path, turn_id: str) -> list[str]:
    """The running turn's text as its relay has written it to its database so far, by write."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute(
            "SELECT piece FROM turn_pieces WHERE turn_id = ? ORDER BY at", (turn_id,)
        ).fetchall()
    return [row[0] for row in rows]


async def test_a_relay_killed_with_its_drone_keeps_the_text_its_pages_showed(
    sqlite_relay: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    tmp_path: Path,
) -> None:
    """docs/reliability.md, "a relay that dies": a relay without Redis writes a running turn's
    text to its database as it streams. It kept it in memory only: killed together with its
    drone (a machine down), the turn ended holding its prompt only, and a page opened on the
    restarted relay showed none of what had streamed."""
    openai_peer.script(SLOW)
    url, process, _ = await sqlite_relay(grace=0.5)
    drone = drone_process(Upstream("openai", openai_peer), server=url)
    database = relay_folder(tmp_path) / "hangar.db"
    token = await person_token(database)
    browser = await Browser(url, token).connect()
    await eventually(lambda: listed_drones(browser), timeout=15, what="the drone to be listed")
    ack = await browser.submit("Say a lot")
    turn_id, session_id = ack["turnId"], ack["sessionId"]
    await browser.wait_text(turn_id, pieces=5, timeout=10)
    seen = browser.text(turn_id)

    def written_twice() -> bool:  # each write adds what streamed since the one before
        pieces = _written(database, turn_id)
        return len(pieces) >= 2 and "".join(pieces).startswith(seen)

    await eventually(written_twice, 5, "the text seen, written in two writes")
    assert reply_text(SLOW).startswith("".join(_written(database, turn_id)))
    await browser.close()

    drone.kill()
    process.kill()
    await asyncio.wait_for(process.wait(), 10)
    await asyncio.get_running_loop().run_in_executor(None, drone.wait)
    url, _, _ = await sqlite_relay(grace=0.5)
    again = await Browser(url, token).connect()
    try:
        opened = await again.call("openSession", {"sessionId": session_id})
        [shown] = opened["turns"]
        assert shown["status"] == "processing" and shown["text"].startswith(seen)

        turn = await eventually(
            lambda: _ended_turn(database, turn_id), timeout=20, what="the turn to end"
        )
        assert (turn.status, turn.reason) == ("error", "relay_restarted")
        assert turn.text.startswith(seen) and reply_text(SLOW).startswith(turn.text)
        assert roles(turn) == [("user", "Say a lot"), ("assistant", turn.text)]
        assert _written(database, turn_id) == []  # stored once: in the turn's messages
        drone_process(Upstream("openai", openai_peer), server=url, name="proc-drone-2")
        await eventually(lambda: listed_drones(again), timeout=15, what="another drone")
        await a_next_turn_works(again, session_id, openai_peer)
    finally:
        await again.close()


async def test_a_stopping_relay_leaves_the_turns_of_the_drones_it_drops_to_them(
    tmp_path: Path,
) -> None:
    """A relay that stops drops its drones so that they go on elsewhere, or here once it is
    back (docs/architecture.md). With a drone grace shorter than its second of stopping, it
    ended their turns "drone lost" on its way out."""
    database = relay_folder(tmp_path) / "hangar.db"
    config = RelayConfig(port=0, database=str(database), drone_token=DRONE_TOKEN, drone_grace=0.1)
    runner, port = await start_relay(config)
    url = f"http://127.0.0.1:{port}"
    try:
        token = await People(runner.app[RELAY].accounts).token("ada")
        browser = await Browser(url, token).connect()
        async with HandDrone(url) as drone:
            turn_id = (await browser.submit("Go on"))["turnId"]
            assert await drone.next_order() == turn_id
            await browser.close()
            await runner.cleanup()  # the relay stops, with the drone connected
    finally:
        await runner.cleanup()

    store = SqliteTurnStore(database)
    await store.open()
    try:
        turn = await store.get_turn(turn_id, messages=False)
    finally:
        await store.close()
    assert turn is not None and turn.status == "processing"


@pytest.mark.parametrize("grace", [1.0, 2.0])
async def test_a_drone_comes_back_to_a_relay_stopped_and_started_again(
    sqlite_relay: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    tmp_path: Path,
    grace: float,
) -> None:
    """The relay's goodbye (engine.io's CLOSE) began the drone's disconnect; with a grace of
    1 s the drone's silence timer cut it short before its websocket closed, and the drone,
    waiting for that disconnect to finish, never connected again."""
    url, process, _ = await sqlite_relay(grace)
    drone_process(Upstream("openai", openai_peer), server=url)
    token = await person_token(relay_folder(tmp_path) / "hangar.db")
    browser = await Browser(url, token).connect()
    await eventually(lambda: listed_drones(browser), timeout=15, what="the drone to be listed")
    await browser.close()

    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.wait(), 10)
    await asyncio.sleep(3)  # the relay stays down a while: the fault itself
    url, _, _ = await sqlite_relay(grace)

    again = await Browser(url, token).connect()
    try:
        await eventually(lambda: listed_drones(again), timeout=15, what="the drone to come back")
        await a_next_turn_works(again, None, openai_peer)
    finally:
        await again.close()


async def listed_drones(browser: Browser) -> list[Any]:
    answer = await browser.call("listDrones", {})
    drones: list[Any] = answer["drones"]
    return drones


def _resyncs(browser: Browser, times: int) -> bool:
    """Whether ``browser`` was told to resync ``times`` times at least."""
    return len([event for event, _ in browser.events if event == RESYNC]) >= times


async def _ended_turn(database: Path, turn_id: str) -> TurnRecord | None:
    store = SqliteTurnStore(database)
    await store.open()
    try:
        turn = await store.get_turn(turn_id)
    finally:
        await store.close()
    return turn if turn is not None and turn.status != "processing" else None


async def test_a_failover_to_another_relay_leaves_no_hole_in_the_text(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    reply = Reply(chunks=[f"f{i} " for i in range(150)], delay=0.03)
    openai_peer.script(reply)
    drone_process(Upstream("openai", openai_peer), server=f"{a.url},{b.url}")
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(b.url, await People(Accounts(store)).token("ada")).connect()
    try:
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        turn_id = (await browser.submit("Say a lot"))["turnId"]
        await browser.wait_text(turn_id, pieces=5, timeout=10)

        a.kill()
        _, success, _ = await browser.completion(turn_id, timeout=30)

        assert success is True
        turn = await stored(store, turn_id)
        assert turn.status == "finished" and turn.text == reply_text(reply)
        assert roles(turn)[1:] == [("assistant", reply_text(reply))]
        assert browser.text(turn_id) == reply_text(reply)  # the page's copy has no hole either
    finally:
        await browser.close()
        await store.close()


async def test_a_drone_whose_only_relay_dies_is_noticed_within_the_grace_and_stops_streaming(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
) -> None:
    """The drone knows one relay; the person is on another. The dead relay's drones are gone for
    every relay once their entries are older than its grace (four seconds at least), and a
    drone out of touch with every relay for --cut-off aborts what it runs."""
    a = await relay_processes(drone_grace=3.0)
    b = await relay_processes(drone_grace=3.0)
    openai_peer.script(Reply(chunks=[f"w{i} " for i in range(2000)], delay=0.03))  # a minute
    drone_process(Upstream("openai", openai_peer), server=a.url, env={"HANGAR_CUT_OFF": "2"})
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(b.url, await People(Accounts(store)).token("ada")).connect()
    try:
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        turn_id = (await browser.submit("Say a lot"))["turnId"]
        await browser.wait_text(turn_id, pieces=3, timeout=10)
        loop = asyncio.get_running_loop()

        a.kill()
        killed = loop.time()

        assert await browser.completion(turn_id, timeout=15) == (turn_id, False, DRONE_LOST.result)
        # Bound: the entry's life (the grace, 4 s at least), a second to come back through
        # another relay, the sweep's second, and a margin for a busy machine; it was the entry's
        # fixed 10 s plus the grace.
        assert loop.time() - killed < PRESENCE_FLOOR + SILENT_REJOIN + 1.0 + 1.5
        assert (await stored(store, turn_id)).reason == "drone_lost"
        await openai_peer.wait_for_disconnect(timeout=2.0 + 3.0)  # --cut-off, and a margin
        assert not openai_peer.requests[0].completed
    finally:
        await browser.close()
        await store.close()


@pytest.mark.parametrize(
    "how", [signal.SIGINT, signal.SIGTERM, "twice"], ids=["ctrl-c", "sigterm", "ctrl-c-twice"]
)
async def test_a_relay_stops_in_under_two_seconds_with_tabs_and_drones_connected(
    sqlite_relay: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    tmp_path: Path,
    how: signal.Signals | str,
) -> None:
    openai_peer.script(SLOW)
    url, process, log = await sqlite_relay()
    drone_process(Upstream("openai", openai_peer), server=url)
    token = await person_token(relay_folder(tmp_path) / "hangar.db")
    browsers = [await Browser(url, token).connect() for _ in range(3)]
    await eventually(lambda: listed_drones(browsers[0]), timeout=15, what="the drone")
    turn_id = (await browsers[0].submit("Stream for a while"))["turnId"]
    await browsers[0].wait_text(turn_id, pieces=3, timeout=10)

    loop = asyncio.get_running_loop()
    asked = loop.time()
    process.send_signal(signal.SIGINT if how == "twice" else how)
    if how == "twice":  # a second Ctrl-C does not wait for the first to finish
        await eventually(lambda: "stopping" in log.read_text(), 5, "the stop to begin")
        process.send_signal(signal.SIGINT)
    await asyncio.wait_for(process.wait(), 10)

    assert loop.time() - asked < 2.0  # the bound is the behaviour
    lines = log.read_text().splitlines()
    assert not [line for line in lines if "Traceback" in line or " ERROR " in line], lines
    if how != "twice":
        assert process.returncode == 0
        assert any("stopping" in line for line in lines), lines
    for browser in browsers:
        await browser.close()


def work_folder(tmp_path: Path) -> Path:
    """The demo drone's work directory: apart from its relay's database."""
    folder = tmp_path / "work"
    folder.mkdir(exist_ok=True)
    return folder


async def start_demo(tmp_path: Path) -> tuple[asyncio.subprocess.Process, Path, str]:
    """``hangar demo`` on SQLite in ``tmp_path``, once it says where to open it; its log, URL."""
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *HANGAR, "demo", "--port", "0", "--database", str(relay_folder(tmp_path) / "demo.db"),
            "--workdir", str(work_folder(tmp_path)),
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    found = await eventually(
        lambda: re.search(r"open (http://\S+)/ in your browser", log.read_text()), 30, "the demo"
    )
    return process, log, found.group(1)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_the_demo_stops_in_under_two_seconds_with_a_tab_connected(
    tmp_path: Path, how: signal.Signals
) -> None:
    database = relay_folder(tmp_path) / "demo.db"
    process, log, url = await start_demo(tmp_path)
    try:
        browser = await Browser(url, await person_token(database)).connect()
        await eventually(lambda: listed_drones(browser), timeout=20, what="the demo's drone")
        ack = await browser.submit("Tell me about abort")  # the demo model streams slowly
        await browser.wait_text(ack["turnId"], pieces=2, timeout=10)
        loop = asyncio.get_running_loop()
        asked = loop.time()

        process.send_signal(how)
        await asyncio.wait_for(process.wait(), 10)

        assert loop.time() - asked < 2.0  # the bound is the behaviour
        assert process.returncode == 0
        lines = log.read_text().splitlines()
        assert not [line for line in lines if "Traceback" in line or " ERROR " in line], lines
        await browser.close()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_demo_killed_outright_takes_its_drone_with_it(tmp_path: Path) -> None:
    process, _, _ = await start_demo(tmp_path)
    try:
        (drone,) = children_of(process.pid)

        process.kill()
        await process.wait()

        await eventually(lambda: not alive(drone), 10, "the demo's drone to stop")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# ---- Redis and PostgreSQL that stall or crash


async def test_each_redis_call_fails_within_its_bound_and_a_restarted_redis_is_reached_at_once(
    own_redis: OwnRedis,
) -> None:
    """A Redis restarted since the last call (which closed the relay's connections) is reached
    on the next call, on a fresh connection, instead of that call failing; a stalled Redis
    still fails a call within ``CALL_TIMEOUT`` (a timeout is not tried again)."""
    state = RedisLiveState(own_redis.url, "hangar-bound-test")
    await state.start()
    key = state.key("probe")
    try:
        await state.redis.set(key, "before")
        own_redis.restart()
        assert await state.redis.get(key) is None  # empty, but reached at once

        own_redis.pause()
        started = time.monotonic()
        with pytest.raises(REDIS_FAILURES):
            await asyncio.wait_for(state.redis.get(key), 5 * CALL_TIMEOUT)
        assert time.monotonic() - started < CALL_TIMEOUT + 1.0
    finally:
        own_redis.resume()
        await state.close()


@pytest.mark.parametrize("fault", ["paused", "restarted-empty"])
async def test_a_redis_outage_keeps_drones_listed_and_turns_running(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
    own_redis: OwnRedis,
    fault: str,
) -> None:
    a = await relay_processes(redis=own_redis.url, drone_grace=2.0)
    b = await relay_processes(redis=own_redis.url, drone_grace=2.0)
    reply = Reply(chunks=[f"r{i} " for i in range(500)], delay=0.03)  # about 15 s
    openai_peer.script(reply)
    drone_process(Upstream("openai", openai_peer), server=a.url)
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(b.url, await People(Accounts(store)).token("ada")).connect()
    try:
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        turn_id = (await browser.submit("Outlast Redis"))["turnId"]
        await browser.wait_text(turn_id, pieces=3, timeout=10)

        if fault == "paused":
            own_redis.pause()
            await asyncio.sleep(11)  # the fault itself: longer than a drone entry lives
            own_redis.resume()
        else:
            own_redis.kill()
            await asyncio.sleep(6)  # the fault itself
            own_redis.start()

        # The drone is listed again within a heartbeat; the turn was never ended for it.
        await eventually(lambda: listed_drones(browser), timeout=10, what="the drone listed again")
        if fault == "restarted-empty":  # what crossed Redis meanwhile is gone: the page resyncs
            await eventually(partial(_resyncs, browser, 1), 10, "a resync notice")
        _, success, message = await browser.completion(turn_id, timeout=30)
        assert success is True, message
        turn = await stored(store, turn_id)
        assert turn.status == "finished" and turn.text == reply_text(reply)
        openai_peer.script(Reply(chunks=["after ", "Redis"]))
        ack = await browser.submit("Again", sessionId=turn.session_id)
        assert await browser.completion(ack["turnId"], timeout=20) == (
            ack["turnId"],
            True,
            "after Redis",
        )
    finally:
        await browser.close()
        await store.close()


async def test_a_turn_sent_through_another_relay_as_redis_comes_back_empty_starts_at_once(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
    own_redis: OwnRedis,
) -> None:
    """An order published to a relay not yet listening to the others again is lost, and sent
    again only when its answer is overdue (10 s): a relay lists its drones again only once it
    listens, and sends through another relay only while it listens itself (docs/reliability.md,
    "Redis"). Three outages: the listener's next attempt and the drones' listing fall in a
    different order each time."""
    a = await relay_processes(redis=own_redis.url, drone_grace=2.0)
    b = await relay_processes(redis=own_redis.url, drone_grace=2.0)
    drone_process(Upstream("openai", openai_peer), server=a.url)
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(b.url, await People(Accounts(store)).token("ada")).connect()
    loop = asyncio.get_running_loop()
    try:
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        for outage in range(3):
            own_redis.kill()
            # The fault; the listeners try again about 1.55 s and 2.55 s in.
            await asyncio.sleep(1.7 + outage * 0.3)
            own_redis.start()
            await eventually(
                lambda: listed_drones(browser), timeout=10, what="the drone listed again"
            )
            # The browser's relay listens again too: what the other relay publishes before it
            # does is lost, and its browsers are told to resync (the page opens its session
            # again); a script follows suit by waiting for that notice.
            await eventually(
                partial(_resyncs, browser, outage + 1), 10, "the browser's relay listening again"
            )
            openai_peer.script(Reply(chunks=["at ", "once"]))
            sent = loop.time()
            ack = await browser.submit(f"Right after outage {outage}")
            assert await browser.completion(ack["turnId"], timeout=20) == (
                ack["turnId"],
                True,
                "at once",
            )
            assert loop.time() - sent < 5.0, f"outage {outage}: {loop.time() - sent:.1f} s"
    finally:
        await browser.close()
        await store.close()


async def test_a_call_waiting_for_approval_can_be_approved_after_redis_restarts_empty(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
    own_redis: OwnRedis,
) -> None:
    """The drone's relay writes back the calls waiting on it, as it does a turn's text: the
    person's relay finds the call again, and a page opened now shows it."""
    a = await relay_processes(redis=own_redis.url)
    b = await relay_processes(redis=own_redis.url)
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("list_directory", {})]),
        Reply(chunks=["Listed."]),
    )
    drone_process(Upstream("openai", openai_peer), server=b.url, tools="list_directory=ask")
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(a.url, await People(Accounts(store)).token("ada")).connect()
    try:
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        ack = await browser.submit("List the files, once I say so")
        turn_id = ack["turnId"]
        waiting = await eventually(
            lambda: [p for p in browser.progress(turn_id, "tool") if p["state"] == "waiting"],
            timeout=10,
            what="the call waiting",
        )

        own_redis.restart()

        async def shown_again() -> bool:
            opened = await browser.call("openSession", {"sessionId": ack["sessionId"]})
            return bool(opened.get("ok") and opened["turns"][0]["waiting"])

        await eventually(shown_again, timeout=5, what="the waiting call in a snapshot again")
        answer = {"turnId": turn_id, "callId": waiting[0]["callId"], "approve": True}
        assert (await browser.call("approveToolCall", answer))["ok"] is True
        assert (await browser.completion(turn_id, timeout=10))[1:] == (True, "Listed.")
    finally:
        await browser.close()
        await store.close()


async def test_a_drone_connecting_while_redis_stalls_is_let_in_once_it_answers(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
    own_redis: OwnRedis,
) -> None:
    """The relay cannot check the drone's route while Redis stalls: it says so in one line,
    without a traceback, and the drone (told to come again, not refused) is in once Redis
    answers."""
    # A grace of 3 s: the drone keeps its connection open past the relay's 2 s wait for Redis.
    relay = await relay_processes(redis=own_redis.url, drone_grace=3.0)
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(relay.url, await People(Accounts(store)).token("ada")).connect()
    try:
        own_redis.pause()
        drone = drone_process(Upstream("openai", openai_peer), server=relay.url)
        await eventually(
            lambda: b"drone not let in" in relay.log.read_bytes(), 30, "the drone to be told"
        )
        own_redis.resume()

        await eventually(lambda: listed_drones(browser), timeout=30, what="the drone")
        openai_peer.script(Reply(chunks=["in ", "at last"]))
        ack = await browser.submit("After the stall")
        assert await browser.completion(ack["turnId"], timeout=20) == (
            ack["turnId"],
            True,
            "in at last",
        )
        assert drone.poll() is None
        log = relay.log.read_text()
        assert "Traceback" not in log and " ERROR " not in log, log
    finally:
        own_redis.resume()
        await browser.close()
        await store.close()


async def test_a_drone_whose_relay_does_not_answer_its_connect_waits_and_connects_later(
    drone_process: Start, openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """A relay that takes the websocket but leaves the drone's connect unanswered while the
    engine.io connection times out: python-socketio's own reconnect and the drone's next
    attempt meet. The drone keeps trying (it used to exit with a traceback on its third
    attempt) and is in once the relay answers."""
    answering = asyncio.Event()
    attempts: list[str] = []
    joined: list[str] = []
    sio = socketio.AsyncServer(async_mode="aiohttp", ping_interval=0.5, ping_timeout=1)

    async def on_connect(sid: str, environ: Any, auth: Any) -> None:
        attempts.append(sid)
        await answering.wait()
        joined.append(sid)

    sio.on("connect", on_connect, namespace=DRONE_NAMESPACE)
    app = web.Application()
    sio.attach(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    drone = drone_process(Upstream("openai", openai_peer), server=url)
    log = tmp_path / "proc-drone-0.log"
    try:
        # Its own attempts end "could not connect" (python-socketio's reconnects come in
        # between); the third met one of those.
        await eventually(
            lambda: log.read_text().count("could not connect") >= 3 or drone.poll() is not None,
            60,
            "three attempts",
        )
        answering.set()

        def connected() -> bool:
            return any(sio.manager.is_connected(sid, DRONE_NAMESPACE) for sid in joined)

        await eventually(lambda: connected() or drone.poll() is not None, 30, "the drone to join")
        assert drone.poll() is None
        assert connected()
    finally:
        answering.set()
        await runner.cleanup()


async def test_an_abort_through_another_relay_while_redis_is_down_still_stops_the_model(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
    own_redis: OwnRedis,
) -> None:
    """The person's relay ends the turn (the drone's relay cannot be reached through Redis);
    the drone's relay learns it from the store, tells the drone, and keeps what streamed."""
    a = await relay_processes(redis=own_redis.url, drone_grace=30.0)
    b = await relay_processes(redis=own_redis.url, drone_grace=30.0)
    reply = Reply(chunks=[f"r{i} " for i in range(1000)], delay=0.03)  # 30 s
    openai_peer.script(reply)
    drone_process(Upstream("openai", openai_peer), server=b.url)
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(a.url, await People(Accounts(store)).token("ada")).connect()
    try:
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        turn_id = (await browser.submit("Stream past an outage"))["turnId"]
        await browser.wait_text(turn_id, pieces=3, timeout=10)

        own_redis.kill()
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)
        request = openai_peer.requests[0]
        await eventually(lambda: request.disconnected, 10, "the model's stream closed")
        turn = await stored(store, turn_id)
        assert own_redis.process is not None and own_redis.process.poll() is not None
        assert (turn.status, turn.reason) == ("aborted", "unanswered")
        assert turn.text and reply_text(reply).startswith(turn.text)
        assert len(turn.text) < len(reply_text(reply))
    finally:
        await browser.close()
        await store.close()


async def test_a_postgres_crash_delays_endings_but_loses_none(
    own_postgres: OwnPostgres,
    openai_peer: OpenAIPeer,
    start_drone_on: Start,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    config = RelayConfig(
        port=0,
        database=own_postgres.url,
        drone_token=DRONE_TOKEN,
        abort_grace=2.0,
        drone_grace=1.0,
    )
    runner, port = await start_relay(config)
    url = f"http://127.0.0.1:{port}"
    store = runner.app[RELAY].store
    try:
        people = People(Accounts(store))
        browser = await Browser(url, await people.token("ada")).connect()
        finishing = Reply(chunks=[f"p{i} " for i in range(60)], delay=0.03)
        openai_peer.script(finishing, SLOW)
        await start_drone_on(url, Upstream("openai", openai_peer), concurrency=2)
        first = (await browser.submit("Finish during the outage"))["turnId"]
        # The peer answers requests in the order they come: the first turn's comes first.
        await eventually(lambda: openai_peer.requests, timeout=10, what="the first request")
        second = (await browser.submit("Be aborted during the outage"))["turnId"]
        await browser.wait_text(first, pieces=3, timeout=10)
        await eventually(lambda: browser.progress(second), timeout=10, what="the second turn")

        await asyncio.to_thread(own_postgres.kill)
        assert await browser.abort(second) == (True, ABORT_SIGNALED)
        # What needs the database is refused with a sentence, not a traceback in the log.
        assert await browser.submit("During the outage") == {"ok": False, "error": UNAVAILABLE}
        await eventually(lambda: openai_peer.requests[0].completed, 10, "the first answer")
        await asyncio.sleep(3)  # the outage goes on past the drone's answer
        await asyncio.to_thread(own_postgres.start)

        assert (await browser.completion(first, timeout=20))[1] is True
        assert await browser.completion(second, timeout=20) == (second, True, ABORTED)
        turn = await stored(store, first)
        assert turn.status == "finished" and turn.text == reply_text(finishing)
        assert roles(turn) == [
            ("user", "Finish during the outage"),
            ("assistant", reply_text(finishing)),
        ]
        assert (await stored(store, second)).status == "aborted"
        assert await store.processing_turns() == []
        await a_next_turn_works(browser, turn.session_id, openai_peer)
        await browser.close()
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info
    ]


async def test_a_page_loaded_or_connected_during_a_database_outage_is_told_to_come_again(
    own_postgres: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload, a login, or a page's socket.io connection while PostgreSQL is down: a 503 with
    one sentence, and a refusal that says to try again (the page does), then all works."""
    caplog.set_level(logging.INFO)
    runner, port = await start_relay(RelayConfig(port=0, database=own_postgres.url))
    url = f"http://127.0.0.1:{port}"
    accounts = runner.app[RELAY].accounts
    password = "correct horse battery staple"
    await accounts.add_user("ada", password)
    form = {"username": "ada", "password": password}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/login", data=form, allow_redirects=False) as logged_in:
                assert logged_in.status == 303
                login = {"Cookie": f"hangar_login={logged_in.cookies['hangar_login'].value}"}
            token = await People(accounts).token("bob")

            await asyncio.to_thread(own_postgres.kill)
            # A login this relay has not seen yet (another relay's), and a new one.
            cookie = {"Cookie": "hangar_login=made-on-another-relay"}
            for method, path in [("GET", "/"), ("POST", "/login")]:
                async with http.request(method, url + path, data=form, headers=cookie) as answer:
                    assert (answer.status, await answer.text()) == (503, UNAVAILABLE), path
            refused = await refusal_of(url, auth={"token": token}, transports=["websocket"])
            assert refused == {"message": UNAVAILABLE, "data": {"again": True}}

            await asyncio.to_thread(own_postgres.start)
            async with http.get(url + "/", allow_redirects=False, headers=login) as page:
                assert page.status == 200
            browser = await Browser(url, token).connect()
            assert (await browser.call("listSessions"))["ok"] is True
            await browser.close()
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info
    ]


async def test_a_completion_held_up_past_the_drones_wait_is_delivered_later(
    relay_processes: Start,
    start_drone_on: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
) -> None:
    relay = await relay_processes(redis=False)
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(relay.url, await People(Accounts(store)).token("ada")).connect()
    locker = await asyncpg.connect(postgres_url)
    try:
        reply = Reply(chunks=[f"l{i} " for i in range(30)], delay=0.02)
        openai_peer.script(reply)
        await start_drone_on(relay.url, Upstream("openai", openai_peer))
        await eventually(lambda: listed_drones(browser), timeout=15, what="the drone")
        turn_id = (await browser.submit("Wait for the table"))["turnId"]
        await browser.wait_text(turn_id, pieces=3, timeout=10)

        locking = locker.transaction()
        await locking.start()
        await locker.execute("LOCK TABLE turns IN ACCESS EXCLUSIVE MODE")
        await eventually(lambda: openai_peer.requests[0].completed, 10, "the answer")
        await asyncio.sleep(11)  # the fault itself: longer than the drone waits for an ack
        await locking.rollback()

        assert (await browser.completion(turn_id, timeout=20))[1] is True
        turn = await stored(store, turn_id)
        assert turn.status == "finished" and turn.text == reply_text(reply)
        assert await store.processing_turns() == []
        # The drone is not wedged: its next turn goes through at once.
        await a_next_turn_works(browser, turn.session_id, openai_peer)
    finally:
        await locker.close()
        await browser.close()
        await store.close()


@pytest.fixture
async def start_drone_on() -> AsyncIterator[Callable[..., Any]]:
    """An in-process drone on the relay at ``url`` (stopped as by Ctrl-C at the end)."""
    from hangar.drone.tools.policy import ToolPolicy
    from hangar.drone.worker import DroneConfig, run_drone
    from hangar.shared.abort import AbortController, AbortError

    started: list[tuple[AbortController, asyncio.Task[int]]] = []

    async def start(url: str, upstream: Upstream, **settings: Any) -> None:
        config = DroneConfig(
            server=url,
            token=DRONE_TOKEN,
            name=f"d{len(started)}",
            tools=ToolPolicy.allow_all(),
            **{**upstream.drone_settings(), **settings},
        )
        root = AbortController()
        started.append((root, asyncio.ensure_future(run_drone(config, root))))

    yield start
    for root, _ in started:
        root.abort(AbortError("stop", cause="operator"))
    await asyncio.gather(*(task for _, task in started), return_exceptions=True)


async def test_a_drone_restarted_under_its_name_within_the_grace_ends_the_turns_it_lost(
    tmp_path: Path, openai_peer: OpenAIPeer, drone_process: Start
) -> None:
    config = RelayConfig(
        port=0, database=str(relay_folder(tmp_path) / "hangar.db"), drone_grace=5.0
    )
    runner, port = await start_relay(config)
    relay = runner.app[RELAY]
    url = f"http://127.0.0.1:{port}"
    try:
        token = await relay.accounts.create_drone_token("keeper")
        browser = await Browser(url, await People(relay.accounts).token("ada")).connect()
        openai_peer.script(SLOW)
        first = drone_process(Upstream("openai", openai_peer), server=url, token=token)
        await eventually(lambda: relay.directory.local, timeout=15, what="the drone")
        (killed,) = relay.directory.local.values()
        turn_id = (await browser.submit("Stream for a while"))["turnId"]
        await browser.wait_text(turn_id, pieces=3, timeout=10)

        first.send_signal(signal.SIGKILL)
        # The same drone (its own token, so its own name) is back within the grace, as a new
        # process that knows nothing of the turn.
        drone_process(Upstream("openai", openai_peer), server=url, token=token, name="again")
        # The killed process stays listed until the relay sees its connection gone.
        await eventually(
            lambda: [r for r in relay.directory.local.values() if r.instance != killed.instance],
            timeout=15,
            what="the drone back, a new process",
        )

        # At once: this relay saw the drone accept the order, so it is not on its way any more.
        _, success, message = await browser.completion(turn_id, timeout=3)
        assert (success, message) == (False, "The drone restarted and no longer runs this turn.")
        assert await relay.store.processing_turns() == []
        openai_peer.script(Reply(chunks=["back ", "again"]))
        ack = await browser.submit(
            "And now?", sessionId=(await stored(relay.store, turn_id)).session_id
        )
        assert (await browser.completion(ack["turnId"], timeout=20))[1:] == (True, "back again")
        await browser.close()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("workers", [0, 1], ids=["in the drone", "in a worker process"])
async def test_a_drone_cut_off_from_its_relay_ends_its_turns_as_lost_not_as_a_persons_abort(
    openai_peer: OpenAIPeer, tmp_path: Path, workers: int
) -> None:
    """Past --cut-off without a relay the drone stops what it runs; when a relay hears from it
    again (one restarted, say, that no drone's loss had ended the turn for), the turn ends in
    error as lost (docs/protocol.md, "End reasons"), not aborted by nobody."""
    first = BareRelay()
    port = await first.start()
    config = DroneConfig(
        server=f"http://127.0.0.1:{port}",
        token=DRONE_TOKEN,
        name="cut",
        provider="openai",
        model="gpt-test",
        base_url=openai_peer.base_url + "/v1",
        api_key="test-key",
        workdir=str(tmp_path),
        workers=workers,
        cut_off=1.0,
    )
    root = AbortController()
    drone = asyncio.ensure_future(run_drone(config, root))
    again = BareRelay()
    try:
        await eventually(lambda: first.drone, timeout=30, what="the drone")
        openai_peer.script(SLOW)
        order = {"turnId": "t_1", "sessionId": "s_1", "prompt": "Say a lot", "history": []}
        accepted = await first.sio.call(
            "workOrder", order, to=first.drone, namespace=DRONE_NAMESPACE
        )
        assert accepted == {"ok": True}
        await eventually(lambda: openai_peer.requests, what="the model call")

        await first.vanish()  # and stays gone past --cut-off
        await openai_peer.wait_for_disconnect(timeout=1.0 + 5.0)
        await again.start(port)

        await asyncio.wait_for(again.completed.wait(), 20)
        turn_id, success, result, ending = again.completions[0]
        assert (turn_id, success, result) == ("t_1", False, CUT_OFF), ending
        assert ending["reason"] == "drone_lost"
        assert not openai_peer.requests[0].completed
    finally:
        root.abort(AbortError("The test is over.", cause="operator"))
        await asyncio.wait_for(drone, 10)
        for relay in (first, again):
            await relay.runner.cleanup()


@pytest.mark.parametrize("refused", [["EVAL", "EVALSHA"], ["EVALSHA"]], ids=" and ".join)
async def test_a_redis_that_runs_no_scripts_is_refused_as_the_relay_starts(
    tmp_path: Path, refused: list[str]
) -> None:
    """Only loading a script was tried at start, which such a Redis allows: the relay started,
    then let no drone in, telling each that its Redis did not answer, for ever."""
    redis = OwnRedis(
        *(option for command in refused for option in ("--rename-command", command, ""))
    )
    redis.start()
    try:
        config = RelayConfig(port=0, database=str(tmp_path / "hangar.db"), redis=redis.url)
        with pytest.raises(RelayStartError) as refusal:
            await start_relay(config)
        assert str(refusal.value).startswith(
            "Redis refuses what a relay needs: unknown command 'EVALSHA'"
        ), refusal.value
    finally:
        redis.kill()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ("socket_timeout=abc", "cannot use the settings: Invalid value for 'socket_timeout'"),
        ("ssl_cert_reqs=none", "cannot reach Redis: "),
    ],
)
async def test_a_redis_url_with_options_redis_cannot_take_stops_the_relay_in_one_line(
    tmp_path: Path, own_redis: OwnRedis, caplog: pytest.LogCaptureFixture, options: str, said: str
) -> None:
    """A relay started without the command line's checks: one option made a traceback, the
    other a relay that never listened, its channel failing thousands of times a second."""
    config = RelayConfig(
        port=0, database=str(tmp_path / "hangar.db"), redis=f"{own_redis.url}?{options}"
    )

    with pytest.raises(RelayStartError) as refusal:
        await asyncio.wait_for(start_relay(config), 30)

    assert str(refusal.value).startswith(said), refusal.value
    assert "pubsub" not in caplog.text


async def test_the_sessions_list_answers_while_redis_is_down(
    tmp_path: Path,
    own_redis: OwnRedis,
    openai_peer: OpenAIPeer,
    start_drone_on: Callable[..., Any],
) -> None:
    """A session's line counts its running turn's calls waiting for approval, which Redis
    keeps: with Redis down, a page of the list holding a running session failed whole."""
    config = RelayConfig(
        port=0,
        database=str(tmp_path / "hangar.db"),
        redis=own_redis.url,
        drone_token=DRONE_TOKEN,
        drone_grace=30.0,
    )
    runner, port = await start_relay(config)
    url = f"http://127.0.0.1:{port}"
    try:
        people = People(Accounts(runner.app[RELAY].store))
        browser = await Browser(url, await people.token("ada")).connect()
        openai_peer.script(SLOW)
        await start_drone_on(url, Upstream("openai", openai_peer))
        ack = await browser.submit("Keep running")
        await browser.wait_text(ack["turnId"], pieces=2, timeout=10)

        own_redis.kill()
        page = await browser.call("listSessions", {})

        assert page["ok"] is True, page
        assert [
            (s["sessionId"], s["processingTurnId"], s["approvals"]) for s in page["sessions"]
        ] == [(ack["sessionId"], ack["turnId"], 0)]
        await browser.close()
    finally:
        await runner.cleanup()
