"""Chaos: work orders through two relays and four drones while parts die, and whether every turn
still ends exactly once, with its text and a valid history.

Two relays (``hangar serve``) share a PostgreSQL and a Redis of the benchmark's own
(``bench/services.py``: loopback ports of their own, removed afterwards; the machine's shared
servers are not touched). Four drones (``hangar drone``, each given both relays and a drone token
of its own, so one started again comes back under its id; 4 slots; shell commands allowed in
the sandbox) talk to an OpenAI SSE peer (``bench/chaos_peer.py``) that
streams at a model's pace. People (socket.io clients, half on each relay, reconnecting as the
page does) submit ``--orders`` work orders over ``--duration`` seconds, new sessions and
follow-ups, and abort some: at once (most still queued), mid-stream, during a tool call, and
after the end. Meanwhile, one after another: drones killed with SIGKILL (started again after
1-3 s), a relay killed with SIGKILL (started again on its port), Redis paused for 5-12 s, Redis
killed and started empty, PostgreSQL stopped ``-m immediate`` for 3-6 s, and ``LOCK TABLE turns``
held for 12 s. Then the run settles, each session gets one follow-up, and the verdict is printed
(``bench/chaos_check.py``). The whole run is held to ``--cap`` seconds; past it, it fails.

    .venv/bin/python -m bench.chaos [--orders 500] [--duration 150] [--seed N] [--logs DIR]

Exits 1 if the verdict lists any failure (a turn not ended exactly once or its browser not told,
stuck, slow, lost text, an invalid history, a run twice), or if the cap was exceeded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import asyncpg

from hangar.server.accounts import Accounts
from hangar.server.postgres_store import PostgresTurnStore

from .chaos_check import Fault, Order, log_trouble, verdict
from .chaos_peer import prompt
from .chaos_people import Person
from .common import Proc, Stack, busy_seconds, get_json, run_main
from .services import OwnPostgres, OwnRedis, free_port

KINDS = {"text": 0.45, "long": 0.3, "tool": 0.25}
SCHEDULE = [
    (0.08, "kill -9 drone"), (0.16, "Redis paused"), (0.28, "kill -9 drone"),
    (0.35, "kill -9 relay"), (0.45, "PostgreSQL killed"), (0.56, "Redis restarted empty"),
    (0.63, "kill -9 drone"), (0.72, "LOCK TABLE turns"), (0.85, "kill -9 relay"),
    (0.92, "kill -9 drone"),
]  # fmt: skip
"""Faults, at these fractions of ``--duration``, one at a time."""
LOCK_SECONDS = 12.0
WAIT = 60.0
"""Longest a person waits for a turn to reach the point where they abort it."""


async def first(*events: asyncio.Event, limit: float = WAIT) -> None:
    """Until any of ``events`` is set (at most ``limit`` s)."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    await asyncio.wait(waits, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()


