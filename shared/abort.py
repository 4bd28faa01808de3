"""Cancellation as one value passed around: an asyncio take on the web's AbortController.

Every layer that can be stopped takes an ``AbortSignal`` parameter named ``signal``. A signal is
aborted once, with a reason; it never resets. Work is bounded by a scope::

    async with signal.scope(seconds=60) as scope:
        await work(scope.signal)

The scope cancels its task the moment the signal fires (or its deadline passes), turns that
cancellation back into the abort reason at its exit (``uncancel``, as ``asyncio.timeout`` does),
and drops every callback and timer it set up, fired or not. ``any_of``, ``timeout`` and
``linked_controller`` are context managers for the same reason: what they subscribe to is
released when their block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Literal, Self

log = logging.getLogger("hangar.abort")

AbortCause = Literal[
    "person", "operator", "shutdown", "relay", "cut_off", "deadline", "stall", "scope"
]
"""Who or what aborted: a person (Cancel, Esc Esc), the drone's operator (Ctrl-C), a process
shutting down, the relay (it ended the turn itself), the drone being out of touch with every
relay (``--cut-off``), a deadline, a stalled model stream, or the end of the work's own scope
(a sub-agent that finished)."""


class AbortError(Exception):
    """Raised where work stops because its signal was aborted. Not a failure: a normal end."""

    def __init__(
        self, message: str = "The work order was aborted.", *, cause: AbortCause = "person"
    ) -> None:
        super().__init__(message)
        self.cause: AbortCause = cause


class AbortTimeoutError(AbortError):
    """The reason of a deadline (``timeout``, ``scope(seconds=…)``), not a person's abort."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(f"Timed out after {seconds:g} s", cause="deadline")


