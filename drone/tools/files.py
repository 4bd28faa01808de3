"""File tools, confined to the work directory: a path that escapes it is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

from .errors import ToolError

MAX_READ_CHARS = 100_000
MAX_ENTRIES = 500


def confine(workdir: Path, path: str) -> Path:
    """The real path of ``path`` inside ``workdir``; refuses anything outside (.., symlinks)."""
    root = workdir.resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise ToolError(f"The path {path!r} is outside the work directory.")
    return target


async def read_file(workdir: Path, path: str) -> str:
    target = confine(workdir, path)
    if not target.is_file():
        raise ToolError(f"There is no file {path!r}.")
    text = await asyncio.to_thread(target.read_text, encoding="utf-8", errors="replace")
    if len(text) > MAX_READ_CHARS:
        return text[:MAX_READ_CHARS] + f"\n[… {len(text) - MAX_READ_CHARS} more characters]"
    return text


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
        target.write_text(content, encoding="utf-8")

    await asyncio.to_thread(write)
    return f"Wrote {len(content)} characters to {path}."
