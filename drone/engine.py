"""The drone's socket.io client, its websocket read and written by the drone itself.

engine.io's client (``AsyncClient._read_loop_websocket`` and ``_write_loop``) waits for every
frame it reads, and for every packet it sends, through an ``asyncio.wait_for`` (a task each),
and writes each frame with a ``write()`` of its own. Here the reader takes the frames aiohttp has
buffered one after another (``READ_RUN`` at a time), its silence timed by one timer, and the
writer sends everything queued before it waits again in one ``write()``, as the relay's own
loop does (``server/websocket.py``). engine.io's packets, its handlers (a task for each message,
so a handler that waits for the relay never holds up the reader) and its timeouts are kept: a
relay silent for a ping interval and a ping timeout is a lost connection.

Opening a websocket is bounded as well (engine.io's ``request_timeout``, 5 s): a relay that
stopped (frozen, or its machine gone) still completes TCP handshakes in its kernel but never
answers, and aiohttp would wait 5 minutes for it; so a drone that lost such a relay tries the
next one instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import engineio
import socketio
from engineio import base_client, exceptions, packet

from hangar.shared.websocket import READ_RUN, Corked, Silence

LET_IN_WITHIN = 10.0
"""Seconds a connect waits for the relay to let the drone in, once the relay answers."""


class LeanEngineClient(engineio.AsyncClient):  # type: ignore[misc]
    """engine.io's client with the websocket loops above (long-polling is engine.io's own)."""

    went_silent = False
    """The last connection ended because the relay went silent (frozen, or out of reach)."""

    async def _connect_websocket(self, url: str, headers: dict[str, str], path: str) -> bool:
        try:
            async with asyncio.timeout(self.request_timeout):
                return bool(await super()._connect_websocket(url, headers, path))
        except TimeoutError:
            raise exceptions.ConnectionError("The relay did not answer.") from None

    async def _read_loop_websocket(self) -> None:
        reader = asyncio.current_task()
        assert reader is not None
        silence = Silence(reader, self.ping_interval + self.ping_timeout)
        self.went_silent = False
        broken = stranded = False
        read = 0
        try:
            while self.state == "connected" and self.write_loop_task:
                message = await self.ws.receive()
                silence.heard()
                if not isinstance(message.data, str | bytes):
                    broken = True  # closed, or failed
                    break
                try:
                    pkt = packet.Packet(encoded_packet=message.data)
                except (ValueError, TypeError, IndexError):
                    self.logger.info("Unexpected packet from the server, aborting")
                    broken = True
                    break
                await self._receive_packet(pkt)
                read += 1
                if read % READ_RUN == 0:
                    await asyncio.sleep(0)  # let the handlers of this run start
        except asyncio.CancelledError:
            if not silence.fired:
                raise
            reader.uncancel()
            self.logger.warning("Server has stopped communicating, aborting")
            self.went_silent = broken = True
            # The relay's CLOSE began a disconnect here, waiting for the websocket to close:
            # left half done, the client would never connect again.
            stranded = self.state == "disconnecting"
        except Exception as error:
            self.logger.info('Unexpected error receiving packet: "%s", aborting', error)
            broken = True
        finally:
            silence.close()
        if broken:
            await self.queue.put(None)  # the writer ends
            await self._drop()
        await self._read_loop_ended()
        if stranded and self.state == "disconnecting":
            with contextlib.suppress(ValueError):
                base_client.connected_clients.remove(self)
            await self._reset()  # disconnected, the writer's queue emptied for the next one

    async def _drop(self) -> None:
        """Close the websocket at once: a relay that went silent will not answer the close (and
        a connection left open is a warning when the garbage collector finds it)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0):  # cancels the wait for the relay's answer
                await self.ws.close()

    async def _read_loop_ended(self) -> None:
        """engine.io's own end of its read loop: the writer ends, then the connection."""
        if self.write_loop_task:
            await self.write_loop_task
        if self.state == "connected":
            await self._trigger_event("disconnect", self.reason.TRANSPORT_ERROR, run_async=False)
            with contextlib.suppress(ValueError):
                base_client.connected_clients.remove(self)
            await self._reset()

    async def _write_loop(self) -> None:
        if self.current_transport != "websocket":
            await super()._write_loop()
            return
        limit = max(self.ping_interval, self.ping_timeout) + 5
        frames = self.ws._writer
        while self.state == "connected":
            try:
                batch = [self.queue.get_nowait()]
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(limit):
                        batch = [await self.queue.get()]
                except TimeoutError:
                    self.logger.error("packet queue is empty, aborting")
                    break
                except asyncio.CancelledError:
                    break
            while batch[-1] is not None and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for _ in batch:
                self.queue.task_done()
            packets: list[Any] = batch[:-1] if batch[-1] is None else batch
            try:
                with Corked(frames):
                    for pkt in packets:
                        if pkt.binary:
                            await self.ws.send_bytes(pkt.encode())
                        else:
                            await self.ws.send_str(pkt.encode())
            except (aiohttp.ClientError, OSError):
                self.logger.info("Write loop: WebSocket connection was closed, aborting")
                break
            if batch[-1] is None:
                break  # the connection ends
        self.write_loop_task = None


class RelayClient(socketio.AsyncClient):  # type: ignore[misc]
    """python-socketio's client over ``LeanEngineClient``."""

    async def connect(self, *args: Any, wait_timeout: float = LET_IN_WITHIN, **kwargs: Any) -> None:
        """Connect, waiting ``wait_timeout`` for the relay to let the drone in.

        python-socketio's own reconnect, after a lost connection, waits its default of 1 s: a
        relay far away or busy that takes longer let the drone in, then saw it leave, for ever.
        """
        await super().connect(*args, wait_timeout=wait_timeout, **kwargs)

    def _engineio_client_class(self) -> type[engineio.AsyncClient]:
        return LeanEngineClient