class AbortSignal:
    """Read side of an abort: check it, wait for it, subscribe to it, or bound work by it."""

    def __init__(self) -> None:
        self._reason: AbortError | None = None
        self._callbacks: list[Callable[[], object]] = []
        self._event: asyncio.Event | None = None

    @property
    def aborted(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> AbortError | None:
        return self._reason

    @property
    def subscribers(self) -> int:
        """How many callbacks wait for this signal (what a scope leaves behind shows here)."""
        return len(self._callbacks)

    def throw_if_aborted(self) -> None:
        """Raise the abort reason (an ``AbortError``) if the signal has fired."""
        if self._reason is not None:
            raise self._reason

    async def wait(self) -> AbortError:
        """Wait until the signal fires; returns the reason."""
        if self._reason is None:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()
        assert self._reason is not None
        return self._reason

    def add_callback(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` once when the signal fires (at once if it already has).

        Returns a function that unsubscribes. A callback that raises is logged; the others run.
        """
        if self._reason is not None:
            _call(callback)
            return _noop
        self._callbacks.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return remove

    def scope(self, seconds: float | None = None) -> AbortScope:
        """Bound the work of the current task by this signal (and ``seconds``, if given)."""
        return AbortScope(self, seconds)

    def _fire(self, reason: AbortError) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        callbacks, self._callbacks = self._callbacks, []
        if self._event is not None:
            self._event.set()
        for callback in callbacks:
            _call(callback)


class AbortController:
    """Write side of an abort: owns one signal and fires it once.

    As a context manager it releases, at exit, its link to a parent (``linked_controller``).
    """

    def __init__(self) -> None:
        self.signal = AbortSignal()
        self._unlink: Callable[[], None] = _noop

    def abort(self, reason: AbortError | None = None) -> bool:
        """Fire the signal. Returns False if it had already fired (aborts are idempotent)."""
        if self.signal.aborted:
            return False
        self._unlink()
        self.signal._fire(reason if reason is not None else AbortError())
        return True

    def close(self) -> None:
        """Stop following the parent; the signal stays as it is."""
        self._unlink()
        self._unlink = _noop

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class DerivedSignal(AbortSignal):
    """A signal made from others (``any_of``, ``timeout``); a context manager that releases
    its subscriptions and timer at exit, or as soon as it fires."""

    def __init__(self) -> None:
        super().__init__()
        self._disposers: list[Callable[[], None]] = []

    def _abort(self, reason: AbortError | None) -> None:
        self.close()
        self._fire(reason if reason is not None else AbortError())

    def close(self) -> None:
        disposers, self._disposers = self._disposers, []
        for dispose in disposers:
            dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def any_of(*signals: AbortSignal) -> DerivedSignal:
    """A signal that fires when the first of ``signals`` fires, with that signal's reason."""
    combined = DerivedSignal()
    for signal in signals:
        if signal.aborted:
            combined._abort(signal.reason)
            return combined

    def follow(source: AbortSignal) -> Callable[[], None]:
        return lambda: combined._abort(source.reason)

    for signal in signals:
        combined._disposers.append(signal.add_callback(follow(signal)))
    return combined


def timeout(seconds: float) -> DerivedSignal:
    """A signal that fires after ``seconds`` with an ``AbortTimeoutError``.

    Must be created inside a running event loop; closing it cancels the timer.
    """
    deadline = DerivedSignal()
    handle = asyncio.get_running_loop().call_later(
        seconds, lambda: deadline._abort(AbortTimeoutError(seconds))
    )
    deadline._disposers.append(handle.cancel)
    return deadline


def release(error: BaseException | None) -> None:
    """Drop the frames an exception that ended some work keeps, and those of the exceptions it
    was raised from or during.

    An abort reason is raised through the work's own frames, whose locals hold the signal that
    holds the reason: without this, all the work's state (an aborted turn's agent, stream and
    request, some 200 objects) stays in reference cycles until the cyclic collector walks it.
    Call it once the work has ended and nothing will read the traceback again.
    """
    pending, seen = [error], set[int]()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += (current.__cause__, current.__context__)
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions


def linked_controller(parent: AbortSignal) -> AbortController:
    """A child controller: aborting it stops only the child; aborting ``parent`` stops both.

    This is how an operation tree is built (a work order's controller hangs off the drone's
    root, a sub-agent's off its parent's). Use it as a context manager, or ``close()`` it, so a
    child that ends unaborted does not stay subscribed to its parent.
    """
    child = AbortController()
    child._unlink = parent.add_callback(lambda: child.abort(parent.reason))
    return child


class AbortScope:
    """``async with signal.scope(seconds) as scope``: the extent of cancellable work.

    When ``scope.signal`` fires (the outer signal fired, or ``seconds`` passed) the task that
    entered the scope is cancelled, so whatever it awaits is interrupted at once; at the exit the
    cancellation becomes the abort reason, raised as an ``AbortError``. Work that finishes before
    the cancellation reaches it keeps its result. Nested scopes of one task hand a cancellation
    to the innermost one whose signal fired; a cancellation from elsewhere passes through.
    """

    def __init__(self, outer: AbortSignal, seconds: float | None) -> None:
        self._outer = outer
        self._seconds = seconds
        self._controller = AbortController()
        self.signal: AbortSignal = self._controller.signal
        self._task: asyncio.Task[object] | None = None
        self._baseline = 0
        self._cancel_requested = False
        self._disposers: list[Callable[[], None]] = []

    async def __aenter__(self) -> Self:
        self._outer.throw_if_aborted()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("An abort scope must be entered inside a task.")
        self._task = task
        self._baseline = task.cancelling()
        _active.setdefault(task, []).append(self)
        controller = self._controller
        self._disposers.append(
            self._outer.add_callback(lambda: controller.abort(self._outer.reason))
        )
        if self._seconds is not None:
            seconds = self._seconds
            handle = asyncio.get_running_loop().call_later(
                seconds, lambda: controller.abort(AbortTimeoutError(seconds))
            )
            self._disposers.append(handle.cancel)
        self._disposers.append(self.signal.add_callback(self._cancel_task))
        return self

    def _cancel_task(self) -> None:
        task = self._task
        if task is None or task.done():
            return
        if any(scope._cancel_requested for scope in _active.get(task, ())):
            return  # one cancellation per task is enough: the innermost fired scope claims it
        self._cancel_requested = True
        task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task = self._task
        assert task is not None
        for dispose in self._disposers:
            dispose()
        self._disposers.clear()
        stack = _active[task]
        owner = next((scope for scope in stack if scope._cancel_requested), None)
        stack.remove(self)
        if not stack:
            del _active[task]
        reason = self.signal.reason
        if owner is None or reason is None:
            return  # no cancellation of ours is on its way
        if exc_type is asyncio.CancelledError:
            owner._cancel_requested = False
            if task.uncancel() > owner._baseline:
                return  # the task was also cancelled from elsewhere: let that through
            raise reason from None
        if owner is not self:
            return  # an outer scope's cancellation: it will claim it
        # The work ended before the cancellation reached it (finished, or failed first):
        # take the cancellation back so it does not land on the code after this block.
        owner._cancel_requested = False
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            if task.cancelling() > self._baseline + 1:
                task.uncancel()
                raise
        task.uncancel()


_active: dict[asyncio.Task[object], list[AbortScope]] = {}
"""The scopes each task is inside, outermost first."""


def _call(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        log.exception("an abort callback failed")


def _noop() -> None:
    return None
