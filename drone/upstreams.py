"""A worker process's model streams, by work order, so that another thread can close them.

A worker's event loop may be busy for a long while (a thousand streams' SDK work, or a request
transform that blocks it for hundreds of milliseconds). An abort read by the worker's control
thread must still close the work order's HTTP stream at once: the thread runs the providers' own
``UpstreamShutdown`` callbacks for that work order, which shut the socket down (a duplicate
descriptor, checked to still be the stream's connection: safe from any thread). The abort itself
then fires on the loop as usual, and the async unwinding follows.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import replace

from hangar.shared.abort import AbortController, AbortError, AbortSignal
from hangar.shared.protocol import ChatMessage

from .providers import ChatEvent, ChatOptions, Provider, ToolSpec
from .providers.base import UpstreamShutdown

WORK_ORDER: ContextVar[str | None] = ContextVar("work_order", default=None)
"""The work order a task runs (set when it is accepted; its tasks inherit it)."""


class _WatchedSignal(AbortSignal):
    """The signal a provider's chat gets: it fires with the chat's own signal, on the loop, and
    keeps aside the provider's socket shutdowns, the only callbacks another thread may run.

    ``cut`` (from the control thread) makes it read as aborted at once, so that a read failing
    on the shut-down socket is the abort, not a failing model service, even before the abort
    itself reaches the loop; it fires there as usual.
    """

    def __init__(self) -> None:
        super().__init__()
        self.shutdowns: list[Callable[[], object]] = []
        self._cut: AbortError | None = None

    @property
    def aborted(self) -> bool:
        return self._cut is not None or super().aborted

    @property
    def reason(self) -> AbortError | None:
        return super().reason or self._cut

    def throw_if_aborted(self) -> None:
        super().throw_if_aborted()
        if self._cut is not None:
            raise self._cut

    def cut(self, reason: AbortError) -> int:
        """Abort the stream from any thread: shut its socket down; returns how many."""
        if self._cut is None:
            self._cut = reason
        shutdowns = list(self.shutdowns)
        for shutdown in shutdowns:
            shutdown()
        return len(shutdowns)

    def add_callback(self, callback: Callable[[], object]) -> Callable[[], None]:
        remove = super().add_callback(callback)
        if not isinstance(getattr(callback, "__self__", None), UpstreamShutdown):
            return remove
        self.shutdowns.append(callback)

        def forget() -> None:
            remove()
            if callback in self.shutdowns:
                self.shutdowns.remove(callback)

        return forget


class _WatchedController(AbortController):
    def __init__(self) -> None:
        super().__init__()
        self.signal: _WatchedSignal = _WatchedSignal()


class Upstreams:
    """``Provider`` around the worker's provider that knows each work order's open streams."""

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.name = provider.name
        self.model = provider.model
        self._lock = threading.Lock()
        self._open: dict[str, set[_WatchedSignal]] = {}

    async def chat(
        self, messages: list[ChatMessage], tools: list[ToolSpec], options: ChatOptions
    ) -> AsyncGenerator[ChatEvent, None]:
        turn_id = WORK_ORDER.get()
        watched = _WatchedController()
        outer = options.signal
        unlink = outer.add_callback(lambda: watched.abort(outer.reason))  # at once if fired
        self._track(turn_id, watched.signal, add=True)
        try:
            stream = self.provider.chat(messages, tools, replace(options, signal=watched.signal))
            async with aclosing(stream) as events:
                async for event in events:
                    yield event
        finally:
            unlink()
            self._track(turn_id, watched.signal, add=False)

    async def close(self) -> None:
        await self.provider.close()

    def shut_down(self, reason: AbortError, turn_id: str | None = None) -> int:
        """Abort ``turn_id``'s open streams (every work order's if None) from any thread: their
        sockets are shut down, and they read as aborted for ``reason``; returns how many
        sockets it reached."""
        with self._lock:
            chosen = [
                signal
                for turn, signals in self._open.items()
                if turn_id is None or turn == turn_id
                for signal in signals
            ]
        return sum(signal.cut(reason) for signal in chosen)

    def _track(self, turn_id: str | None, signal: _WatchedSignal, *, add: bool) -> None:
        if turn_id is None:
            return  # not a work order's stream: nothing asks for it by turn
        with self._lock:
            if add:
                self._open.setdefault(turn_id, set()).add(signal)
                return
            signals = self._open.get(turn_id)
            if signals is not None:
                signals.discard(signal)
                if not signals:
                    del self._open[turn_id]
