"""The tools' bounds: memory stays flat however much a command prints or a file holds, and the
file tools refuse what could lead outside the work directory (hard links, FIFOs, devices)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from hangar.drone.tools import ToolError
from hangar.drone.tools.files import (
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_PATH_CHARS,
    MAX_SCANNED,
    list_directory,
    read_file,
    write_file,
)
from hangar.drone.tools.shell import run_shell
from hangar.shared.abort import AbortController, AbortError
from tests.conftest import eventually

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


def exchange(one: Path, other: Path) -> None:
    """Swap two names at once (``renameat2`` with ``RENAME_EXCHANGE``): neither is ever missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_cwd, rename_exchange = -100, 2
    if libc.renameat2(at_cwd, bytes(one), at_cwd, bytes(other), rename_exchange) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


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


EURO = "\\342\\202\\254"
"""'€' in UTF-8, for printf: three bytes."""


def xs(count: int) -> str:
    return f"head -c {count} /dev/zero | tr '\\0' x"


@pytest.mark.parametrize(
    ("command", "ending"),
    [
        (f"{xs(17999)}; printf '{EURO}END'", "x€END"),
        (f"{xs(17999)}; printf '{EURO}'; seq 5000; echo END", "\nEND\n"),
        (f"{xs(18000)}; for i in $(seq 1000); do printf '{EURO}'; done", "€€"),
    ],
    ids=["whole", "cut after the head", "cut in the tail"],
)
async def test_a_character_across_where_the_output_is_cut_is_not_broken(
    workdir: Path, command: str, ending: str
) -> None:
    """A command's first 18,000 and last 2,000 bytes were decoded apart: a character across
    either line came back as U+FFFD, even when no byte was left out."""
    result = await shell(workdir, command)

    assert "\ufffd" not in result
    assert result.endswith(ending)
    assert ("more bytes not shown" in result) == (ending != "x€END")


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


@pytest.mark.parametrize(
    ("content", "left_out"),
    [
        (bytes(range(128, 256)) * 2_000, 156_000),  # no UTF-8 at all: a U+FFFD for each byte
        ("é".encode("latin-1") * 150_000, 50_000),  # another encoding
        ("a€".encode() * 40_000 + b"\xff" * 30_000, 10_000),  # a file that goes bad part-way
    ],
    ids=["binary", "latin-1", "part-way"],
)
async def test_read_file_counts_the_bytes_it_left_out_of_a_file_that_is_not_utf_8(
    workdir: Path, content: bytes, left_out: int
) -> None:
    """A byte that is not UTF-8 is shown as one U+FFFD, which is three bytes in UTF-8: the
    count of the bytes left out came from the text shown, and said 0 of a 300 kB binary file."""
    (workdir / "data.bin").write_bytes(content)

    text = await read_file(workdir, "data.bin")

    assert text.endswith(f"\n[… {left_out} more bytes not shown]")
    assert len(text.partition("\n[…")[0]) == 100_000


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


async def test_a_write_refused_as_outside_makes_no_folder_on_its_way(workdir: Path) -> None:
    with pytest.raises(ToolError, match="outside the work directory"):
        await write_file(workdir, "made/on/../../../escape.txt", "out")

    assert os.listdir(workdir) == []
    assert not (workdir.parent / "escape.txt").exists()


async def test_write_file_still_creates_and_replaces_files(workdir: Path) -> None:
    assert await write_file(workdir, "sub/new.txt", "a longer first text") == (
        "Wrote 19 characters to sub/new.txt."
    )
    await write_file(workdir, "sub/new.txt", "short")

    assert await read_file(workdir, "sub/new.txt") == "short"


