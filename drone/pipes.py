"""The pipes between a drone and its worker processes: length-prefixed JSON frames.

Each frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON. The drone writes
one message per frame to a worker's stdin (``["order", …]``, ``["abort", turn, mode]``, …); a
worker writes a list of events per frame to its stdout, so a burst of text costs the drone one
read and one decode. JSON, not pickle: what a worker writes can never run code in the drone.

``WorkerProcess`` is the drone's end of one worker: its process and the frames written to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
from typing import Any, BinaryIO

from hangar.shared.protocol import whole_text

HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30
"""Larger than any work order the relay may send (its history is bounded well below)."""
READ_LIMIT = 1 << 20
"""The buffer of a worker's stdout in the drone."""


class FrameError(Exception):
    """The other end wrote something that is not a frame: it is not a worker of this drone."""


def frame(value: Any) -> bytes:
    """``value`` as one frame (a lone surrogate in its text, which UTF-8 cannot carry, as
    U+FFFD: a frame is never lost to what a model or a file name held)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return frame_bytes(text.encode())
    except UnicodeEncodeError:
        return frame_bytes(whole_text(text).encode())


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


class WorkerProcess:
    """One worker: its process, what is sent to it before it exists, whether it is up."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.process: asyncio.subprocess.Process | None = None
        self.backlog: list[bytes] = []
        """Frames for a worker being (re)started."""
        self.ready = asyncio.Event()
        self.exited = asyncio.Event()
        self.answered = 0.0
        """When (the loop's time) it last sent anything: ``watch.watch``."""

    async def start(self, settings: bytes) -> asyncio.subprocess.Process:
        self.ready.clear()
        self.exited.clear()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",  # not the drone's folder first on the module path: its commands write there
            "-m",
            "hangar.drone.worker_process",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=READ_LIMIT,
            # A terminal's Ctrl-C is the drone's to handle (it aborts, then closes the pipes),
            # not a worker's, which may still be loading: a process group of its own (uvloop
            # takes no ``process_group``). Not a session of its own: Linux schedules each
            # session's processes as a group, and the worker's lower priority would be lost.
            preexec_fn=os.setpgrp,
        )
        self.process = process
        self.send(settings)
        backlog, self.backlog = self.backlog, []
        for data in backlog:
            self.send(data)
        return process

    def send(self, data: bytes) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            self.backlog.append(data)
            return
        assert process.stdin is not None
        if not process.stdin.is_closing():
            process.stdin.write(data)

    def close(self) -> None:
        """Close the pipe to the worker: it aborts what it still runs and exits."""
        process = self.process
        if process is not None and process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()

    def kill(self) -> None:
        """Kill the worker's process, if it still runs."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    @property
    def name(self) -> str:
        pid = self.process.pid if self.process is not None else "-"
        return f"worker {self.number} (pid {pid})"
