"""How the long-running processes (relay, drone) run: their event loop and garbage collector.

Two things keep an abort's latency flat under load:

- **uvloop** where it is installed (Linux and macOS): the same asyncio API, with a loop and
  transports written in C, so every socket.io hop costs less. ``HANGAR_EVENT_LOOP=asyncio``
  chooses the standard loop instead (any other value but ``uvloop`` is refused).
- **A frozen start-up heap.** CPython's full collections walk every tracked object; after the
  imports (pydantic models, SDK types) that is hundreds of thousands of objects, and a full
  collection stopped a streaming drone for 220-260 ms. ``gc.freeze()`` moves what exists once the
  process is ready into a generation the collector skips; garbage made later is collected as
  before.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import inspect
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .abort import AbortController, AbortError

log = logging.getLogger("hangar")

T = TypeVar("T")

EVENT_LOOP_ENV = "HANGAR_EVENT_LOOP"


class UnknownEventLoop(Exception):
    """``HANGAR_EVENT_LOOP`` names a loop this process cannot run on."""


def event_loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop ``run`` will use (uvloop when it is installed and
    ``HANGAR_EVENT_LOOP`` does not say otherwise)."""
    asked = os.environ.get(EVENT_LOOP_ENV, "").strip().lower()
    if asked == "asyncio":
        return "asyncio"
    if asked not in ("", "uvloop"):
        raise UnknownEventLoop(
            f"hangar: {EVENT_LOOP_ENV}: expected uvloop or asyncio, got {asked!r}."
        )
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if asked:
            raise UnknownEventLoop(f"hangar: {EVENT_LOOP_ENV}: uvloop is not installed.") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion in a new event loop (see the module's docstring).

    Until ``main`` runs, the process has no signal handling of its own: a Ctrl-C meanwhile (as
    uvloop loads, the heap is frozen or the loop is made) raises ``KeyboardInterrupt`` here, as
    it would have while the program loaded, and ``main``, never to run, is closed (else Python
    warns that it was never awaited). ``main`` is the loop's task itself, not awaited by a
    wrapper of uvloop's (``uvloop.run``) that a Ctrl-C could cancel before it got to ``main``.
    """
    try:
        factory = loop_factory(event_loop_name())
        freeze_heap()
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    finally:
        if inspect.getcoroutinestate(main) == inspect.CORO_CREATED:
            main.close()


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the event loop ``name`` (``event_loop_name``); None: asyncio's own."""
    if name != "uvloop":
        return None
    import uvloop

    return uvloop.new_event_loop


def freeze_heap() -> None:
    """Collect what is garbage now, then keep every surviving object out of later collections.

    Call once the process has loaded what it keeps for its lifetime (again after start-up work,
    such as a first connection, if that creates much more).
    """
    gc.collect()
    gc.freeze()


LAST_WORDS: list[Callable[[], None]] = []
"""What a process does even when a second signal stops it at once (removes a folder it made)."""


def abort_on_signals(
    root: AbortController, interrupted: AbortError, terminated: AbortError | None = None
) -> None:
    """Ctrl-C aborts ``root`` with ``interrupted``, SIGTERM and SIGHUP (a closed terminal) with
    ``terminated`` (the same, when not given); a second signal exits at once. A SIGHUP that was
    ignored when the process started (``nohup``) stays ignored; a SIGINT is taken even then
    (``hangar.shared.main``).

    Stopping a process is an abort like any other: whatever runs under ``root`` ends the way a
    person's Cancel ends it, and says who stopped it.
    """
    loop = asyncio.get_running_loop()

    def on_signal(reason: AbortError) -> None:
        if root.signal.aborted:
            for last in LAST_WORDS:
                with contextlib.suppress(Exception):
                    last()
            os._exit(130)
        root.abort(reason)

    loop.add_signal_handler(signal.SIGINT, on_signal, interrupted)
    loop.add_signal_handler(signal.SIGTERM, on_signal, terminated or interrupted)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGHUP, on_signal, terminated or interrupted)


PR_SET_PDEATHSIG = 1


def dies_with(parent: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child of ``parent``, before it runs its program (``preexec_fn``): receive ``sig``
    when ``parent`` ends, however it ends (Linux; elsewhere nothing)."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)