class Chaos:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.pick = random.Random(args.seed)
        self.stack = Stack(workdir)
        self.redis = OwnRedis()
        self.postgres = OwnPostgres()
        self.ports = [free_port(), free_port()]
        self.relays: list[Proc] = []
        self.drones: list[Proc] = []
        self.drone_tokens: list[str] = []
        self.started: Counter[str] = Counter()
        self.peer = ""
        self.people: list[Person] = []
        self.orders: list[Order] = []
        self.follow_ups: list[Order] = []
        self.faults: list[Fault] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def _name(self, base: str) -> str:
        self.started[base] += 1
        return f"{base}.{self.started[base]}"

    async def relay(self, index: int) -> Proc:
        args = ["-m", "bench.hangar_mono", "serve", "--port", str(self.ports[index])]
        args += ["--database", self.postgres.url, "--redis", self.redis.url]
        proc = self.stack.spawn(self._name(f"relay-{'ab'[index]}"), args)
        await proc.wait_line(r"listening on", limit=30)
        return proc

    def drone(self, index: int) -> Proc:
        args = ["-m", "bench.hangar_mono", "drone", "--server", ",".join(self.urls)]
        args += ["--token", self.drone_tokens[index], "--provider", "openai", "--model", "m"]
        args += ["--base-url", self.peer + "/v1", "--api-key", "x", "--tools", "run_shell=allow"]
        args += ["--concurrency", str(self.args.concurrency)]
        args += ["--workdir", str(self.stack.drone_workdir)]
        return self.stack.spawn(self._name(f"drone-{index}"), args)

    async def start(self) -> None:
        self.redis.start()
        await asyncio.to_thread(self.postgres.init)
        await asyncio.to_thread(self.postgres.start)
        self.relays = [await self.relay(0), await self.relay(1)]
        store = PostgresTurnStore(self.postgres.url)
        await store.open()
        try:
            accounts = Accounts(store)
            tokens = []
            for index in range(self.args.people):
                await accounts.add_user(f"person-{index}", None)
                tokens.append(await accounts.create_api_token(f"person-{index}", "chaos"))
            for index in range(self.args.drones):
                self.drone_tokens.append(await accounts.create_drone_token(f"drone-{index}"))
        finally:
            await store.close()
        peer = self.stack.spawn("peer", ["-m", "bench.chaos_peer", "--pace", str(self.args.pace)])
        self.peer = (await peer.wait_line(r"PEER (\S+)")).group(1)
        self.drones = [self.drone(index) for index in range(self.args.drones)]
        self.people = [
            await Person(f"person-{i}", self.urls[i % 2], token).connect()
            for i, token in enumerate(tokens)
        ]
        deadline = time.monotonic() + 30
        while len((await self.people[0].call("listDrones", {}))["drones"]) < self.args.drones:
            if time.monotonic() > deadline:
                raise TimeoutError("the drones did not all connect within 30 s")
            await asyncio.sleep(0.2)

    # ---- faults

    async def faults_on_schedule(self, began: float) -> None:
        for fraction, kind in SCHEDULE if self.args.faults else []:
            await asyncio.sleep(max(0.0, began + fraction * self.args.duration - time.monotonic()))
            fault = Fault(kind, "", time.time())
            self.faults.append(fault)
            await self.strike(fault)
            fault.until = time.time()
            print(f"fault: {kind} {fault.target} ({fault.until - fault.at:.1f} s)", flush=True)

    async def strike(self, fault: Fault) -> None:
        pick = self.pick
        if fault.kind == "kill -9 drone":
            index = pick.randrange(len(self.drones))
            fault.target = f"drone-{index}"
            self.drones[index].popen.kill()
            await asyncio.to_thread(self.drones[index].popen.wait)
            await asyncio.sleep(pick.uniform(1.0, 3.0))
            self.drones[index] = self.drone(index)
        elif fault.kind == "kill -9 relay":
            index = pick.randrange(2)
            fault.target = f"relay-{'ab'[index]}"
            self.relays[index].popen.kill()
            await asyncio.to_thread(self.relays[index].popen.wait)
            await asyncio.sleep(pick.uniform(0.5, 2.0))
            self.relays[index] = await self.relay(index)
        elif fault.kind == "Redis paused":
            self.redis.pause()
            await asyncio.sleep(pick.uniform(5.0, 12.0))
            self.redis.resume()
        elif fault.kind == "Redis restarted empty":
            self.redis.kill()
            await asyncio.sleep(pick.uniform(1.0, 3.0))
            self.redis.start()
        elif fault.kind == "PostgreSQL killed":
            await asyncio.to_thread(self.postgres.kill)
            await asyncio.sleep(pick.uniform(3.0, 6.0))
            await asyncio.to_thread(self.postgres.start)
        else:
            locker = await asyncpg.connect(self.postgres.url)
            try:
                async with locker.transaction():
                    await locker.execute("LOCK TABLE turns IN ACCESS EXCLUSIVE MODE")
                    await asyncio.sleep(LOCK_SECONDS)
            finally:
                await locker.close()

    # ---- people at work

    def new_order(self, number: int) -> Order:
        pick = self.pick
        person = pick.choice(self.people)
        kind = pick.choices(list(KINDS), weights=list(KINDS.values()))[0]
        roll = pick.random()
        plan = "tool" if kind == "tool" and roll < 0.35 else "none"
        for below, when in ((0.12, "early"), (0.30, "stream"), (0.37, "after")):
            if plan == "none" and roll < below:
                plan = when
        order = Order(number, f"c{number}", kind, person, plan)
        if person.sessions and pick.random() < 0.4:
            order.session_id = pick.choice(list(person.sessions))
            order.mode = "interrupt" if pick.random() < 0.15 else "queue"
        return order

    async def run_order(self, order: Order) -> None:
        person, pick = order.person, self.pick
        order.submitted = time.time()
        order.turn_id, order.session_id = await person.submit(
            prompt(order.marker, order.kind), order.session_id, order.mode
        )
        if not order.turn_id or order.plan == "none":
            return
        seen = person.turns[order.turn_id]
        if order.plan == "early":
            await asyncio.sleep(pick.uniform(0.0, 0.3))
        elif order.plan == "stream":
            await first(seen.first_text, seen.done)
            await asyncio.sleep(pick.uniform(0.2, 3.0))
        elif order.plan == "tool":
            await first(seen.tool_started, seen.done)
            await asyncio.sleep(pick.uniform(0.2, 1.0))
        else:
            await first(seen.done)
            await asyncio.sleep(0.3)
        order.abort_at = time.time()
        order.abort_stage, order.ack_seconds, order.ack, order.abort_tries = await person.abort(
            order.turn_id
        )

    async def submit_over_time(self, began: float) -> None:
        times = sorted(self.pick.uniform(0, self.args.duration) for _ in range(self.args.orders))
        tasks = []
        for number, at in enumerate(times):
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            order = self.new_order(number)
            self.orders.append(order)
            tasks.append(asyncio.ensure_future(self.run_order(order)))
        await asyncio.gather(*tasks)

    async def settle(self, store: PostgresTurnStore) -> float:
        """Until no turn is queued or processing and every browser was told (bounded)."""
        began = time.monotonic()
        while time.monotonic() - began < self.args.settle:
            rows = await store.fetch(
                "SELECT count(*) AS n FROM turns WHERE status IN ('queued', 'processing')"
            )
            told = all(o.person.turns[o.turn_id].done.is_set() for o in self.orders if o.turn_id)
            if rows[0]["n"] == 0 and told:
                break
            await asyncio.sleep(1.0)
        return time.monotonic() - began

    async def follow_up(self, person: Person, start: int, deadline: float) -> list[Order]:
        """One short follow-up in each of the person's sessions: its history must be valid."""
        sent = []
        for offset, session_id in enumerate(list(person.sessions)):
            order = Order(start + offset, f"f{start + offset}", "check", person, "none")
            order.session_id = session_id
            order.turn_id, _ = await person.submit(
                prompt(order.marker, "check"), session_id, "queue"
            )
            sent.append(order)
        for order in sent:
            if order.turn_id:
                seen = person.turns[order.turn_id]
                await first(seen.done, limit=max(0.0, deadline - time.monotonic()))
        return sent

    async def run(self) -> bool:
        load = os.getloadavg()
        await self.start()
        busy, began, t0 = busy_seconds(), time.monotonic(), time.time()
        print(f"{len(self.people)} people, {len(self.drones)} drones; submitting", flush=True)
        await asyncio.gather(self.submit_over_time(began), self.faults_on_schedule(began))
        after_faults = time.monotonic()
        store = PostgresTurnStore(self.postgres.url)
        await store.open()
        try:
            settled = await self.settle(store)
            print(f"settled in {settled:.0f} s; follow-ups", flush=True)
            deadline = time.monotonic() + self.args.follow_up_wait
            parts = await asyncio.gather(
                *(
                    self.follow_up(p, 1_000_000 + 1000 * i, deadline)
                    for i, p in enumerate(self.people)
                )
            )
            self.follow_ups = [order for part in parts for order in part]
            machine = (busy_seconds() - busy) / (time.monotonic() - began)
            requests = await asyncio.to_thread(get_json, self.peer + "/chaos/requests")
            logs = sorted(self.stack.workdir.glob("*.log"))
            found = await verdict(
                store, self.orders, self.follow_ups, self.faults, requests, logs,
                time.monotonic() - after_faults, t0,
            )  # fmt: skip
        finally:
            await store.close()
        self.print_report(found.text, found.failures, load, machine, logs)
        return not found.failures

    def print_report(
        self, tables: list[str], failures: list[str], load: tuple[float, ...], machine: float,
        logs: list[Path],
    ) -> None:  # fmt: skip
        args = self.args
        print(
            f"\n{args.orders} orders over {args.duration:.0f} s, {args.people} people, "
            f"{args.drones} drones × {args.concurrency} slots, peer pace {args.pace * 1000:.0f} ms "
            f"a chunk, seed {args.seed}, faults {'on' if args.faults else 'off'}; load average "
            f"before {load[0]:.2f}, machine busy {machine:.2f} of {os.cpu_count()} cores during "
            f"the run; logs in {self.stack.workdir}\n"
        )
        print("\n\n".join(tables))
        reconnects = sum(p.reconnects for p in self.people)
        refusals = Counter(r for p in self.people for r in p.refusals)
        print(f"\nbrowser reconnects: {reconnects}; refusals seen: {dict(refusals) or 'none'}")
        trouble = log_trouble(logs)
        print("\nlogs with ERROR lines or tracebacks:\n" + ("\n".join(trouble) or "- none"))
        print("\nfailures:\n" + ("\n".join(f"- {line}" for line in failures[:80]) or "- none"))

    async def stop(self) -> None:
        for person in self.people:
            await person.close()
        self.stack.stop()
        self.redis.kill()
        await asyncio.to_thread(self.postgres.remove)


