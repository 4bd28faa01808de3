"""The drone's connection to the relay: socket.io client, reconnecting, never losing an ending.

Progress text sent while the relay is unreachable is dropped (it is display only); the messages
to persist and every ``workOrderComplete`` wait in an outbox and go out, in order, on reconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import socketio
from pydantic import ValidationError

from shared.protocol import (
    ABORT_WORK_ORDER,
    DRONE_NAMESPACE,
    WORK_ORDER,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    AbortOrder,
    ChatMessage,
    MessageAdded,
    TextDelta,
    ToolActivity,
    ToolCall,
    WorkOrder,
    describe,
)

from .service import AgentService

log = logging.getLogger("hangar.drone")

CONFIRM_TIMEOUT = 10.0


class DroneRefusedError(Exception):
    """The relay refused this drone (a bad token, say); retrying cannot help."""


@dataclass
class DroneIdentity:
    token: str
    drone_id: str
    name: str
    provider: str
    model: str
    concurrency: int


TEXT_BATCH = 0.025
"""Text arriving within this many seconds of the last text sent goes out as one delta."""
TEXT_BATCH_CHARS = 65_536


class TurnReport:
    """``Report`` for one turn, sending through the drone's connection.

    Text is coalesced: a chunk after a quiet ``TEXT_BATCH`` goes out at once, chunks arriving
    faster than that go out together at most ``TEXT_BATCH`` later. A person sees no difference;
    the relay, the browsers and the drone's own connection (where an abort's ack queues behind
    what is already sent) handle several times fewer events from a fast model. Any other event of
    the turn, and its completion, first sends the text held back, so the order stays as produced.
    """

    def __init__(self, client: DroneClient, turn_id: str) -> None:
        self.client = client
        self.turn_id = turn_id
        self._held: list[str] = []
        self._held_chars = 0
        self._held_depth = 0
        self._last_sent = -TEXT_BATCH
        self._timer: asyncio.TimerHandle | None = None

    async def text(self, text: str, depth: int) -> None:
        self.client.chunks_streamed += 1
        if self._held and depth != self._held_depth:
            await self.flush()
        self._held.append(text)
        self._held_chars += len(text)
        self._held_depth = depth
        loop = asyncio.get_running_loop()
        wait = self._last_sent + TEXT_BATCH - loop.time()
        if wait <= 0 or self._held_chars >= TEXT_BATCH_CHARS:
            await self.flush()
        elif self._timer is None:
            self._timer = loop.call_later(wait, self._flush_later)

    async def message(self, message: ChatMessage) -> None:
        await self.flush()
        event = MessageAdded(turn_id=self.turn_id, message=message)
        await self.client.send(WORK_ORDER_PROGRESS, event.wire(), durable=True)

    async def tool(self, call: ToolCall, state: str, depth: int, result: str | None = None) -> None:
        await self.flush()
        event = ToolActivity(
            turn_id=self.turn_id,
            call_id=call.id,
            name=call.name,
            state=state,
            arguments=call.arguments if state == "start" else None,
            result=result,
            depth=depth,
        )
        await self.client.send(WORK_ORDER_PROGRESS, event.wire(), durable=False)

    async def flush(self) -> None:
        """Send the text held back, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        text = "".join(self._held)
        self._held.clear()
        self._held_chars = 0
        self._last_sent = asyncio.get_running_loop().time()
        event = TextDelta(turn_id=self.turn_id, text=text, depth=self._held_depth)
        # Queued for the socket before this returns (no await in between), so in order.
        await self.client.send(WORK_ORDER_PROGRESS, event.wire(), durable=False)

    def _flush_later(self) -> None:
        self._timer = None
        self.client.spawn(self.flush())


