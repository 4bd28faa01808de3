"""File tools, confined to the work directory: a path that escapes it is refused.

A path is walked one part at a time from the open work directory (``openat`` on the directory
reached so far, never following a symlink in the kernel): a symlink is read and its target
walked the same way, and ``..`` above the work directory or a link leading out of it is
refused. So a path is checked where it is opened: another command swapping a folder for a
symlink while the tool runs cannot send it outside. The file is then opened without following
a symlink and checked on the open descriptor: only regular files, and none with other hard
links (a hard link can point outside the directory). Reads and listings are bounded: a huge
file or folder costs only what is returned. Each tool runs in a thread, and an abort stops
waiting for it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hangar.shared.abort import AbortSignal

from .errors import ToolError

MAX_READ_CHARS = 100_000
MAX_READ_BYTES = 4 * MAX_READ_CHARS  # UTF-8 is at most 4 bytes a character
NOT_UTF_8 = {0xDC80 + byte: "\ufffd" for byte in range(128)}
"""The characters ``surrogateescape`` reads a byte that is not UTF-8 as, each a U+FFFD."""
MAX_ENTRIES = 500
MAX_SCANNED = 20_000
"""Entries of a folder read, at most: a listing of a larger one sorts the first it read."""
MAX_LINKS = 40
"""Symlinks followed in one path, at most (the kernel's own limit)."""
MAX_PATH_CHARS = 4096
MAX_DEPTH = 128
"""Folders deep a path may go (each holds a descriptor while the path is walked)."""
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

T = TypeVar("T")


def _outside(path: str) -> ToolError:
    return ToolError(f"The path {path!r} is outside the work directory.")


def _parts(root: Path, path: str, where: str) -> list[str]:
    """``where`` (``path`` or a symlink's target in it) as parts relative to ``root``."""
    if "\0" in where:
        raise ToolError(f"The path {path!r} cannot be used: it contains a NUL character.")
    if len(where) > MAX_PATH_CHARS:
        raise ToolError(f"A path may be {MAX_PATH_CHARS} characters long at most.")
    if not where.startswith("/"):
        return where.split("/")
    if where == str(root):
        return []
    if not where.startswith(f"{root}/"):  # not made to look inside by "..": walked as written
        raise _outside(path)
    return where[len(str(root)) + 1 :].split("/")


def _walk(root: Path, path: str, *, make_folders: bool = False) -> tuple[int, str, bool]:
    """The open folder that holds what ``path`` names, its name there (``"."`` for that
    folder itself), and whether the path ends in ``/`` or ``/.`` after that name (so it names
    a folder). Every symlink on the way is followed inside ``root`` only. With
    ``make_folders``, missing folders on the way are made. The caller closes the folder."""
    pending = deque(_parts(root, path, path))
    if sum(part not in ("", ".", "..") for part in pending) > MAX_DEPTH + 1:
        raise ToolError(f"A path may go {MAX_DEPTH} folders deep at most.")
    if make_folders and _climbs_out(pending):  # refused before a folder is made on its way
        raise _outside(path)
    folders = [os.open(root, DIRECTORY)]
    links = 0
    try:
        while True:
            while pending and pending[0] in ("", "."):
                pending.popleft()
            if not pending:
                return os.dup(folders[-1]), ".", False
            part = pending.popleft()
            if part == "..":
                if len(folders) == 1:
                    raise _outside(path)
                os.close(folders.pop())
                continue
            try:
                target: str | None = os.readlink(part, dir_fd=folders[-1])
            except OSError:  # not a symlink, or not there
                target = None
            if target is not None:
                links += 1
                if links > MAX_LINKS:
                    raise ToolError(f"The path {path!r} cannot be used: too many symlinks.")
                if target.startswith("/"):
                    for folder in folders[1:]:
                        os.close(folder)
                    del folders[1:]
                pending.extendleft(reversed(_parts(root, path, target)))
                continue
            if all(rest in ("", ".") for rest in pending):
                return os.dup(folders[-1]), part, bool(pending)
            if len(folders) > MAX_DEPTH:
                raise ToolError(f"A path may go {MAX_DEPTH} folders deep at most.")
            folders.append(_enter(folders[-1], part, path, make_folders))
    finally:
        for folder in folders:
            os.close(folder)


def _climbs_out(parts: deque[str]) -> bool:
    """Whether ``..`` in ``parts`` leaves the folder they start in, as written."""
    depth = 0
    for part in parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def _enter(parent: int, name: str, path: str, make: bool) -> int:
    """The folder ``name`` in ``parent``, opened (made first if missing and ``make``)."""
    try:
        if make:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=parent)
        return os.open(name, DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        raise ToolError(f"There is no file {path!r}.") from None
    except NotADirectoryError:
        raise ToolError(f"The path {path!r} goes through a file that is not a folder.") from None
    except OSError as error:
        if error.errno == errno.ELOOP:  # a folder became a symlink as it was opened
            raise ToolError(f"The path {path!r} changed while it was opened.") from None
        raise ToolError(f"The path {path!r} cannot be used: {error.strerror}.") from None


def _open(root: Path, path: str, flags: int, *, make_folders: bool = False) -> int:
    """Open the file ``path`` names (no symlink, no blocking on a FIFO) and check what it is."""
    refusal = ToolError(f"{path!r} names a directory, not a file.")
    if path.endswith(("/", "/.")):  # refused before a folder is made on its way
        raise refusal
    folder, name, a_folder = _walk(root, path, make_folders=make_folders)
    try:
        if a_folder:  # a symlink's target ending so
            raise refusal
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(name, flags, 0o644, dir_fd=folder)
    except FileNotFoundError:
        raise ToolError(f"There is no file {path!r}.") from None
    except IsADirectoryError:
        raise ToolError(f"{path!r} is a directory.") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ToolError(f"The path {path!r} changed while it was opened.") from None
        raise ToolError(f"The file {path!r} cannot be opened: {error.strerror}.") from None
    finally:
        os.close(folder)
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


async def _off_loop(work: Callable[[], T], signal: AbortSignal | None) -> T:
    """``work`` in a thread; an abort stops waiting for it (it only reads, or writes one file)."""
    if signal is None:
        return await asyncio.to_thread(work)
    async with signal.scope():
        return await asyncio.to_thread(work)


def _read(root: Path, path: str) -> str:
    fd = _open(root, path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as file:
        size = os.fstat(fd).st_size
        data = file.read(MAX_READ_BYTES)
    # Each byte that is not UTF-8 a character of its own, so the bytes shown are counted
    # exactly (as U+FFFD, three bytes, it made the count of those left out too small).
    text = data.decode("utf-8", errors="surrogateescape")
    shown = text[:MAX_READ_CHARS]
    kept = len(shown.encode("utf-8", "surrogateescape")) if len(text) > len(shown) else len(data)
    shown = shown.translate(NOT_UTF_8)
    return shown + f"\n[… {size - kept} more bytes not shown]" if size > kept else shown


async def read_file(workdir: Path, path: str, signal: AbortSignal | None = None) -> str:
    return await _off_loop(lambda: _read(workdir.resolve(), path), signal)


def _list(root: Path, path: str) -> str:
    folder, name, _ = _walk(root, path)
    try:
        fd = os.open(name, DIRECTORY, dir_fd=folder)
    except FileNotFoundError:
        raise ToolError(f"There is no directory {path!r}.") from None
    except NotADirectoryError:
        raise ToolError(f"{path!r} is a file, not a directory.") from None
    except OSError as error:
        raise ToolError(f"The directory {path!r} cannot be read: {error.strerror}.") from None
    finally:
        os.close(folder)
    entries: list[tuple[bool, str]] = []
    unread = False
    try:
        with os.scandir(fd) as scan:
            for entry in scan:
                if len(entries) == MAX_SCANNED:
                    unread = True
                    break
                # A symlink is listed as itself: where it leads is outside the listing.
                entries.append((not entry.is_dir(follow_symlinks=False), entry.name))
    finally:
        os.close(fd)
    entries.sort()
    lines = [_shown(name) + ("" if is_file else "/") for is_file, name in entries[:MAX_ENTRIES]]
    if unread:
        lines.append(f"[… more than {MAX_SCANNED - MAX_ENTRIES} more entries, not all read]")
    elif len(entries) > MAX_ENTRIES:
        lines.append(f"[… {len(entries) - MAX_ENTRIES} more entries]")
    return "\n".join(lines) or "(empty directory)"


def _shown(name: str) -> str:
    """A name as one line of a listing: one with a character that does not print (a newline,
    a tab, an escape) quoted with Python's escapes, and so is one that starts with a quote, so
    the two cannot be mistaken. A byte that is not UTF-8 is a U+FFFD, as in a file read."""
    name = name.translate(NOT_UTF_8)
    return repr(name) if not name.isprintable() or name.startswith(("'", '"')) else name


async def list_directory(workdir: Path, path: str = ".", signal: AbortSignal | None = None) -> str:
    return await _off_loop(lambda: _list(workdir.resolve(), path), signal)


async def write_file(
    workdir: Path, path: str, content: str, signal: AbortSignal | None = None
) -> str:
    try:  # first: a text that cannot be written leaves the file as it was
        data = content.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError("The content is not valid Unicode text; nothing was written.") from None

    def write() -> None:
        fd = _open(workdir.resolve(), path, os.O_WRONLY | os.O_CREAT, make_folders=True)
        with os.fdopen(fd, "wb") as file:
            file.truncate(0)  # only now: a refused file is left as it was
            file.write(data)

    # Not left to run on after an abort: a write is bounded, and a file half written by a
    # turn already reported aborted could overwrite the next turn's.
    del signal
    await asyncio.to_thread(write)
    return f"Wrote {len(content)} characters to {path}."
