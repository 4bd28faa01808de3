"""The chaos benchmark's people: one socket.io client on ``/ide`` each, which reconnects as the
page does when its relay dies and opens again the sessions it waits on, and which counts every
``workOrderComplete`` it is sent (a turn must end once, so it must be told once)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import socketio

IDE = "/ide"
TERMINAL = ("finished", "aborted", "error")
RETRY_FOR = 30.0
"""Seconds a person keeps trying an action while their relay is away."""
ACK_TIMEOUT = 15.0
"""The page's wait for an ack ("The relay did not answer." after it)."""


@dataclass
class Seen:
    """What one person's browser saw of one turn (wall-clock times)."""

    completions: list[tuple[float, bool, str]] = field(default_factory=list)
    drone: str | None = None
    text: bool = False
    tool_running: bool = False
    from_snapshot: str | None = None
    """The terminal status a reopened session showed for a turn whose end the browser missed."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    first_text: asyncio.Event = field(default_factory=asyncio.Event)
    tool_started: asyncio.Event = field(default_factory=asyncio.Event)

    def stage(self) -> str:
        """Where the turn was, as the browser saw it (what an abort now interrupts)."""
        if self.completions or self.from_snapshot:
            return "after the end"
        if self.tool_running:
            return "during a tool call"
        if self.text:
            return "mid-stream"
        if self.drone:
            return "started, before any text"
        return "queued"


class Person:
    def __init__(self, name: str, url: str, token: str) -> None:
        self.name, self.url, self.token = name, url, token
        self.sio = socketio.AsyncClient(
            reconnection=True, reconnection_delay=0.3, reconnection_delay_max=1.0
        )
        self.turns: dict[str, Seen] = defaultdict(Seen)
        self.sessions: dict[str, list[str]] = {}
        self.reconnects = 0
        self.refusals: list[str] = []
        self._connected_once = False
        self._tasks: set[asyncio.Task[None]] = set()
        on = self.sio.on
        on("connect", self._on_connect, namespace=IDE)
        on("workOrderComplete", self._on_complete, namespace=IDE)
        on("workOrderProgress", self._on_progress, namespace=IDE)
        on("turnStarted", self._on_started, namespace=IDE)
        on("resync", self._on_resync, namespace=IDE)

    async def connect(self) -> Person:
        auth = {"token": self.token}
        await self.sio.connect(self.url, namespaces=[IDE], auth=auth, transports=["websocket"])
        return self

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.sio.disconnect()

    async def _on_connect(self) -> None:
        if self._connected_once:
            self.reconnects += 1
            task = asyncio.ensure_future(self._reopen())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._connected_once = True

    async def _on_resync(self, data: Any = None) -> None:
        """The relay could not pass on everything (Redis was down): as the page, open again."""
        task = asyncio.ensure_future(self._reopen())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reopen(self) -> None:
        """Open again each session with a turn whose end this browser has not seen, as the
        page does after a reconnect; turns that ended meanwhile show there."""
        waiting = {s for s, turns in self.sessions.items() if any(
            not self.turns[t].done.is_set() for t in turns)}  # fmt: skip
        for session_id in waiting:
            answer = await self.call("openSession", {"sessionId": session_id})
            for view in (answer or {}).get("turns", []):
                seen = self.turns[view["turnId"]]
                if view["status"] in TERMINAL and not seen.done.is_set():
                    seen.from_snapshot = view["status"]
                    seen.done.set()

    async def _on_complete(self, turn_id: str, success: bool, message: str) -> None:
        seen = self.turns[turn_id]
        seen.completions.append((time.time(), success, message))
        seen.done.set()

    async def _on_progress(self, data: dict[str, Any]) -> None:
        seen = self.turns[data["turnId"]]
        if data.get("kind") == "text":
            seen.text = True
            seen.first_text.set()
        elif data.get("kind") == "tool" and data.get("depth", 0) == 0:
            seen.tool_running = data.get("state") == "start"
            if seen.tool_running:
                seen.tool_started.set()

    async def _on_started(self, view: dict[str, Any]) -> None:
        if view.get("status") == "processing":
            self.turns[view["turnId"]].drone = view.get("droneId")

    async def call(self, event: str, data: dict[str, Any]) -> Any:
        """An acknowledged event, tried again while the relay is away or its database fails
        (None after ``RETRY_FOR`` seconds)."""
        deadline = time.monotonic() + RETRY_FOR
        while time.monotonic() < deadline:
            try:
                answer = await self.sio.call(event, data, namespace=IDE, timeout=ACK_TIMEOUT)
            except (socketio.exceptions.SocketIOError, ConnectionError):
                await asyncio.sleep(0.5)
                continue
            if isinstance(answer, dict) and answer.get("ok") is False:
                self.refusals.append(str(answer.get("error")))
                await asyncio.sleep(1.0)
                continue
            return answer
        return None

    async def submit(self, prompt: str, session_id: str | None, mode: str) -> tuple[str, str]:
        """Submit a work order; (turn id, session id), or ("", "") when it was never answered
        (the turn may exist all the same: the benchmark finds such turns in the store). Every
        try carries the same request id, as the page's do: a try whose answer was lost and
        that is sent again is answered with the turn it made."""
        payload: dict[str, Any] = {
            "prompt": prompt,
            "mode": mode,
            "requestId": f"r_{secrets.token_hex(12)}",
        }
        if session_id:
            payload["sessionId"] = session_id
        answer = await self.call("submitWorkOrder", payload)
        if not answer:
            return "", ""
        turn_id, session = answer["turnId"], answer["sessionId"]
        self.turns.setdefault(turn_id, Seen())  # watched from now on
        self.sessions.setdefault(session, []).append(turn_id)
        return turn_id, session

    async def abort(self, turn_id: str) -> tuple[str, float, Any, int]:
        """Abort a turn; (what it was interrupting, seconds to the ack, the ack, tries: a try
        ends without an ack after 15 s, or when the relay is away)."""
        stage = self.turns[turn_id].stage()
        asked = time.monotonic()
        tries = 0
        while time.monotonic() < asked + RETRY_FOR:
            tries += 1
            try:
                ack = await self.sio.call(
                    "abortWorkOrder", {"turnId": turn_id}, namespace=IDE, timeout=ACK_TIMEOUT
                )
            except (socketio.exceptions.SocketIOError, ConnectionError):
                await asyncio.sleep(0.5)
                continue
            return stage, time.monotonic() - asked, ack, tries
        return stage, time.monotonic() - asked, None, tries
