"""Bounded capture of a tool's output: memory stays flat however much a command prints."""

from __future__ import annotations

import asyncio
import codecs

CHUNK = 1 << 16


class BoundedOutput:
    """The first ``head`` and the last ``tail`` bytes of a stream, and how many were between."""

    def __init__(self, head: int, tail: int) -> None:
        self.head_limit = head
        self.tail_limit = tail
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail += chunk
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            self.dropped += excess
            del self.tail[:excess]

    def text(self) -> str:
        """Head and tail as text; a character cut where bytes were left out is left out too
        (counted with them), not shown as U+FFFD."""
        if not self.dropped:
            return (self.head + self.tail).decode("utf-8", errors="replace")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        head = decoder.decode(bytes(self.head))  # holds back a character cut at its end
        held = len(decoder.getstate()[0])
        start = 0
        while start < min(3, len(self.tail)) and 0x80 <= self.tail[start] < 0xC0:
            start += 1  # the rest of a character begun before the tail
        tail = self.tail[start:].decode("utf-8", errors="replace")
        return f"{head}\n[… {self.dropped + held + start} more bytes not shown …]\n{tail}"


async def drain(stream: asyncio.StreamReader, output: BoundedOutput) -> None:
    """Read ``stream`` to its end in bounded chunks, keeping what ``output`` keeps."""
    while chunk := await stream.read(CHUNK):
        output.add(chunk)