async def main_async(args: argparse.Namespace) -> None:
    workdir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="hangar-chaos-"))
    chaos = Chaos(args, workdir)
    ok, began = False, time.monotonic()
    try:
        async with asyncio.timeout(args.cap):
            ok = await chaos.run()
        print(f"\nthe run took {time.monotonic() - began:.0f} s of its {args.cap:.0f} s cap")
    except TimeoutError:
        print(f"chaos: FAILED: the run took longer than its cap of {args.cap:.0f} s", flush=True)
    finally:
        await chaos.stop()
    if not ok:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=500, help="work orders (default 500)")
    parser.add_argument("--duration", type=float, default=150, help="seconds to submit them over")
    parser.add_argument("--people", type=int, default=24, help="browsers, half on each relay")
    parser.add_argument("--drones", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="slots of each drone")
    parser.add_argument("--pace", type=float, default=0.03, help="seconds between model chunks")
    parser.add_argument("--settle", type=float, default=60, help="seconds to wait for the ends")
    parser.add_argument(
        "--follow-up-wait", type=float, default=45, help="seconds to wait for the follow-ups"
    )
    parser.add_argument("--cap", type=float, default=360, help="wall-clock cap of the whole run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--no-faults", dest="faults", action="store_false", help="the same run, nothing fails"
    )
    parser.add_argument("--logs", help="keep the processes' logs here")
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
