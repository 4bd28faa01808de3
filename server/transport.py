"""python-socketio's server, with every client packet checked before it is handled.

Client input never reaches a log as a traceback:

- a packet that does not decode (not JSON, a number past Python's digit limit, nesting too deep,
  a packet type a client may not send) is dropped, answered with an error ack when it carries
  an ack id; so is an event with binary attachments, which Hangar does not use (its ack says
  so; each attachment's frame counts as a packet refused);
- an event whose payload is not a list starting with a name, or whose name is one socket.io
  keeps for itself (``connect``, ``disconnect``…), gets an error ack, so a client cannot pass
  itself off as a connection's start or end;
- a connection that sends ``MAX_MALFORMED`` such packets is dropped, and the log says so in a
  line per connection at most every ``LOG_EVERY`` seconds.

A browser that stops reading costs a bounded amount of memory. engine.io queues what is sent to
each connection without a limit (its writer waits on the socket); here each connection's queue
counts what it holds. Once a browser's holds more than ``BEHIND_EVENTS`` events or
``BEHIND_BYTES``, the relay drops the events queued for it, queues one ``resync`` instead and
sends it nothing more until it has read that; the page then opens its session again (a fresh
snapshot). Answers to its own requests are kept; a connection whose queue holds
``STUCK_BYTES`` even so (it asks and never reads) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import engineio
import socketio
from aiohttp import web
from engineio import packet as eio_packet
from socketio import packet

from hangar.shared.packets import TextPacket
from hangar.shared.protocol import IDE_NAMESPACE, RESYNC, RETRY_LATER

from .bodies import WholeBody
from .limits import QuietLog
from .websocket import PromptCloseWebSocket

log = logging.getLogger("hangar.relay")

MAX_MALFORMED = 20
LOG_EVERY = 10.0
RESERVED = frozenset(
    {"connect", "connect_error", "disconnect", "disconnecting", "newListener", "removeListener"}
)
MALFORMED = "Malformed packet."
BINARY_REFUSED = "Binary attachments are not accepted: send JSON."
RESERVED_NAME = "Reserved event name."
NOT_IN = "Not connected to this namespace: connect to it first."
# type, optional attachment count, optional namespace, optional ack id: what an error ack needs.
_HEAD = re.compile(r"^(\d)(?:\d+-)?(/[^,]*,)?(\d{1,15})?")
BEHIND_EVENTS = 1000
BEHIND_BYTES = 2_000_000
"""Events (or characters of them) queued for one browser past which it is told to resync."""
STUCK_BYTES = 32_000_000
"""Characters queued for one connection past which it is dropped (answers it never reads)."""
BROWSER_EVENT = f"{packet.EVENT}{IDE_NAMESPACE},"  # an event to a browser, as engine.io queues it
behind_log = QuietLog(log)
inline_failures = QuietLog(log)


def browser_event(item: Any) -> bool:
    """Whether a queued engine.io packet is an event to a browser (one that may be dropped)."""
    data = getattr(item, "data", None)
    return isinstance(data, str) and data.startswith(BROWSER_EVENT)


class SendQueue(asyncio.Queue[Any]):
    """engine.io's queue of what goes to one connection, counting what it holds."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self.events = 0
        """Events to a browser queued (what a resync drops)."""
        self.event_chars = 0
        self.chars = 0
        """Characters of every packet queued."""
        self.behind = False
        """A resync was queued: events are dropped until the browser has read it."""

    def _put(self, item: Any) -> None:
        super()._put(item)
        self._count(item, 1)

    def _get(self) -> Any:
        item = super()._get()
        self._count(item, -1)
        return item

    def _count(self, item: Any, sign: int) -> None:
        data = getattr(item, "data", None)
        if isinstance(data, str):
            self.chars += sign * len(data)
            if data.startswith(BROWSER_EVENT):
                self.events += sign
                self.event_chars += sign * len(data)

    def drop(self, events_only: bool = True) -> int:
        """Drop the events queued for a browser (engine.io's own packets and answers stay), or
        every packet (the writer's end-of-queue mark stays)."""
        queued: deque[Any] = self._queue  # type: ignore[attr-defined]
        kept = [i for i in queued if i is None or (events_only and not browser_event(i))]
        dropped = len(queued) - len(kept)
        queued.clear()
        queued.extend(kept)
        self.events = self.event_chars = 0
        self.chars = sum(len(i.data) for i in kept if isinstance(getattr(i, "data", None), str))
        for _ in range(dropped):
            self.task_done()
        return dropped


class RelayEngine(engineio.AsyncServer):  # type: ignore[misc]
    """engine.io's server, with a counting queue per connection and a prompt close."""

    _async: dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        translate = self._async["translate_request"]

        def translate_request(request: web.Request) -> dict[str, Any]:
            environ: dict[str, Any] = translate(request)
            environ["wsgi.input"] = WholeBody(request, self)
            return environ

        self._async = {
            **self._async,
            "websocket": PromptCloseWebSocket,
            "translate_request": translate_request,
        }

    def create_queue(self, *args: Any, **kwargs: Any) -> SendQueue:
        return SendQueue(*args, **kwargs)