async def test_file_tools_stay_inside_while_a_command_swaps_a_folder_for_a_symlink(
    workdir: Path, tmp_path: Path
) -> None:
    """Another turn's command may swap a folder for a symlink to anywhere between the tool's
    check and its open: no read or write may land outside the work directory."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOP SECRET OUTSIDE")
    (workdir / "real").mkdir()
    (workdir / "real" / "secret.txt").write_text("inside")
    (workdir / "link").symlink_to(outside)
    stop = threading.Event()

    def swap() -> None:  # bounded by ``stop``: "real" is a folder, then the link, and back
        while not stop.is_set():
            exchange(workdir / "real", workdir / "link")

    swapper = threading.Thread(target=swap)
    swapper.start()
    read: list[str] = []
    try:
        for number in range(400):
            with contextlib.suppress(ToolError):
                read.append(await read_file(workdir, "real/secret.txt"))
            with contextlib.suppress(ToolError):
                await write_file(workdir, f"real/written{number}.txt", "x")
    finally:
        stop.set()
        swapper.join(10)

    assert read and set(read) == {"inside"}
    assert sorted(path.name for path in outside.iterdir()) == ["secret.txt"]


async def test_file_tools_follow_symlinks_that_stay_inside_and_take_absolute_paths_there(
    workdir: Path, tmp_path: Path
) -> None:
    (workdir / "src").mkdir()
    (workdir / "src" / "main.py").write_text("print('hi')")
    (workdir / "code").symlink_to("src")
    (workdir / "main").symlink_to(workdir / "src" / "main.py")
    (workdir / "away").symlink_to(tmp_path)

    assert await read_file(workdir, "code/main.py") == "print('hi')"
    assert await read_file(workdir, "main") == "print('hi')"
    assert await read_file(workdir, "src/../code/./main.py") == "print('hi')"
    assert await read_file(workdir, str(workdir / "src" / "main.py")) == "print('hi')"
    await write_file(workdir, "code/new/deeper.txt", "made")
    assert (workdir / "src" / "new" / "deeper.txt").read_text() == "made"
    for path in ("away/x.txt", "../x.txt", "code/../../x.txt", str(tmp_path / "x.txt")):
        with pytest.raises(ToolError) as refused:
            await write_file(workdir, path, "escaped")
        assert str(refused.value) == f"The path {path!r} is outside the work directory."
    assert not (tmp_path / "x.txt").exists()


async def test_an_absolute_path_is_followed_one_folder_at_a_time_as_a_relative_one_is(
    workdir: Path,
) -> None:
    """An absolute path lost its ".." before its symlinks were followed: "fwd/sub/up/../ok.txt"
    (``up`` a link to "..") read fwd/sub/ok.txt written absolute, ok.txt written relative (as
    the system reads it), and "gone/../ok.txt" read ok.txt though "gone" does not exist."""
    (workdir / "fwd" / "sub").mkdir(parents=True)
    (workdir / "fwd" / "sub" / "up").symlink_to("..")
    (workdir / "ok.txt").write_text("top")
    (workdir / "fwd" / "ok.txt").write_text("fwd")
    (workdir / "fwd" / "sub" / "ok.txt").write_text("sub")

    assert await read_file(workdir, "fwd/sub/up/../ok.txt") == "top"
    assert await read_file(workdir, str(workdir / "fwd/sub/up/../ok.txt")) == "top"
    for path in ("gone/../ok.txt", str(workdir / "gone/../ok.txt")):
        with pytest.raises(ToolError):
            await read_file(workdir, path)


async def test_a_listing_shows_symlinks_as_themselves_and_nothing_of_where_they_lead(
    workdir: Path, tmp_path: Path
) -> None:
    (workdir / "folder").mkdir()
    (workdir / "to-a-folder").symlink_to(tmp_path)
    (workdir / "to-nothing").symlink_to(tmp_path / "does-not-exist")

    listing = await list_directory(workdir)

    assert listing == "folder/\nto-a-folder\nto-nothing"


async def test_a_listing_of_a_huge_folder_is_bounded_and_an_abort_stops_it(workdir: Path) -> None:
    for number in range(MAX_SCANNED + 1):
        os.close(os.open(workdir / f"f{number:06}", os.O_CREAT | os.O_WRONLY, 0o644))

    listing = await list_directory(workdir)
    with AbortController() as controller:
        listing_again = asyncio.ensure_future(list_directory(workdir, ".", controller.signal))
        await asyncio.sleep(0)  # it has started
        controller.abort()
        with pytest.raises(AbortError):
            await asyncio.wait_for(listing_again, 5)

    lines = listing.splitlines()
    assert len(lines) == MAX_ENTRIES + 1
    assert lines[-1] == f"[… more than {MAX_SCANNED - MAX_ENTRIES} more entries, not all read]"


async def test_a_write_of_text_that_is_not_unicode_leaves_the_file_as_it_was(
    workdir: Path,
) -> None:
    (workdir / "keep.txt").write_text("precious")

    with pytest.raises(ToolError) as refused:
        await write_file(workdir, "keep.txt", "new \ud800 text")

    assert str(refused.value) == "The content is not valid Unicode text; nothing was written."
    assert (workdir / "keep.txt").read_text() == "precious"


async def test_a_path_too_deep_or_too_long_or_ending_in_a_slash_is_refused_and_makes_nothing(
    workdir: Path,
) -> None:
    deep = "d/" * (MAX_DEPTH + 2) + "f.txt"
    long = "x" * (MAX_PATH_CHARS + 1)
    refusals = {
        deep: f"A path may go {MAX_DEPTH} folders deep at most.",
        long: f"A path may be {MAX_PATH_CHARS} characters long at most.",
        "notes/": "'notes/' names a directory, not a file.",
    }
    for path, refusal in refusals.items():
        with pytest.raises(ToolError) as refused:
            await write_file(workdir, path, "text")
        assert str(refused.value) == refusal
    assert not (workdir / "d").exists() and not (workdir / "notes").exists()


def sleeping(seconds: str) -> list[int]:
    """Pids of live ``sleep <seconds>`` processes (the duration is unique to a test)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # gone while it was read
            alive = (entry / "stat").read_text().rsplit(") ", 1)[-1][0] != "Z"
            if alive and (entry / "cmdline").read_bytes() == f"sleep\0{seconds}\0".encode():
                found.append(int(entry.name))
    return found


