"""The drone's connection to its relays: socket.io client, reconnecting, never losing an ending.

Progress sent while no relay is reachable is dropped (it is display only; a turn's text goes
again, whole, on every reconnect). Each turn's finished messages and its ``workOrderComplete``
are delivered in order and kept until the relay confirms them (``delivery``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Coroutine
from typing import Any, Literal, Protocol

import socketio
from pydantic import ValidationError

from hangar.shared.abort import AbortCause
from hangar.shared.packets import TextPacket
from hangar.shared.protocol import (
    ABORT_WORK_ORDER,
    APPROVE_TOOL_CALL,
    DISMISSED,
    DRONE_NAMESPACE,
    HISTORY_MISS,
    WORK_ORDER,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    AbortOrder,
    DroneHello,
    DroneRecord,
    Ending,
    ToolActivity,
    ToolApproval,
    ToolCall,
    WorkOrder,
    describe,
)
from hangar.shared.shown import without_password
from hangar.shared.wire import MAX_ORDER_BYTES, cut

from .delivery import CONFIRM_TIMEOUT, Deliveries
from .engine import RelayClient
from .histories import HistoryKeeper
from .report import TurnReport, text_window

log = logging.getLogger("hangar.drone")

SETTLE_ON_CLOSE = 5.0
"""Seconds a closing drone waits for the relay to confirm the endings it still holds."""
REJOIN_DELAYS = (0.2, 0.5, 1.0, 2.0, 3.0)
"""Seconds between attempts to reach a relay again after one dropped this drone."""
ONE_ARGUMENT = "Invalid payload: the event takes one argument."
RESULT_CHARS = 4000
"""The most of a turn's ending message sent (the relay takes 100,000 at most)."""


class DroneRefusedError(Exception):
    """The relay refused this drone (a bad token, say); retrying cannot help."""


class WorkOrders(Protocol):
    """What the connection hands the relay's orders to: the agent service, or the worker pool
    that runs it in worker processes. Each answers at once, without waiting for the work."""

    def accept(self, order: WorkOrder, sent: WorkOrder | None = None) -> dict[str, Any]:
        """Take ``order`` (its whole history); ``sent`` is the order as the relay sent it (with
        ``history_base``, only the part of the history this drone lacked)."""
        ...

    def abort(
        self, turn_id: str, mode: Literal["now", "after_step"] = "now", cause: AbortCause = "person"
    ) -> tuple[bool, str]: ...

    def running_ids(self) -> list[str]: ...

    async def decide(self, turn_id: str, call_id: str, approve: bool, always: bool) -> str | None:
        """None once the approval is taken, else why not."""

    def waiting_calls(self) -> list[tuple[str, ToolCall, int]]: ...


