"""Every fault of docs/reliability.md with a person's abort before, during and after it: the turn
ends exactly once within ``ENDS_WITHIN``, the stored text holds all the person saw and no more
than the model said, and the session goes on (the OpenAI peer, which refuses an invalid history
as the real service does, accepts the next request).

Two relays on PostgreSQL and a Redis of the test's own; the drone knows both relays and starts
on the first (the drone's relay), the person is on the second (the browser's relay). Faults:
a frozen drone, a drone killed mid-tool, either relay killed, Redis killed and restarted empty,
PostgreSQL (a cluster of the test's own) killed and restarted, the turns table locked for 12 s.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from bench.services import OwnPostgres, OwnRedis
from hangar.server.accounts import Accounts
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.store import TurnRecord
from hangar.shared.protocol import ABORT_SIGNALED, NO_ACTIVE_WORK_ORDER, TERMINAL_STATUSES
from tests.conftest import Browser, People, RelayProcess, Upstream, eventually
from tests.test_faults import a_next_turn_works

Start = Callable[..., Any]

FAULTS = [
    "freeze-drone",
    "kill-drone-mid-tool",
    "kill-drones-relay",
    "kill-browsers-relay",
    "redis",
    "postgres",
    "table-lock",
]
WHEN = ["before", "during", "after"]
ENDS_WITHIN = 15.0
"""Seconds from the abort, or from the fault's end if later, to the turn's end at most: the
relays' grace (2 s), the abort watchdog (2 s), 5 s for a restarted relay, the sweep's second,
and a margin for a busy machine."""
ANSWERED_WITHIN = 5.0
"""Seconds a person waits for the abort's answer at most: the relay's own answer comes after
--abort-answer (2 s) when the drone gives none; the margin is for a busy machine."""
HOLD = {"freeze-drone": 3.0, "redis": 4.0, "postgres": 4.0, "table-lock": 12.0}
"""Seconds a fault lasts (the others are kills, over at once)."""
STREAM = Reply(chunks=[f"c{i} " for i in range(1000)], delay=0.03)
"""Thirty seconds of text: it outlasts every fault."""
LONG_TOOL = ScriptedToolCall("run_shell", {"command": "sleep 60"})


@dataclass
class Scene:
    """The deployment a fault strikes, and the person watching one turn."""

    fault: str
    a: RelayProcess
    b: RelayProcess
    drone: subprocess.Popen[bytes]
    browser: Browser
    store: PostgresTurnStore
    redis: OwnRedis
    postgres: OwnPostgres | None
    token: str
    turn_id: str = ""
    session_id: str = ""
    locker: Any = None
    seen: str = ""
    """The turn's text the person saw before the fault."""
    extra: list[Browser] = field(default_factory=list)

    async def strike(self) -> None:
        if self.fault == "freeze-drone":
            self.drone.send_signal(signal.SIGSTOP)
        elif self.fault == "kill-drone-mid-tool":
            self.drone.kill()
        elif self.fault == "kill-drones-relay":
            self.a.kill()
        elif self.fault == "kill-browsers-relay":
            self.b.kill()
        elif self.fault == "redis":
            self.redis.kill()
        elif self.fault == "postgres":
            assert self.postgres is not None
            await asyncio.to_thread(self.postgres.kill)
        else:
            import asyncpg

            self.locker = await asyncpg.connect(self.a.database)
            await self.locker.execute("BEGIN; LOCK TABLE turns IN ACCESS EXCLUSIVE MODE")

    async def mend(self) -> None:
        if self.fault == "freeze-drone":
            self.drone.send_signal(signal.SIGCONT)
        elif self.fault == "redis":
            await asyncio.to_thread(self.redis.start)
        elif self.fault == "postgres":
            assert self.postgres is not None
            await asyncio.to_thread(self.postgres.start)
        elif self.fault == "table-lock":
            await self.locker.execute("ROLLBACK")
            await self.locker.close()
        if self.fault == "kill-browsers-relay":  # the page finds the other relay
            self.browser = await Browser(self.a.url, self.token).connect()
            self.extra.append(self.browser)

    async def hold(self) -> None:
        await asyncio.sleep(HOLD.get(self.fault, 0.0))  # the fault itself, not a wait for it

    async def abort(self) -> tuple[bool, str] | None:
        """The person's abort; None when its relay died before answering."""
        # A relay answers at once, or with its own answer within --abort-answer (2 s).
        try:
            return await self.browser.abort(self.turn_id, timeout=ANSWERED_WITHIN)
        except (TimeoutError, ConnectionError, OSError) as error:
            if self.fault != "kill-browsers-relay":
                raise AssertionError(f"the abort got no answer: {error!r}") from error
            return None


