"""File tools, confined to the work directory: a path that escapes it is refused.

A path is resolved first (``..`` and symlinks that leave the directory are refused), then the
file is opened without following a final symlink and checked on the open descriptor: only
regular files, and none with other hard links (a hard link can point outside the directory).
Reads are bounded: a huge file costs only what is returned.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from .errors import ToolError

MAX_READ_CHARS = 100_000
MAX_READ_BYTES = 4 * MAX_READ_CHARS  # UTF-8 is at most 4 bytes a character
MAX_ENTRIES = 500


def confine(workdir: Path, path: str) -> Path:
    """The real path of ``path`` inside ``workdir``; refuses anything outside (.., symlinks)."""
    root = workdir.resolve()
    try:
        target = (root / path).resolve()
    except (ValueError, OSError, RuntimeError) as error:  # a NUL character, a symlink loop
        raise ToolError(f"The path {path!r} cannot be used: {error}.") from None
    if not target.is_relative_to(root):
        raise ToolError(f"The path {path!r} is outside the work directory.")
    return target


def _open(target: Path, path: str, flags: int) -> int:
    """Open ``target`` (no final symlink, no blocking on a FIFO) and check what it is."""
    try:
        fd = os.open(target, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        raise ToolError(f"There is no file {path!r}.") from None
    except IsADirectoryError:
        raise ToolError(f"{path!r} is a directory.") from None
    except OSError as error:
        raise ToolError(f"The file {path!r} cannot be opened: {error.strerror}.") from None
    try:
        status = os.fstat(fd)
        if stat.S_ISDIR(status.st_mode):
            raise ToolError(f"{path!r} is a directory.")
        if not stat.S_ISREG(status.st_mode):
            raise ToolError(f"{path!r} is not a regular file.")
        if status.st_nlink > 1:
            raise ToolError(
                f"The file {path!r} has other hard links; it is refused because it may be "
                "outside the work directory."
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(target: Path, path: str) -> str:
    fd = _open(target, path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as file:
        size = os.fstat(fd).st_size
        data = file.read(MAX_READ_BYTES)
    text = data.decode("utf-8", errors="replace")
    if len(text) > MAX_READ_CHARS:
        kept = len(text[:MAX_READ_CHARS].encode("utf-8", errors="replace"))
        return text[:MAX_READ_CHARS] + f"\n[… {max(size - kept, 0)} more bytes not shown]"
    if size > len(data):
        return text + f"\n[… {size - len(data)} more bytes not shown]"
    return text


async def read_file(workdir: Path, path: str) -> str:
    target = confine(workdir, path)
    return await asyncio.to_thread(_read, target, path)


async def list_directory(workdir: Path, path: str = ".") -> str:
    target = confine(workdir, path)
    if not target.is_dir():
        raise ToolError(f"There is no directory {path!r}.")
    entries = sorted(target.iterdir(), key=lambda p: (not p.is_dir(), p.name))
    lines = [p.name + ("/" if p.is_dir() else "") for p in entries[:MAX_ENTRIES]]
    if len(entries) > MAX_ENTRIES:
        lines.append(f"[… {len(entries) - MAX_ENTRIES} more entries]")
    return "\n".join(lines) or "(empty directory)"


async def write_file(workdir: Path, path: str, content: str) -> str:
    target = confine(workdir, path)

    def write() -> None:
        if target.is_dir():
            raise ToolError(f"{path!r} is a directory.")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = _open(target, path, os.O_WRONLY | os.O_CREAT)
        with os.fdopen(fd, "wb") as file:
            file.truncate(0)  # only now: a refused file is left as it was
            file.write(content.encode("utf-8"))

    await asyncio.to_thread(write)
    return f"Wrote {len(content)} characters to {path}."
