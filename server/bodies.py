"""Request bodies a client sends: read whole, and refused with a 400 when they cannot be read.

aiohttp decodes a body as it comes in (``Content-Encoding``, ``Transfer-Encoding: chunked``).
One that does not decode (a plain body said to be gzip, a chunk whose size is no number) fails
the route's read of it with ``RequestPayloadError``; one it cannot decode at all (``br`` with no
Brotli installed), or broken from its first chunk, aiohttp answers 400 itself. It logged each as
an ERROR with a traceback, as it would the relay's own failure, and once more after a route had
answered (it reads on to the body's end): ``ClientFaults`` makes that one line at INFO.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import engineio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from engineio import packet as eio_packet
from engineio import payload as eio_payload
from multidict import MultiDictProxy

log = logging.getLogger("hangar.relay")

UNREADABLE: tuple[type[Exception], ...] = (RequestPayloadError, HttpProcessingError)
"""What aiohttp raises for a body (or a request) that cannot be read as it was sent."""
UNREADABLE_BODY = "The request's body could not be read."
Form = MultiDictProxy[str | bytes | bytearray | web.FileField]


async def form_of(request: web.BaseRequest) -> Form | None:
    """The form ``request`` posts, or None when it cannot be read."""
    try:
        return await request.post()
    except (ValueError, LookupError):  # not UTF-8, an unknown charset, no boundary
        return None
    except UNREADABLE:  # a body that does not decode
        return None


@web.middleware
async def unreadable_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A route that fails to read its body answers 400, whichever route it is."""
    try:
        return await handler(request)
    except UNREADABLE:
        raise web.HTTPBadRequest(text=UNREADABLE_BODY) from None


class ClientFaults(logging.Filter):
    """aiohttp's lines about a request it could not read (``UNREADABLE``) are INFO, with no
    traceback: the client's doing. Its other lines keep their level."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, UNREADABLE) and record.levelno > logging.INFO:
            said = " ".join(str(error).split()).removeprefix("400, message: ")
            record.msg, record.args = "refused a request that cannot be read (%s)", (said[:200],)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


CLIENT_FAULTS = ClientFaults()


def quiet_client_faults() -> None:
    """Put ``ClientFaults`` on aiohttp's server log (once, however many relays start)."""
    logging.getLogger("aiohttp.server").addFilter(CLIENT_FAULTS)


CLOSE_PACKET = b"1"  # engine.io's packet for a client closing its connection


class WholeBody:
    """A long-polling POST's body as engine.io reads it (``read(length)``): all of it. aiohttp's
    ``StreamReader.read(n)`` returns what has arrived so far, and a large event, which comes in
    several reads, was cut at the first and refused as malformed. One that cannot be read is
    refused (400), and its connection closed."""

    def __init__(self, request: web.Request, engine: Any) -> None:
        self.request = request
        self.engine = engine
        """The ``engineio.AsyncServer`` the body is for."""

    async def read(self, length: int = -1) -> bytes:
        content = self.request.content
        try:
            body = await (content.read() if length < 0 else content.readexactly(length))
        except asyncio.IncompleteReadError as error:  # the client went away mid-body
            return error.partial
        except UNREADABLE as error:  # not gzip though said to be, a broken chunk
            # engine.io refuses it (400) and closes the connection, but its close waits for the
            # client to poll again, which it may never do: closed here first, at once.
            connection = self.engine.sockets.get(self.request.query.get("sid"))
            if connection is not None:
                await connection.close(wait=False)
            raise engineio.exceptions.EngineIOError(str(error)) from None
        try:  # engine.io decodes it again, but fails on some bodies with a traceback
            packets = eio_payload.Payload(encoded_payload=body.decode()).packets
            if all(0 <= p.packet_type < len(eio_packet.packet_names) for p in packets):
                return body
        except (ValueError, IndexError):
            pass
        log.info("a long-polling body that is not engine.io's: the connection is closed")
        return CLOSE_PACKET  # as a bad websocket frame ends it
