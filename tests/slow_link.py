"""A slow network link on loopback, for tests of drones far from their relay."""

from __future__ import annotations

import asyncio
import contextlib


class SlowLink:
    """A TCP hop in front of a port on this machine: every byte coming back from that port
    arrives ``delay`` seconds late (a link with a long round trip; what goes there is not
    held). ``cut()`` breaks every connection through it at once, as a dropped link does."""

    def __init__(self, port: int, delay: float) -> None:
        self.port = port
        self.delay = delay
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listen; returns the link's URL."""
        self.server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def cut(self) -> None:
        for writer in list(self.writers):
            writer.transport.abort()

    async def close(self) -> None:
        """Cut every connection and wait for what was under way to end (``delay`` at most)."""
        if self.server is not None:
            self.server.close()
        self.cut()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.delay + 5)

    async def _carry(self, near: asyncio.StreamReader, near_out: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            far, far_out = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            near_out.transport.abort()
            self.tasks.discard(task)
            return
        self.writers |= {near_out, far_out}
        try:
            await asyncio.gather(
                self._pipe(near, far_out, 0.0), self._pipe(far, near_out, self.delay)
            )
        finally:
            for writer in (near_out, far_out):
                self.writers.discard(writer)
                writer.transport.abort()
            self.tasks.discard(task)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay: float) -> None:
        """Carry ``source`` to ``sink``, each piece ``delay`` seconds after it came, in order."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await pieces.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    sink.transport.abort()
                    return
                sink.write(data)

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                try:
                    data = await source.read(65536)
                except OSError:
                    data = b""
                pieces.put_nowait((loop.time() + delay, data))
                if not data:
                    break
            await delivering
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await delivering
