"""The pipes between a drone and its worker processes: length-prefixed JSON frames.

Each frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON. The drone writes
one message per frame to a worker's stdin (``["order", …]``, ``["abort", turn, mode]``, …); a
worker writes a list of events per frame to its stdout, so a burst of text costs the drone one
read and one decode. JSON, not pickle: what a worker writes can never run code in the drone.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, BinaryIO

HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30
"""Larger than any work order the relay may send (its history is bounded well below)."""


class FrameError(Exception):
    """The other end wrote something that is not a frame: it is not a worker of this drone."""


def frame(value: Any) -> bytes:
    """``value`` as one frame."""
    return frame_bytes(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def frame_bytes(payload: bytes) -> bytes:
    """Already-encoded JSON as one frame."""
    return HEADER.pack(len(payload)) + payload


def _length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise FrameError(f"A frame of {length} bytes is larger than any message.")
    return int(length)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's value; ``EOFError`` once the other end closed its side."""
    try:
        header = await reader.readexactly(HEADER.size)
        payload = await reader.readexactly(_length(header))
    except asyncio.IncompleteReadError:
        raise EOFError from None
    return _decode(payload)


def read_frame_blocking(stream: BinaryIO) -> Any:
    """``read_frame`` for a thread that may block; ``EOFError`` at the end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError
    length = _length(header)
    payload = stream.read(length)
    if len(payload) < length:
        raise EOFError
    return _decode(payload)


def _decode(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError as error:
        raise FrameError(f"A frame is not JSON: {error}.") from None