InlineHandler = Callable[[str, list[Any]], "asyncio.Future[Any] | dict[str, Any] | None"]
"""Handles a connection's event (``[name, *args]``) without waiting: its answer, now or later,
or None to leave the event to python-socketio's dispatch."""


class RelayServer(socketio.AsyncServer):  # type: ignore[misc]
    """python-socketio's server, with the checks above. A namespace may take its events in the
    connection's reader (``handle_inline``), in the order they came, without the task
    python-socketio starts per event: the drones' reports, which join their turn's lane at once
    (measured: that task and its dispatch were a sixth of the relay's work per event)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**{"serializer": TextPacket, **options})
        self._inline: dict[str, InlineHandler] = {}
        self._malformed: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()
        """Connections dropped for their packets: what they had already sent is ignored."""
        self.resyncs = 0
        """Browsers told to resync so far (each time one fell behind)."""

    def _engineio_server_class(self) -> type[engineio.AsyncServer]:
        return RelayEngine

    def handle_inline(self, namespace: str, handler: InlineHandler) -> None:
        self._inline[namespace] = handler

    async def emit(
        self,
        event: str,
        data: Any = None,
        to: Any = None,
        room: Any = None,
        skip_sid: Any = None,
        namespace: str | None = None,
        callback: Any = None,
        ignore_queue: bool = False,
    ) -> None:
        """python-socketio's ``emit``; an event for this relay's clients only (no other relay
        to tell, no answer awaited) is put straight into each recipient's queue (below)."""
        here = ignore_queue or type(self.manager).emit is socketio.AsyncManager.emit
        if callback is not None or not here:
            await super().emit(
                event, data, to, room, skip_sid, namespace, callback, ignore_queue=ignore_queue
            )
            return
        namespace = namespace or "/"
        if namespace not in self.manager.rooms:
            return
        args = list(data) if isinstance(data, tuple) else [] if data is None else [data]
        encoded = self.packet_class(packet.EVENT, namespace=namespace, data=[event, *args])
        message = eio_packet.Packet(eio_packet.MESSAGE, encoded.encode())
        skip = skip_sid if isinstance(skip_sid, list) else [skip_sid]
        # What python-socketio's manager does, less a task per recipient and the wait for
        # them all: a put into a connection's queue never waits.
        for sid, eio_sid in self.manager.get_participants(namespace, to or room):
            if sid not in skip:
                await self._send_eio_packet(eio_sid, message)

    async def _send_packet(self, eio_sid: str, pkt: packet.Packet) -> None:
        event = pkt.packet_type == packet.EVENT and pkt.namespace == IDE_NAMESPACE
        if self._room_for(eio_sid, event):
            await super()._send_packet(eio_sid, pkt)

    async def _send_eio_packet(self, eio_sid: str, eio_pkt: eio_packet.Packet) -> None:
        if self._room_for(eio_sid, browser_event(eio_pkt)):
            await super()._send_eio_packet(eio_sid, eio_pkt)

    def _room_for(self, eio_sid: str, event: bool) -> bool:
        """Whether to queue a packet for the connection: not an event for a browser that fell
        behind (it is told to resync once), nothing for one that never reads its answers."""
        queue = getattr(self.eio.sockets.get(eio_sid), "queue", None)
        if not isinstance(queue, SendQueue):
            return True
        if not event:
            if queue.chars < STUCK_BYTES:
                return True
            behind_log.warning("dropped a connection that does not read (%d queued)", queue.chars)
            self.start_background_task(self._drop, eio_sid)
            return False
        if queue.behind:
            if queue.events:
                return False  # it has not read the resync yet
            queue.behind = False
            return True
        if queue.events < BEHIND_EVENTS and queue.event_chars < BEHIND_BYTES:
            return True
        dropped = queue.drop()
        notice = self.packet_class(packet.EVENT, namespace=IDE_NAMESPACE, data=[RESYNC, {}])
        queue.put_nowait(eio_packet.Packet(eio_packet.MESSAGE, data=notice.encode()))
        queue.behind = True
        self.resyncs += 1
        behind_log.warning("a browser fell behind: %d events dropped, told to resync", dropped)
        return False

    async def _handle_eio_message(self, eio_sid: str, data: Any) -> None:
        """python-socketio's own dispatch, less binary packets, after one decode and check."""
        if eio_sid in self._dropped:
            return
        decoded = _decode(data)
        refusal = _refusal(decoded)
        if decoded is None or refusal is not None:
            await self._refuse(eio_sid, data, refusal or MALFORMED)
        elif decoded.packet_type == packet.EVENT:
            namespace = decoded.namespace or "/"
            sid = self.manager.sid_from_eio_sid(eio_sid, namespace)
            if sid is None or not self.manager.is_connected(sid, namespace):
                if decoded.id is not None:  # python-socketio would drop it, unanswered
                    self._ack_now(eio_sid, namespace, decoded.id, {"ok": False, "error": NOT_IN})
            elif not self._handled_inline(eio_sid, sid, namespace, decoded):
                await self._handle_event(eio_sid, decoded.namespace, decoded.id, decoded.data)
        elif decoded.packet_type == packet.ACK:  # an answer of no arguments may come as none
            data = decoded.data if isinstance(decoded.data, list) else [decoded.data]
            await self._handle_ack(eio_sid, decoded.namespace, decoded.id, data)
        elif decoded.packet_type == packet.CONNECT:
            await self._handle_connect(eio_sid, decoded.namespace, decoded.data)
        else:
            await self._handle_disconnect(eio_sid, decoded.namespace, self.reason.CLIENT_DISCONNECT)

    def _handled_inline(
        self, eio_sid: str, sid: str, namespace: str, decoded: packet.Packet
    ) -> bool:
        """Whether the event of ``sid``, connected to ``namespace``, was taken here."""
        handler = self._inline.get(namespace)
        if handler is None:
            return False
        try:
            answer = handler(sid, decoded.data)
        except Exception as error:  # the relay's own trouble: one line, not a traceback
            inline_failures.warning("event failed (%s: %s)", type(error).__name__, error)
            answer = {"ok": False, "error": RETRY_LATER, "retry": True}  # the drone sends it again
        if answer is None:
            return False
        if decoded.id is not None:
            if isinstance(answer, asyncio.Future):

                def ack(done: asyncio.Future[Any], ack_id: int = decoded.id) -> None:
                    if not done.cancelled():
                        self._ack_now(eio_sid, namespace, ack_id, done.result())

                answer.add_done_callback(ack)
            else:
                self._ack_now(eio_sid, namespace, decoded.id, answer)
        return True

    def _ack_now(self, eio_sid: str, namespace: str, ack_id: int, answer: Any) -> None:
        """Queue an ack for the connection (a put into its queue never waits)."""
        socket = self.eio.sockets.get(eio_sid)
        if socket is None or socket.closed or not self._room_for(eio_sid, False):
            return
        ack = self.packet_class(packet.ACK, namespace=namespace, data=[answer], id=ack_id)
        socket.queue.put_nowait(eio_packet.Packet(eio_packet.MESSAGE, ack.encode()))

    async def _handle_eio_disconnect(self, eio_sid: str, reason: Any) -> None:
        self._malformed.pop(eio_sid, None)
        self._logged_at.pop(eio_sid, None)
        queue = getattr(self.eio.sockets.get(eio_sid), "queue", None)
        if reason == self.eio.reason.PING_TIMEOUT and isinstance(queue, SendQueue):
            # It stopped reading: engine.io's writer may wait on its socket for as long as
            # the connection stays open, and what is queued would never be read.
            queue.drop(events_only=False)
        await super()._handle_eio_disconnect(eio_sid, reason)

    async def _refuse(self, eio_sid: str, data: Any, refusal: str) -> None:
        count = self._malformed[eio_sid] = self._malformed.get(eio_sid, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(eio_sid, -LOG_EVERY) >= LOG_EVERY:
            self._logged_at[eio_sid] = now
            log.info("refused a client packet (%s; %d from this connection)", refusal, count)
        head = _HEAD.match(data) if isinstance(data, str) else None
        kinds = (str(packet.EVENT), str(packet.BINARY_EVENT))
        if head is not None and head.group(1) in kinds and head.group(3):
            namespace = (head.group(2) or "/,")[:-1]
            answer = self.packet_class(
                packet.ACK,
                namespace=namespace,
                data=[{"ok": False, "error": refusal}],
                id=int(head.group(3)),
            )
            await self._send_packet(eio_sid, answer)
        if count >= MAX_MALFORMED:
            log.info("dropped a connection after %d refused packets", count)
            await self._drop(eio_sid)

    async def _drop(self, eio_sid: str) -> None:
        """Close the connection from this end, whatever the client does."""
        self._dropped[eio_sid] = None
        while len(self._dropped) > 1000:
            self._dropped.popitem(last=False)
        socket = self.eio.sockets.pop(eio_sid, None)
        if socket is not None:
            await socket.close(wait=False)
            # engine.io's close only asks the client to hang up; an empty packet ends the
            # connection's writer, which closes the websocket (or answers the long-poll).
            socket.queue.put_nowait(None)


def _decode(data: Any) -> packet.Packet | None:
    if not isinstance(data, str):
        return None
    try:
        return packet.Packet(encoded_packet=data)
    except (ValueError, TypeError, RecursionError, IndexError):
        return None


def _refusal(decoded: packet.Packet | None) -> str | None:
    """Why a client's socket.io packet is refused, or None to handle it."""
    if decoded is None:
        return MALFORMED
    if decoded.attachment_count:
        return BINARY_REFUSED
    if decoded.packet_type not in (
        packet.CONNECT,
        packet.DISCONNECT,
        packet.EVENT,
        packet.ACK,
    ):
        return MALFORMED
    if decoded.packet_type == packet.EVENT:
        payload = decoded.data
        if not isinstance(payload, list) or not payload or not isinstance(payload[0], str):
            return MALFORMED
        if payload[0] in RESERVED:
            return RESERVED_NAME
    return None