class DroneClient:
    def __init__(self, urls: str | list[str], identity: DroneIdentity) -> None:
        self.urls = urls.split(",") if isinstance(urls, str) else urls
        self.url = self.urls[0]
        self._attempts = 0
        self.identity = identity
        self.sio = socketio.AsyncClient(
            handle_sigint=False,  # the drone's own Ctrl-C handling aborts work orders first
            reconnection=True,
            reconnection_delay=0.2,
            reconnection_delay_max=3,
            randomization_factor=0.3,
        )
        self.service: AgentService | None = None
        self.outbox: deque[tuple[str, Any]] = deque()
        self.refusal: str | None = None
        self.refused = asyncio.Event()
        self.connected = asyncio.Event()
        self.chunks_streamed = 0
        """Text chunks streamed from the model so far (about one token each)."""
        self.reports: dict[str, TurnReport] = {}
        """The report of each turn running here, dropped with its completion."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.sio.on("connect", self._on_connect, namespace=DRONE_NAMESPACE)
        self.sio.on("disconnect", self._on_disconnect, namespace=DRONE_NAMESPACE)
        self.sio.on("connect_error", self._on_connect_error, namespace=DRONE_NAMESPACE)
        self.sio.on(WORK_ORDER, self.on_work_order, namespace=DRONE_NAMESPACE)
        self.sio.on(ABORT_WORK_ORDER, self.on_abort_work_order, namespace=DRONE_NAMESPACE)

    # ---- Outlet for the service

    def report_for(self, turn_id: str) -> TurnReport:
        report = self.reports[turn_id] = TurnReport(self, turn_id)
        return report

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task the client keeps until it is done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def complete(self, turn_id: str, success: bool, message: str) -> None:
        """Report the end of a turn and wait until the relay has it (or keep it for later)."""
        if (report := self.reports.pop(turn_id, None)) is not None:
            await report.flush()
        data = (turn_id, success, message)
        if self.connected.is_set() and not self.outbox:
            try:
                await self.sio.call(
                    WORK_ORDER_COMPLETE, data, namespace=DRONE_NAMESPACE, timeout=CONFIRM_TIMEOUT
                )
                return
            except socketio.exceptions.SocketIOError:
                pass
        self.outbox.append((WORK_ORDER_COMPLETE, data))

    async def send(self, event: str, data: Any, *, durable: bool) -> None:
        if self.connected.is_set() and not self.outbox:
            try:
                await self.sio.emit(event, data, namespace=DRONE_NAMESPACE)
                return
            except socketio.exceptions.SocketIOError:
                pass
        if durable:
            self.outbox.append((event, data))

    # ---- relay -> drone

    async def on_work_order(self, data: Any = None) -> dict[str, Any]:
        try:
            order = WorkOrder.model_validate(data)
        except ValidationError as error:
            return {"ok": False, "error": describe(error)}
        assert self.service is not None
        answer = self.service.accept(order)
        log.info("work order turn=%s accepted=%s", order.turn_id, answer["ok"])
        return answer

    async def on_abort_work_order(self, data: Any = None) -> tuple[bool, str]:
        try:
            request = AbortOrder.model_validate(data)
        except ValidationError as error:
            return False, describe(error)
        assert self.service is not None
        return self.service.abort(request.turn_id)

    # ---- connection

    def hello(self) -> dict[str, Any]:
        """The ``auth`` sent at every (re)connect, with the turns still running here."""
        running = list(self.service.running) if self.service else []
        return {
            "token": self.identity.token,
            "droneId": self.identity.drone_id,
            "name": self.identity.name,
            "provider": self.identity.provider,
            "model": self.identity.model,
            "concurrency": self.identity.concurrency,
            "running": running,
        }

    def next_url(self) -> str:
        """The relay to try next: the relays given take turns, so a dead one is skipped."""
        self.url = self.urls[self._attempts % len(self.urls)]
        self._attempts += 1
        return self.url

    async def connect(self) -> None:
        """Connect to the first relay that answers; raise ``ConnectionError`` if none does,
        ``DroneRefusedError`` if one refuses this drone."""
        for _ in self.urls:
            try:
                await self.sio.connect(
                    self.next_url,
                    auth=self.hello,
                    namespaces=[DRONE_NAMESPACE],
                    transports=["websocket"],
                    wait_timeout=10,
                )
            except socketio.exceptions.ConnectionError:
                if self.refusal:
                    raise DroneRefusedError(self.refusal) from None
                continue
            self._attempts = self.urls.index(self.url)  # reconnect to this relay first
            return
        http = self.sio.eio.http  # engineio leaves its HTTP session open after a failed connect
        if http is not None and not http.closed:
            await http.close()
        raise ConnectionError(f"Cannot reach the relay at {', '.join(self.urls)}.")

    async def wait_refused(self) -> str:
        """Return when a reconnect is refused (the token was revoked, say)."""
        # Not sio.wait(): cancelling a task that awaits it would cancel engineio's read loop.
        await self.refused.wait()
        return self.refusal or ""

    async def close(self) -> None:
        await self.sio.disconnect()

    async def _on_connect(self) -> None:
        self.refusal = None
        log.info("connected to relay %s as %s", self.url, self.identity.drone_id)
        while self.outbox:
            event, data = self.outbox[0]
            try:
                await self.sio.emit(event, data, namespace=DRONE_NAMESPACE)
            except socketio.exceptions.SocketIOError:
                return
            self.outbox.popleft()
        self.connected.set()

    async def _on_disconnect(self, *reason: Any) -> None:
        self.connected.clear()
        log.warning("disconnected from relay %s", self.url)

    async def _on_connect_error(self, data: Any = None) -> None:
        # The relay's own refusals arrive as {"message": ...}; transport failures as text.
        if isinstance(data, dict):
            self.refusal = str(data.get("message") or "The relay refused this drone.")
            self.refused.set()
            log.debug("relay refused this drone: %s", self.refusal)
        else:
            log.debug("cannot reach the relay: %s", data)