@pytest.fixture
async def scene(
    request: pytest.FixtureRequest,
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
) -> AsyncIterator[Scene]:
    fault: str = request.param
    redis = OwnRedis()
    redis.start()
    postgres: OwnPostgres | None = None
    database = postgres_url
    if fault == "postgres":
        postgres = OwnPostgres()
        await asyncio.to_thread(postgres.init)
        await asyncio.to_thread(postgres.start)
        database = postgres.url
    store = PostgresTurnStore(database)
    opened: list[Browser] = []
    try:
        await store.open()
        token = await People(Accounts(store)).token("ada")
        a = await relay_processes(redis=redis.url, database=database, drone_grace=2.0)
        b = await relay_processes(redis=redis.url, database=database, drone_grace=2.0)
        drone = drone_process(Upstream("openai", openai_peer), server=f"{a.url},{b.url}")
        browser = await Browser(b.url, token).connect()
        opened.append(browser)
        listed = await eventually(lambda: drones_of(browser), timeout=20, what="the drone")
        assert listed
        scene = Scene(fault, a, b, drone, browser, store, redis, postgres, token)
        yield scene
        opened += scene.extra
    finally:
        for browser in opened:
            await browser.close()
        await store.close()
        redis.kill()
        if postgres is not None:
            await asyncio.to_thread(postgres.remove)


async def drones_of(browser: Browser) -> list[Any]:
    drones: list[Any] = (await browser.call("listDrones", {}))["drones"]
    return drones


async def start_turn(scene: Scene, peer: OpenAIPeer) -> None:
    if scene.fault == "kill-drone-mid-tool":
        peer.script(Reply(chunks=[], tool_calls=[LONG_TOOL]))
    else:
        peer.script(STREAM)
    ack = await scene.browser.submit("Work through the fault")
    scene.turn_id, scene.session_id = ack["turnId"], ack["sessionId"]
    browser = scene.browser
    if scene.fault == "kill-drone-mid-tool":
        await eventually(
            lambda: [p for p in browser.progress(scene.turn_id, "tool") if p["state"] == "start"],
            timeout=20,
            what="the command to start",
        )
    else:
        await browser.wait_text(scene.turn_id, pieces=3, timeout=20)
    scene.seen = browser.text(scene.turn_id)


async def ended(scene: Scene) -> TurnRecord | None:
    try:
        turn = await scene.store.get_turn(scene.turn_id)
    except (TimeoutError, OSError, ConnectionError):
        return None  # the test's own PostgreSQL is down for a moment
    except Exception as error:  # asyncpg's own errors while the server is away
        if type(error).__module__.startswith("asyncpg"):
            return None
        raise
    return turn if turn is not None and turn.status in TERMINAL_STATUSES else None


async def text_holds(scene: Scene) -> TurnRecord | None:
    turn = await ended(scene)
    return turn if turn is not None and turn.text.startswith(scene.seen) else None


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("scene", FAULTS, indirect=True)
async def test_an_abort_around_a_fault_ends_the_turn_once_and_the_session_goes_on(
    scene: Scene,
    when: str,
    openai_peer: OpenAIPeer,
    drone_process: Start,
) -> None:
    await start_turn(scene, openai_peer)
    loop = asyncio.get_running_loop()

    if when == "before":  # the abort is under way as the fault strikes
        aborting = asyncio.ensure_future(scene.abort())
        await asyncio.sleep(0)  # emitted, not answered
        await scene.strike()
        await scene.hold()
        answer = await aborting
        await scene.mend()
    elif when == "during":
        await scene.strike()
        answer = await scene.abort()
        await scene.hold()
        await scene.mend()
    else:
        await scene.strike()
        await scene.hold()
        await scene.mend()
        answer = await scene.abort()
    asked = loop.time()

    if answer is None:  # its relay died with the abort: the person asks again on the other
        answer = await scene.abort()
    turn = await eventually(lambda: ended(scene), ENDS_WITHIN, "the turn to end")
    assert loop.time() - asked < ENDS_WITHIN

    if answer == (True, ABORT_SIGNALED):
        assert turn.status == "aborted", (answer, turn.status, turn.result)
        assert turn.ended_by == "ada", turn  # even when the database could not keep who asked
    else:  # it had ended already: its drone was lost meanwhile
        assert answer == (False, NO_ACTIVE_WORK_ORDER), answer
        assert (turn.status, turn.reason) == ("error", "drone_lost"), turn
    # Once: one start upstream, one terminal write, at most one completion per page.
    prompts = [r for r in openai_peer.requests if r.messages[-1]["content"].startswith("Work")]
    assert len(prompts) == 1
    assert len(scene.browser.completions(scene.turn_id)) <= 1
    # No text lost, none made up: the ending's, or soon after it (a relay that ended the turn
    # while Redis was away had none of it; the drone's relay adds what it kept once Redis is
    # back, docs/reliability.md).
    if scene.fault != "kill-drone-mid-tool":
        turn = await eventually(lambda: text_holds(scene), ENDS_WITHIN, "the text seen, stored")
    assert "".join(STREAM.chunks).startswith(turn.text)
    # The session goes on: its history is valid (and a drone is there to take it).
    if scene.fault == "kill-drone-mid-tool":
        drone_process(Upstream("openai", openai_peer), server=f"{scene.a.url},{scene.b.url}")
    await eventually(lambda: drones_of(scene.browser), timeout=20, what="a drone again")
    await a_next_turn_works(scene.browser, scene.session_id, openai_peer)