async def test_a_command_that_times_out_keeps_what_it_printed_and_is_ended(workdir: Path) -> None:
    """A command stopped at its time limit came back as only "The command timed out after
    300 s.": everything it had printed was lost, so the model could not tell how far it got."""
    marker = str(random.randint(10**8, 10**9))
    command = f"seq 1 200000; echo got this far; sleep {marker}"

    with AbortController() as controller, pytest.raises(ToolError) as timed_out:
        await run_shell(workdir, command, controller.signal, 2)

    message = str(timed_out.value)
    head, dropped, tail = message.partition(" more bytes not shown …]\n")
    assert head.startswith("The command timed out after 2 s. Its output until then:\n1\n2\n3\n")
    assert dropped and "\n199999\n200000\ngot this far\n" in tail  # then maybe "Terminated"
    assert len(message) < 20_100
    await eventually(lambda: not sleeping(marker), timeout=2, what="the command to end")


async def test_a_path_ending_in_slash_dot_names_a_directory_not_the_file_before_it(
    workdir: Path,
) -> None:
    """The "." at the end of "real.txt/." was dropped: read_file read the file real.txt, and
    write_file made a file "newname" for "newname/.", as it did for a symlink to "newname/"."""
    (workdir / "real.txt").write_text("the text")
    (workdir / "to-real").symlink_to("real.txt/.")
    (workdir / "to-new").symlink_to("newname/")
    (workdir / "to-new-dot").symlink_to("newname/.")

    for path in ("real.txt/.", "to-real", "./real.txt/./."):
        with pytest.raises(ToolError) as reading:
            await read_file(workdir, path)
        assert str(reading.value) == f"{path!r} names a directory, not a file."
    for path in ("newname/.", "made/newname/.", "to-new", "to-new-dot", "real.txt/."):
        with pytest.raises(ToolError) as writing:
            await write_file(workdir, path, "new text")
        assert str(writing.value) == f"{path!r} names a directory, not a file."

    assert sorted(os.listdir(workdir)) == ["real.txt", "to-new", "to-new-dot", "to-real"]
    assert await read_file(workdir, "./real.txt") == "the text"


async def test_a_listing_shows_each_name_on_one_line_with_control_characters_escaped(
    workdir: Path,
) -> None:
    """A file named "two\\nlines.txt" was listed as two entries, "two" and "lines.txt", and a
    tab or an escape sequence in a name went to the model as it was."""
    for name in ("two\nlines.txt", "tab\there", "red\x1b[31m", "plain name é.txt", "日本.txt"):
        make(workdir / name)
    make(workdir / "'quoted'")  # as it would show, escaped, were it a name with a control char
    (workdir / "new\nfolder").mkdir()
    os.close(os.open(os.fsencode(workdir) + b"/bad\xff.txt", os.O_CREAT | os.O_WRONLY, 0o644))

    listing = await list_directory(workdir)

    assert listing.split("\n") == [
        "'new\\nfolder'/",
        "\"'quoted'\"",
        "bad\ufffd.txt",
        "plain name é.txt",
        "'red\\x1b[31m'",
        "'tab\\there'",
        "'two\\nlines.txt'",
        "日本.txt",
    ]


async def test_listing_a_file_says_it_is_a_file(workdir: Path) -> None:
    """Listing a file said "There is no directory 'notes.txt'.", as if nothing were there."""
    (workdir / "notes.txt").write_text("notes")

    with pytest.raises(ToolError) as refused:
        await list_directory(workdir, "notes.txt")
    with pytest.raises(ToolError) as missing:
        await list_directory(workdir, "nothing")

    assert str(refused.value) == "'notes.txt' is a file, not a directory."
    assert str(missing.value) == "There is no directory 'nothing'."
