"""Each websocket the relay serves, read and written by the relay itself.

engine.io's handler (``AsyncSocket._websocket_handler``) starts a task and an
``asyncio.wait_for`` for every frame it reads, and its writer another for every wait on its
queue, then writes each frame with a ``write()`` of its own: a message costs the loop a few
turns. Here the reader takes every frame aiohttp has already buffered, one after another in the
order they came (``READ_RUN`` at a time), and the writer sends everything queued before it waits
again, in one ``write()``. engine.io's packets, its upgrade from long-polling and its timeouts
are kept: a connection silent for a ping interval and a ping timeout is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from engineio import exceptions as eio_exceptions
from engineio import packet as eio_packet
from engineio.async_drivers import aiohttp as aiohttp_driver

from hangar.shared.websocket import READ_RUN, Corked, Silence

from .limits import QuietLog

CLOSE_WITHIN = 1.0
"""Seconds a closing websocket waits for the peer's answer before its connection is cut."""
log = logging.getLogger("hangar.relay")
failures = QuietLog(log)


class PromptCloseWebSocket(aiohttp_driver.WebSocket):  # type: ignore[misc]
    """engine.io's aiohttp websocket, served by ``serve_websocket``, whose close waits
    ``CLOSE_WITHIN`` (not aiohttp's 10 s) for the peer's answer: a peer that stopped reading (a
    frozen drone) is cut off within a second, so it sees its connection end the moment it runs
    again."""

    async def __call__(self, environ: dict[str, Any]) -> web.StreamResponse:
        request = environ["aiohttp.request"]
        self._sock = web.WebSocketResponse(
            max_msg_size=self.server.max_http_buffer_size, timeout=CLOSE_WITHIN
        )
        try:
            await self._sock.prepare(request)
        except ConnectionResetError:  # the client left before its upgrade was answered
            log.debug("a websocket's client left before it opened")
            sock = self.handler.__self__
            await sock.close(wait=False, abort=True, reason=sock.server.reason.TRANSPORT_CLOSE)
            return web.Response()  # nobody reads it: aiohttp takes a peer that is gone quietly
        self.environ = environ
        await serve_websocket(self.handler.__self__, self)
        return self._sock


async def serve_websocket(sock: Any, ws: PromptCloseWebSocket) -> None:
    """engine.io's websocket handler for the connection ``sock`` (an ``AsyncSocket``)."""
    server = sock.server
    limit = server.ping_interval + server.ping_timeout
    if sock.connected and not await _upgraded(sock, ws):
        return
    sock.connected = sock.upgraded = True
    writing = asyncio.ensure_future(_write(sock.queue, ws, limit))
    await _read(sock, ws._sock, limit, server.max_http_buffer_size)
    await sock.queue.put(None)  # the writer ends
    await writing
    await sock.close(wait=False, abort=True, reason=server.reason.TRANSPORT_CLOSE)


async def _upgraded(sock: Any, ws: PromptCloseWebSocket) -> bool:
    """engine.io's upgrade of a long-polling connection: its probe, then its upgrade packet."""
    sock.upgrading = True  # packets wait in the queue until the upgrade ends
    try:
        probe = eio_packet.Packet(encoded_packet=await ws.wait())
        if probe.packet_type != eio_packet.PING or probe.data != "probe":
            return False
        await ws.send(eio_packet.Packet(eio_packet.PONG, data="probe").encode())
        await sock.queue.put(eio_packet.Packet(eio_packet.NOOP))  # ends the long-poll
        upgrade = eio_packet.Packet(encoded_packet=await ws.wait())
        return bool(upgrade.packet_type == eio_packet.UPGRADE)
    except (OSError, ValueError, TypeError, IndexError):
        return False
    finally:
        sock.upgrading = False


async def _write(queue: asyncio.Queue[Any], ws: PromptCloseWebSocket, limit: float) -> None:
    """Send what is queued, all of it at once, until the end mark (None) or ``limit`` seconds
    with nothing to send (engine.io's own pings are queued every interval)."""
    frames = ws._sock._writer
    end = False
    while not end:
        try:
            item = queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                async with asyncio.timeout(limit):
                    item = await queue.get()
            except (TimeoutError, asyncio.CancelledError):
                break
        batch = [item]
        while item is not None and not queue.empty():
            item = queue.get_nowait()
            batch.append(item)
        for _ in batch:
            queue.task_done()
        try:
            with Corked(frames):
                for item in batch:
                    if item is None:
                        end = True
                        break
                    await ws.send(item.encode())
        except Exception:
            break
    await ws.close()


async def _read(sock: Any, raw: web.WebSocketResponse, limit: float, largest: int) -> None:
    """Hand each frame the connection sends to engine.io until it closes, fails or stays
    silent for ``limit`` seconds."""
    reader = asyncio.current_task()
    assert reader is not None
    silence = Silence(reader, limit)
    read = 0
    try:
        while True:
            message = await raw.receive()
            silence.heard()
            data = message.data
            if not isinstance(data, str | bytes) or len(data) > largest:
                break  # closed, failed, or larger than engine.io takes
            try:
                decoded = eio_packet.Packet(encoded_packet=data)
            except (ValueError, TypeError, IndexError):
                break  # not engine.io
            if not 0 <= decoded.packet_type < len(eio_packet.packet_names):
                break  # no packet engine.io knows
            try:
                await sock.receive(decoded)
            except eio_exceptions.SocketIsClosedError:
                break
            except eio_exceptions.UnknownPacketError:
                pass
            except Exception as error:  # the relay's own trouble: one line, not a traceback
                failures.warning("event failed (%s: %s)", type(error).__name__, error)
            read += 1
            if read % READ_RUN == 0:
                await asyncio.sleep(0)  # let the writers send what this run queued
    except asyncio.CancelledError:
        if silence.fired:
            reader.uncancel()
        # else: the relay stops; the connection ends here, as engine.io's does
    except RuntimeError:
        pass  # aiohttp: the websocket is closed
    finally:
        silence.close()
