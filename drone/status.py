"""The drone's live status line in a terminal, with log lines scrolling above it."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Protocol

from hangar.shared.logs import OneLine
from hangar.shared.shown import without_password


class Connection(Protocol):
    url: str
    connected: asyncio.Event
    chunks_streamed: int


class Work(Protocol):
    def running_ids(self) -> list[str]: ...


class StatusLine(logging.Handler):
    """One live status line at the bottom of the terminal; each log line clears it, is written
    above it, and the line is drawn again.

    It counts the chunks of model output streamed (a chunk is about a token, not a count of
    tokens: those are in each turn's ending).
    """

    def __init__(self, connection: Connection, work: Work) -> None:
        super().__init__()
        self.connection = connection
        self.work = work
        self.setFormatter(OneLine())

    def text(self) -> str:
        state = "connected to" if self.connection.connected.is_set() else "reconnecting to"
        return (
            f"hangar drone · {state} {without_password(self.connection.url)} · "
            f"{len(self.work.running_ids())}"
            f" running · {self.connection.chunks_streamed} chunks streamed"
        )

    def draw(self) -> None:
        sys.stderr.write("\r\x1b[K" + self.text())
        sys.stderr.flush()

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write("\r\x1b[K" + self.format(record) + "\n")
        self.draw()

    async def run(self) -> None:
        root = logging.getLogger()
        plain = root.handlers[:]
        root.handlers = [self]
        try:
            while True:
                self.draw()
                await asyncio.sleep(0.5)
        finally:
            root.handlers = plain
            sys.stderr.write("\r\x1b[K")