class RelayConnection:
    def __init__(self, urls: str | list[str], record: DroneRecord, token: str) -> None:
        self.urls = urls.split(",") if isinstance(urls, str) else urls
        self.url = self.urls[0]
        self._attempts = 0
        self.record = record
        self.token = token
        self.instance = secrets.token_urlsafe(24)
        """This process's secret: only it may take the drone's place again on a reconnect."""
        self.sio = RelayClient(
            serializer=TextPacket,  # JSON only, like the relay's
            handle_sigint=False,  # the drone's own Ctrl-C handling aborts work orders first
            reconnection=True,
            reconnection_delay=0.2,
            reconnection_delay_max=3,
            randomization_factor=0.3,
            # aiohttp refuses websocket messages over 4 MiB by default: a work order with a
            # long history would cost the drone its connection.
            websocket_extra_options={"max_msg_size": MAX_ORDER_BYTES},
        )
        self.orders: WorkOrders | None = None
        self.deliveries = Deliveries(self)
        self.histories = HistoryKeeper()
        self.refusal: str | None = None
        self.refused = asyncio.Event()
        self.connected = asyncio.Event()
        self.cut_off = asyncio.Event()
        """Set while no relay hears this drone (from a lost connection until the next one)."""
        self.chunks_streamed = 0
        """Text chunks streamed from the model so far (about one token each)."""
        self.reports: dict[str, TurnReport] = {}
        """The report of each turn running here, dropped with its completion."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._rejoining = False
        self._calls: set[asyncio.Future[tuple[Any, ...]]] = set()
        self.sio.on("connect", self._on_connect, namespace=DRONE_NAMESPACE)
        self.sio.on(DISMISSED, self._on_dismissed, namespace=DRONE_NAMESPACE)
        self.sio.on("disconnect", self._on_disconnect, namespace=DRONE_NAMESPACE)
        self.sio.on("connect_error", self._on_connect_error, namespace=DRONE_NAMESPACE)

    def take_orders(self, orders: WorkOrders) -> None:
        """Hand the relay's work orders and aborts to ``orders`` from now on."""
        self.orders = orders

        async def on_work_order(data: Any = None, *more: Any) -> dict[str, Any]:
            if more:
                return {"ok": False, "error": ONE_ARGUMENT}
            try:
                sent = WorkOrder.model_validate(data)
            except ValidationError as error:
                return {"ok": False, "error": describe(error)}
            order = self.histories.complete(sent)
            if order is None:
                log.info("work order turn=%s: its history is not kept here", sent.turn_id)
                return {"ok": False, "error": HISTORY_MISS}
            answer = orders.accept(order, sent)
            if answer["ok"]:
                self.histories.keep(order)
            log.info("work order turn=%s accepted=%s", order.turn_id, answer["ok"])
            return answer

        async def on_abort_work_order(data: Any = None, *more: Any) -> tuple[bool, str]:
            if more:
                return False, ONE_ARGUMENT
            try:
                request = AbortOrder.model_validate(data)
            except ValidationError as error:
                return False, describe(error)
            answer = orders.abort(request.turn_id, request.mode)
            if answer[0]:
                what = "abort signaled" if request.mode == "now" else "stop after this step"
                log.info("%s turn=%s", what, request.turn_id)
            return answer

        async def on_approve_tool_call(data: Any = None, *more: Any) -> dict[str, Any]:
            if more:
                return {"ok": False, "error": ONE_ARGUMENT}
            try:
                answer = ToolApproval.model_validate(data)
            except ValidationError as error:
                return {"ok": False, "error": describe(error)}
            refusal = await orders.decide(
                answer.turn_id, answer.call_id, answer.approve, answer.always
            )
            return {"ok": True} if refusal is None else {"ok": False, "error": refusal}

        self.sio.on(WORK_ORDER, on_work_order, namespace=DRONE_NAMESPACE)
        self.sio.on(ABORT_WORK_ORDER, on_abort_work_order, namespace=DRONE_NAMESPACE)
        self.sio.on(APPROVE_TOOL_CALL, on_approve_tool_call, namespace=DRONE_NAMESPACE)

    # ---- outlet for the agent service

    def report_for(self, turn_id: str) -> TurnReport:
        report = self.reports[turn_id] = TurnReport(self, turn_id)
        return report

    def text_window(self) -> float:
        return text_window(len(self.reports))

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task the connection keeps until it is done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def complete(self, turn_id: str, success: bool, message: str, ending: Ending) -> None:
        """Report the end of a turn: it goes after the turn's messages, and is kept until the
        relay confirms it."""
        if (report := self.reports.pop(turn_id, None)) is not None:
            await report.flush()
        message = cut(message, RESULT_CHARS)  # a model service's error page, say
        self.deliver(turn_id, WORK_ORDER_COMPLETE, (turn_id, success, message, ending.wire()))

    def deliver(self, turn_id: str, event: str, data: Any) -> None:
        """Send ``event`` after the turn's earlier deliveries, until the relay confirms it."""
        self.deliveries.put(turn_id, event, data)

    async def call(self, event: str, data: Any, within: float = CONFIRM_TIMEOUT) -> Any:
        """Send ``event`` and return the relay's answer; raise ``ConnectionError`` as soon as
        the connection drops (python-socketio's own ``call`` waits out its timeout then)."""
        answered: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        self._calls.add(answered)

        def on_answer(*args: Any) -> None:
            if not answered.done():
                answered.set_result(args)

        try:
            await self.sio.emit(event, data, namespace=DRONE_NAMESPACE, callback=on_answer)
            async with asyncio.timeout(within):
                args = await answered
        finally:
            self._calls.discard(answered)
        return args[0] if len(args) == 1 else args

    async def post(self, event: str, data: Any) -> None:
        """Send ``event`` if connected, with no ack; dropped otherwise (it is display only)."""
        if self.connected.is_set():
            with contextlib.suppress(socketio.exceptions.SocketIOError):
                await self.sio.emit(event, data, namespace=DRONE_NAMESPACE)

    # ---- connection

    def hello(self) -> dict[str, Any]:
        """The ``auth`` sent at every (re)connect, with the turns still running here (or whose
        ending the relay has yet to confirm)."""
        running = self.orders.running_ids() if self.orders is not None else []
        running += [t for t in self.deliveries.turns() if t not in running]
        record = self.record.model_copy(update={"history_cache": True})
        hello = DroneHello(
            **record.model_dump(), token=self.token, instance=self.instance, running=running
        )
        return hello.wire()

    def next_url(self) -> str:
        """The relay to try next: the relays given take turns, so a dead one is skipped."""
        self.url = self.urls[self._attempts % len(self.urls)]
        self._attempts += 1
        return self.url

    async def connect(self) -> None:
        """Connect to the first relay that answers; raise ``ConnectionError`` if none does,
        ``DroneRefusedError`` if one refuses this drone."""
        for _ in self.urls:
            if self.sio.connected:  # python-socketio's own reconnect got there meanwhile
                return
            try:
                await self.sio.connect(
                    self.next_url,
                    auth=self.hello,
                    namespaces=[DRONE_NAMESPACE],
                    transports=["websocket"],
                )
            except socketio.exceptions.ConnectionError:
                if self.refusal:
                    raise DroneRefusedError(self.refusal) from None
                continue
            except ValueError:  # a connect under way: python-socketio's own, after a drop
                if self.sio.connected:
                    return
                continue
            self._attempts = self.urls.index(self.url)  # reconnect to this relay first
            return
        http = self.sio.eio.http  # engineio leaves its HTTP session open after a failed connect
        if http is not None and not http.closed:
            await http.close()
        where = ", ".join(map(without_password, self.urls))
        raise ConnectionError(f"Cannot reach the relay at {where}.")

    def forget_refusal(self) -> None:
        """A refusal that may not hold when the drone comes again (``ALREADY_CONNECTED``)."""
        self.refusal = None
        self.refused.clear()

    async def wait_refused(self) -> str:
        """Return when a reconnect is refused (the token was revoked, say)."""
        # Not sio.wait(): cancelling a task that awaits it would cancel engineio's read loop.
        await self.refused.wait()
        return self.refusal or ""

    async def close(self) -> None:
        """Wait briefly for the relay to confirm what it has yet to, then disconnect."""
        if self.connected.is_set() and not await self.deliveries.settle(SETTLE_ON_CLOSE):
            log.warning("closing with %d turns' endings unconfirmed", len(self.deliveries.turns()))
        self._closing = True
        self.deliveries.close()
        await self.sio.disconnect()

    async def _on_connect(self) -> None:
        self.refusal = None
        self.cut_off.clear()
        log.info("connected to relay %s as %s", self.url, self.record.drone_id)
        # The relay may have lost what streamed while this drone was away (a restart, another
        # relay): each running turn's text goes again, whole, before anything else of the turn;
        # the relay keeps what it lacks.
        again = [payload for report in self.reports.values() for payload in report.text_so_far()]
        # So do the tool calls waiting for a person (the relay shows them on every page).
        for turn_id, call, depth in self.orders.waiting_calls() if self.orders else []:
            waiting = ToolActivity(
                turn_id=turn_id,
                call_id=call.id,
                name=call.name,
                state="waiting",
                arguments=call.arguments,
                depth=depth,
            )
            again.append(waiting.wire())
        for payload in again:
            try:
                await self.sio.emit(WORK_ORDER_PROGRESS, payload, namespace=DRONE_NAMESPACE)
            except socketio.exceptions.SocketIOError:
                return  # the connection dropped again; the next connect sends it
        self.connected.set()

    async def _on_disconnect(self, *reason: Any) -> None:
        self.connected.clear()
        if not self._closing:
            self.cut_off.set()
        for answer in self._calls:
            if not answer.done():
                answer.set_exception(ConnectionError("The connection to the relay dropped."))
        (log.info if self._closing else log.warning)("disconnected from relay %s", self.url)
        if self.sio.eio.went_silent and self.url in self.urls:
            # A relay that went silent may be frozen: its kernel still takes connections that
            # it never answers. The others are tried first, within this drone's grace.
            self._attempts = self.urls.index(self.url) + 1
        # python-socketio reconnects by itself after a lost connection, not after the relay
        # dropped this drone: then it is up to the drone (unless the relay said why, for good).
        if reason and reason[0] == self.sio.reason.SERVER_DISCONNECT and not self._closing:
            self.spawn(self._rejoin())

    async def _on_dismissed(self, data: Any = None, *more: Any) -> None:
        reason = data.get("reason") if isinstance(data, dict) else None
        self._refuse(str(reason or "The relay dismissed this drone."))

    async def _rejoin(self) -> None:
        if self._rejoining:
            return
        self._rejoining = True
        try:
            attempt = 0
            while not (self._closing or self.refused.is_set() or self.sio.connected):
                await asyncio.sleep(REJOIN_DELAYS[min(attempt, len(REJOIN_DELAYS) - 1)])
                attempt += 1
                if self.sio.eio.state != "disconnected":
                    continue  # the dropped connection is still being torn down
                try:
                    await self.connect()
                except DroneRefusedError as error:
                    self._refuse(str(error))
                except (ConnectionError, ValueError):  # ValueError: a connect already under way
                    log.info("relay still unreachable; trying again")
        finally:
            self._rejoining = False

    def _refuse(self, reason: str) -> None:
        self.refusal = reason
        self.refused.set()

    async def _on_connect_error(self, data: Any = None) -> None:
        # The relay's own refusals arrive as {"message": ...}; transport failures as text. A
        # relay that cannot let the drone in just now (its database or Redis does not answer)
        # adds {"data": {"again": true}}: the drone comes again, as after a drop.
        again = (
            isinstance(data, dict)
            and isinstance(data.get("data"), dict)
            and data["data"].get("again") is True
        )
        if again:
            log.info("the relay cannot let this drone in just now: %s", data.get("message"))
        elif isinstance(data, dict):
            self._refuse(str(data.get("message") or "The relay refused this drone."))
            log.debug("relay refused this drone: %s", self.refusal)
        else:
            log.debug("cannot reach the relay: %s", data)
