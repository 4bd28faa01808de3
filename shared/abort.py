"""Cancellation as one value passed around: an asyncio take on the web's AbortController.

Every layer that can be stopped takes an ``AbortSignal`` parameter named ``signal``. A signal is
aborted once, with a reason; it never resets. Composition (``any_of``, ``timeout``) lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class AbortError(Exception):
    """Raised where work stops because its signal was aborted. Not a failure: a normal end."""

    def __init__(self, message: str = "The work order was aborted.") -> None:
        super().__init__(message)


class AbortTimeoutError(AbortError):
    """The reason of a ``timeout`` signal: a deadline, as opposed to a person's abort."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(f"Timed out after {seconds:g} s")


class AbortSignal:
    """Read side of an abort: check it, wait for it, race work against it, or subscribe to it."""

    def __init__(self) -> None:
        self._reason: AbortError | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._event: asyncio.Event | None = None

    @property
    def aborted(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> AbortError | None:
        return self._reason

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

    def add_callback(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once when the signal fires (at once if it already has).

        Returns a function that unsubscribes; callbacks must not raise.
        """
        if self._reason is not None:
            callback()
            return _noop
        self._callbacks.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return remove

    async def race(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` unless the signal fires first.

        On abort the pending work is cancelled (so an HTTP read in flight is torn down at once,
        not after the next chunk) and the abort reason is raised.
        """
        if self._reason is not None:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never started; closing it spares a "never awaited" warning
            raise self._reason
        task = asyncio.ensure_future(awaitable)
        if not task.done():
            loop = asyncio.get_running_loop()
            fired: asyncio.Future[None] = loop.create_future()

            def on_abort() -> None:
                # Cancelled inside the abort itself, once: the pending read gets the cancel
                # before anything else it waits on (an EOF, say) arrives, and its clean-up
                # (closing the HTTP connection) is not interrupted by a second cancel.
                task.cancel()
                if not fired.done():
                    fired.set_result(None)

            remove = self.add_callback(on_abort)
            try:
                await asyncio.wait((task, fired), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                remove()
                fired.cancel()
        if task.done() and (self._reason is None or not task.cancelled()):
            return task.result()  # done before the abort: its result stands
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:  # the work failed while being torn down; the abort wins
            pass
        assert self._reason is not None
        raise self._reason

    def _fire(self, reason: AbortError) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        callbacks, self._callbacks = self._callbacks, []
        if self._event is not None:
            self._event.set()
        for callback in callbacks:
            callback()


class AbortController:
    """Write side of an abort: owns one signal and fires it once."""

    def __init__(self) -> None:
        self.signal = AbortSignal()

    def abort(self, reason: AbortError | None = None) -> bool:
        """Fire the signal. Returns False if it had already fired (aborts are idempotent)."""
        if self.signal.aborted:
            return False
        self.signal._fire(reason if reason is not None else AbortError())
        return True


def any_of(*signals: AbortSignal) -> AbortSignal:
    """A signal that fires when the first of ``signals`` fires, with that signal's reason."""
    controller = AbortController()
    for signal in signals:
        if signal.aborted:
            controller.abort(signal.reason)
            return controller.signal
    removers: list[Callable[[], None]] = []

    def follow(source: AbortSignal) -> Callable[[], None]:
        def fire() -> None:
            controller.abort(source.reason)
            for remove in removers:
                remove()

        return fire

    for signal in signals:
        removers.append(signal.add_callback(follow(signal)))
    return controller.signal


def linked_controller(parent: AbortSignal) -> AbortController:
    """A child controller: aborting it stops only the child; aborting ``parent`` stops both.

    This is how an operation tree is built (a sub-agent's controller hangs off its parent's).
    """
    child = AbortController()

    def follow() -> None:
        child.abort(parent.reason)

    remove = parent.add_callback(follow)
    child.signal.add_callback(remove)
    return child


def timeout(seconds: float) -> AbortSignal:
    """A signal that fires after ``seconds`` with an ``AbortTimeoutError``.

    Must be created inside a running event loop.
    """
    controller = AbortController()
    handle = asyncio.get_running_loop().call_later(
        seconds, lambda: controller.abort(AbortTimeoutError(seconds))
    )
    controller.signal.add_callback(handle.cancel)
    return controller.signal


def _noop() -> None:
    return None
