"""python-socketio's server, with every client packet checked before it is handled.

Client input never reaches a log as a traceback:

- a packet that does not decode (not JSON, a number past Python's digit limit, nesting too deep,
  a packet type a client may not send, binary attachments, which Hangar does not use) is dropped,
  answered with an error ack when it carries an ack id;
- an event whose payload is not a list starting with a name, or whose name is one socket.io
  keeps for itself (``connect``, ``disconnect``…), gets an error ack, so a client cannot pass
  itself off as a connection's start or end;
- a connection that sends ``MAX_MALFORMED`` such packets is dropped, and the log says so in a
  line per connection at most every ``LOG_EVERY`` seconds.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from typing import Any

import socketio
from socketio import packet

log = logging.getLogger("hangar.relay")

MAX_MALFORMED = 20
LOG_EVERY = 10.0
RESERVED = frozenset(
    {"connect", "connect_error", "disconnect", "disconnecting", "newListener", "removeListener"}
)
MALFORMED = "Malformed packet."
RESERVED_NAME = "Reserved event name."
# type, optional attachment count, optional namespace, optional ack id: what an error ack needs.
_HEAD = re.compile(r"^(\d)(?:\d+-)?(/[^,]*,)?(\d{1,15})?")


class RelayServer(socketio.AsyncServer):  # type: ignore[misc]
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._malformed: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()
        """Connections dropped for their packets: what they had already sent is ignored."""

    async def _handle_eio_message(self, eio_sid: str, data: Any) -> None:
        """python-socketio's own dispatch, less binary packets, after one decode and check."""
        if eio_sid in self._dropped:
            return
        decoded = _decode(data)
        refusal = _refusal(decoded)
        if decoded is None or refusal is not None:
            await self._refuse(eio_sid, data, refusal or MALFORMED)
        elif decoded.packet_type == packet.EVENT:
            await self._handle_event(eio_sid, decoded.namespace, decoded.id, decoded.data)
        elif decoded.packet_type == packet.ACK:
            await self._handle_ack(eio_sid, decoded.namespace, decoded.id, decoded.data)
        elif decoded.packet_type == packet.CONNECT:
            await self._handle_connect(eio_sid, decoded.namespace, decoded.data)
        else:
            await self._handle_disconnect(eio_sid, decoded.namespace, self.reason.CLIENT_DISCONNECT)

    async def _handle_eio_disconnect(self, eio_sid: str, reason: Any) -> None:
        self._malformed.pop(eio_sid, None)
        self._logged_at.pop(eio_sid, None)
        await super()._handle_eio_disconnect(eio_sid, reason)

    async def _refuse(self, eio_sid: str, data: Any, refusal: str) -> None:
        count = self._malformed[eio_sid] = self._malformed.get(eio_sid, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(eio_sid, -LOG_EVERY) >= LOG_EVERY:
            self._logged_at[eio_sid] = now
            log.info("refused a client packet (%s; %d from this connection)", refusal, count)
        head = _HEAD.match(data) if isinstance(data, str) else None
        if head is not None and head.group(1) == str(packet.EVENT) and head.group(3):
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
    if decoded.attachment_count or decoded.packet_type not in (
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
