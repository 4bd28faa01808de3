"""The tools' bounds: memory stays flat however much a command prints or a file holds, and the
file tools refuse what could lead outside the work directory (hard links, FIFOs, devices)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from hangar.drone.tools import ToolError
from hangar.drone.tools.files import read_file, write_file
from hangar.drone.tools.shell import run_shell
from hangar.shared.abort import AbortController

T = TypeVar("T")
GIGABYTE = 1_000_000_000
HARD_LINK_REFUSAL = (
    "The file 'linked.txt' has other hard links; it is refused because it may be outside the "
    "work directory."
)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def resident_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


async def peak_growth_mb(work: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    """Run ``work``; return its result and how far this process's peak RSS rose above the
    RSS before it (the kernel's high-water mark, reset first through clear_refs)."""
    reset_peak()
    before = resident_mb("VmRSS")
    result = await work()
    return result, resident_mb("VmHWM") - before


def make(path: Path) -> Path:
    path.touch()
    return path


async def shell(workdir: Path, command: str) -> str:
    with AbortController() as controller:
        return await run_shell(workdir, command, controller.signal, 120)


async def test_a_command_printing_a_gigabyte_leaves_memory_flat(workdir: Path) -> None:
    command = f"head -c {GIGABYTE} /dev/zero | tr '\\0' x"

    result, growth = await peak_growth_mb(lambda: shell(workdir, command))

    assert growth < 50
    assert result.startswith("exit code 0\nxxxx")
    assert f"\n[… {GIGABYTE - 20_000} more bytes not shown …]\n" in result
    assert len(result) < 20_100


async def test_long_output_keeps_its_head_and_its_tail(workdir: Path) -> None:
    result = await shell(workdir, "seq 1 200000; echo the end >&2")

    head, dropped, tail = result.partition(" more bytes not shown …]\n")
    assert head.startswith("exit code 0\n1\n2\n3\n")
    assert dropped
    assert tail.endswith("199999\n200000\nthe end\n")


async def test_read_file_of_a_huge_file_reads_only_what_it_returns(workdir: Path) -> None:
    os.truncate(make(workdir / "huge.log"), 2 * GIGABYTE)  # sparse: costs no disk

    text, growth = await peak_growth_mb(lambda: read_file(workdir, "huge.log"))

    assert growth < 50
    assert text.endswith(f"\n[… {2 * GIGABYTE - 100_000} more bytes not shown]")
    assert len(text) < 100_100


async def test_read_file_says_how_much_of_a_long_file_it_left_out(workdir: Path) -> None:
    (workdir / "long.txt").write_text("é" * 150_000)  # two bytes a character

    text = await read_file(workdir, "long.txt")

    assert text == "é" * 100_000 + "\n[… 100000 more bytes not shown]"


async def test_file_tools_refuse_a_hard_link_to_a_file_outside_the_work_directory(
    workdir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside-secret.txt"
    outside.write_text("not for the model")
    os.link(outside, workdir / "linked.txt")

    with pytest.raises(ToolError) as reading:
        await read_file(workdir, "linked.txt")
    with pytest.raises(ToolError) as writing:
        await write_file(workdir, "linked.txt", "overwritten")

    assert str(reading.value) == HARD_LINK_REFUSAL
    assert str(writing.value) == HARD_LINK_REFUSAL
    assert outside.read_text() == "not for the model"


async def test_read_file_refuses_a_fifo_at_once_instead_of_hanging(workdir: Path) -> None:
    os.mkfifo(workdir / "pipe")

    with pytest.raises(ToolError) as refused:
        await asyncio.wait_for(read_file(workdir, "pipe"), 5)

    assert str(refused.value) == "'pipe' is not a regular file."


async def test_write_file_still_creates_and_replaces_files(workdir: Path) -> None:
    assert await write_file(workdir, "sub/new.txt", "a longer first text") == (
        "Wrote 19 characters to sub/new.txt."
    )
    await write_file(workdir, "sub/new.txt", "short")

    assert await read_file(workdir, "sub/new.txt") == "short"
