"""Sampling profiles with py-spy (``.venv/bin/pip install py-spy``), summarised as text."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from .common import PYTHON, Proc, Stack

PLUMBING: tuple[str, ...] = (" (<frozen runpy>)", " (runners.py)", " (base_events.py)")
PLUMBING += (" (events.py)", " (hangar_mono.py)", " (cli.py)", " (threading.py)", "thread (")
IDLE = re.compile(
    # A thread waiting, by its leaf frame: asyncio's poll; uvloop's loop, whose C code waits
    # below asyncio's ``Runner.run`` (py-spy shows no Python frame under it, so that frame is
    # the leaf only while no callback runs); a pool worker waiting for work.
    r"(select \(.*selectors\.py:\d+\)$|_worker \(.*concurrent/futures/thread\.py:\d+\)$"
    r"|(?:^|\.)run \(.*asyncio/runners\.py:\d+\)$|run \(.*uvloop/__init__\.py:\d+\)$)"
)


def py_spy(
    stack: Stack, target: Proc, seconds: float, tag: str, subprocesses: bool = False
) -> tuple[Proc, Path]:
    """Sample every thread of ``target`` (and of its child processes, with ``subprocesses``)
    for ``seconds``, without pausing it, idle included."""
    out = stack.workdir / f"{target.name}-{tag}.pyspy"
    binary = Path(PYTHON).parent / "py-spy"
    if not binary.exists():
        raise RuntimeError(f"{binary} is missing: install it with .venv/bin/pip install py-spy")
    args = [str(binary), "record", "--pid", str(target.pid)]
    args += ["--nonblocking", "--threads", "--idle", "--rate", "250"]
    args += ["--subprocesses"] if subprocesses else []
    args += ["--duration", str(int(seconds)), "--format", "raw", "--output", str(out)]
    return stack.spawn(f"py-spy-{target.name}-{tag}", args, python=False), out


def top_frames(path: Path, count: int = 12) -> str:
    """Per thread of a py-spy ``raw`` profile: how busy it was, and the functions most often on
    its stack (inclusive) and on top of it (self) while busy."""
    threads: dict[str, tuple[Counter[str], Counter[str], list[int]]] = {}
    for line in path.read_text().splitlines():
        stack, _, weight = line.rpartition(" ")
        raw = stack.split(";")
        process = ""
        while raw and raw[0].startswith("process "):  # --subprocesses: the process's path
            found = re.match(r'process (\d+):"\S+(?: -m (\S+))?', raw.pop(0))
            process = f" of {found.group(2) or found.group(1)}" if found else ""
        name = re.sub(r"^thread \(\d+\): ", "", raw[0]) + process
        inclusive, own, seen = threads.setdefault(name, (Counter(), Counter(), [0, 0]))
        seen[0] += int(weight)
        if len(raw) < 2 or IDLE.search(raw[-1]):
            continue
        seen[1] += int(weight)
        frames = [re.sub(r" \((?:.*/)?([^/:]+):\d+\)$", r" (\1)", f) for f in raw[1:]]
        inclusive.update({f: int(weight) for f in set(frames)})
        own[frames[-1]] += int(weight)
    lines = [f"{path.name}:"]
    for name, (inclusive, own, (total, busy)) in threads.items():
        lines.append(f"  thread {name}: busy in {busy} of {total} samples")
        for title, counter in (("inclusive", inclusive), ("self", own)):
            top = [(f, n) for f, n in counter.most_common() if not f.endswith(PLUMBING)][:count]
            lines += [f"    {title}:"] + [f"      {n * 100 / busy:5.1f}% {f}" for f, n in top]
    return "\n".join(lines)
