"""Server-sent events read as the standard reads them: UTF-8 with each byte sequence that is no
UTF-8 read as U+FFFD (as httpx reads Ollama's lines), not as an error that ends the stream."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Iterator

from openai._streaming import ServerSentEvent, SSEDecoder


def _valid(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` as valid UTF-8: a character split between two chunks stays whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for chunk in chunks:
        yield decoder.decode(chunk).encode()
    yield decoder.decode(b"", final=True).encode()


async def _valid_async(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async for chunk in chunks:
        yield decoder.decode(chunk).encode()
    yield decoder.decode(b"", final=True).encode()


class ReplacingDecoder(SSEDecoder):
    """The openai SDK's decoder of server-sent events, over bytes made valid UTF-8 (its own
    decodes each line strictly: one byte that is no UTF-8 failed the whole stream). It reads the
    response's bytes after their content encoding (gzip) is undone, whatever the transport.
    ``done`` tells whether the stream's ``[DONE]`` came: the SDK ends the stream there and says
    nothing of it, so a stream that ended whole would not be told from one cut short."""

    def __init__(self) -> None:
        super().__init__()
        self.done = False

    def decode(self, line: str) -> ServerSentEvent | None:
        event = super().decode(line)
        if event is not None and event.data.startswith("[DONE]"):  # as the SDK reads it
            self.done = True
        return event

    def iter_bytes(self, iterator: Iterator[bytes]) -> Iterator[ServerSentEvent]:
        return super().iter_bytes(_valid(iterator))

    def aiter_bytes(self, iterator: AsyncIterator[bytes]) -> AsyncIterator[ServerSentEvent]:
        return super().aiter_bytes(_valid_async(iterator))
