"""An abort closes the upstream stream inside the abort callback, not later on the event loop.

On a busy drone the cancelled read and the ``finally`` close of the HTTP stream run several
event-loop iterations after the signal fires. The providers shut the stream's TCP socket down in
the abort callback itself, so the FIN leaves at once. Shown here by blocking the drone's loop
right after the abort: the upstream peer, running on a loop of its own in another thread, must see
the disconnect before that block ends.

Each test runs on the standard asyncio loop and on uvloop (what ``hangar drone`` runs on when it
is installed): their transports lend out different socket objects.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
from aiohttp import web

from bench.peers import OllamaPeer, OpenAIPeer, Reply, UpstreamPeer
from bench.peers.base import Handler
from hangar.drone.providers import (
    ChatOptions,
    OllamaProvider,
    OpenAIProvider,
    Provider,
    TextChunk,
    UsageReport,
)
from hangar.shared.abort import AbortController, AbortError, AbortSignal
from hangar.shared.protocol import ChatMessage

T = TypeVar("T")

BUSY = 0.3
"""How long the drone's loop stays blocked after the abort (a loop busy with other streams)."""

ENDLESS = Reply(chunks=["tok "] * 10_000, delay=0.02)
LOOPS = ["asyncio", "uvloop"]
PEERS: dict[str, type[UpstreamPeer]] = {"openai": OpenAIPeer, "ollama": OllamaPeer}


def provider_for(name: str, base_url: str) -> Provider:
    if name == "openai":
        return OpenAIProvider("gpt-test", api_key="test-key", base_url=base_url + "/v1")
    return OllamaProvider("llama-test", host=base_url)


def run_on(loop: str, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to completion on a new event loop of the kind named."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        result: T = uvloop.run(main())
        return result
    return asyncio.run(main())


class PeerThread:
    """An upstream peer served by its own event loop in a thread: it keeps running, and keeps
    recording, while the test's loop is blocked."""

    def __init__(self, peer: UpstreamPeer) -> None:
        self.peer = peer
        self.client_ports: list[int] = []
        """The client-side port of each request's connection, in order."""
        route = peer.route

        def recording_route(handler: Handler) -> Callable[[web.Request], Awaitable[Any]]:
            wrapped = route(handler)

            async def record_port(request: web.Request) -> web.StreamResponse:
                assert request.transport is not None
                self.client_ports.append(request.transport.get_extra_info("peername")[1])
                return await wrapped(request)

            return record_port

        peer.route = recording_route  # type: ignore[method-assign]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="peer", daemon=True)

    def __enter__(self) -> PeerThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.peer.start(), self.loop).result(5)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self.peer.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (a call on the peer) on the peer's loop and await its result here."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop))


async def abort_with_the_loop_blocked(provider: Provider, upstream: PeerThread) -> None:
    controller = AbortController()
    first_chunk = asyncio.Event()

    async def consume() -> None:
        options = ChatOptions(provider.model, controller.signal)
        async for event in provider.chat([ChatMessage(role="user", content="Go on")], [], options):
            if isinstance(event, TextChunk):
                first_chunk.set()

    consumer = asyncio.ensure_future(consume())
    try:
        await asyncio.wait_for(first_chunk.wait(), 5)
        # The consumer is back in its read, waiting for the next chunk, when the abort fires.
        controller.abort()
        # The loop is busy: no other step (the read's cancel, the stream's close) runs until here.
        # Blocking is the point: it stands for the 50 streams of a loaded drone.
        time.sleep(BUSY)  # noqa: ASYNC251
        busy_until = time.monotonic()

        with pytest.raises(AbortError):
            await asyncio.wait_for(consumer, 5)
        disconnected_at = await upstream.run(upstream.peer.wait_for_disconnect())
        request = upstream.peer.last
        assert request is not None and not request.completed

        # time.monotonic() is one clock for both threads; the FIN left inside the abort callback.
        assert disconnected_at < busy_until, (
            f"the upstream saw the disconnect {disconnected_at - busy_until:.3f} s after the"
            " loop was free again: the stream was only closed by the async unwinding"
        )
    finally:
        consumer.cancel()
        await provider.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_openai_abort_disconnects_upstream_while_the_loop_is_blocked(loop: str) -> None:
    with PeerThread(OpenAIPeer(default=ENDLESS)) as upstream:
        provider = provider_for("openai", upstream.peer.base_url)
        run_on(loop, lambda: abort_with_the_loop_blocked(provider, upstream))


@pytest.mark.parametrize("loop", LOOPS)
def test_ollama_abort_disconnects_upstream_while_the_loop_is_blocked(loop: str) -> None:
    with PeerThread(OllamaPeer(default=ENDLESS)) as upstream:
        provider = provider_for("ollama", upstream.peer.base_url)
        run_on(loop, lambda: abort_with_the_loop_blocked(provider, upstream))


async def abort_after_the_end_then_chat_again(provider: Provider, upstream: PeerThread) -> None:
    messages = [ChatMessage(role="user", content="Hi")]
    try:
        ended = AbortController()
        first = [e async for e in provider.chat(messages, [], ChatOptions("m", ended.signal))]
        ended.abort()
        second = [e async for e in provider.chat(messages, [], ChatOptions("m", AbortSignal()))]

        for events in (first, second):
            assert events[:2] == [TextChunk("Hello"), TextChunk(" world")]
            # The service's own count of the call's tokens comes last.
            (usage,) = events[2:]
            assert isinstance(usage, UsageReport) and usage.completion_tokens == 2
        for index in (0, 1):  # the client can be done before the peer's handler has returned
            await upstream.run(upstream.peer.wait_for_end(index=index))
        assert [(r.completed, r.disconnected) for r in upstream.peer.requests] == [
            (True, False),
            (True, False),
        ]
        assert len(upstream.client_ports) == 2
        assert upstream.client_ports[0] == upstream.client_ports[1], "a new connection was opened"
    finally:
        await provider.close()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", sorted(PEERS))
def test_a_stream_that_ended_normally_keeps_its_connection_for_the_next_one(
    name: str, loop: str
) -> None:
    """Only an abort shuts a socket down: aborting the signal of a chat that already ended leaves
    its connection, back in the pool, alone, and the next chat reuses it."""
    with PeerThread(PEERS[name](default=Reply(chunks=["Hello", " world"]))) as upstream:
        provider = provider_for(name, upstream.peer.base_url)
        run_on(loop, lambda: abort_after_the_end_then_chat_again(provider, upstream))


POOL = 100
"""httpx's default connection limit, which the ollama SDK's client keeps."""


async def many_aborts_then_a_full_chat(provider: Provider, upstream: PeerThread) -> None:
    messages = [ChatMessage(role="user", content="Go on")]
    try:
        for _ in range(POOL + 5):
            controller = AbortController()
            first_chunk = asyncio.Event()

            async def consume(signal: AbortSignal, first_chunk: asyncio.Event) -> None:
                async for _event in provider.chat(messages, [], ChatOptions("m", signal)):
                    first_chunk.set()

            consumer = asyncio.ensure_future(consume(controller.signal, first_chunk))
            await asyncio.wait_for(first_chunk.wait(), 5)
            controller.abort()  # the consumer waits in its next read
            with pytest.raises(AbortError):
                await consumer
        upstream.peer.script(Reply(chunks=["Still", " here"]))
        events = [
            event async for event in provider.chat(messages, [], ChatOptions("m", AbortSignal()))
        ]
        assert [e for e in events if isinstance(e, TextChunk)] == [
            TextChunk("Still"),
            TextChunk(" here"),
        ]
    finally:
        await provider.close()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", sorted(PEERS))
def test_aborted_streams_give_their_connections_back(name: str, loop: str) -> None:
    """The shutdown and the cancelled read together must still close each aborted connection in
    the client's pool: were one left "active", a drone would stall for good after its pool's
    worth of aborts, waiting for a free connection."""
    with PeerThread(PEERS[name](default=Reply(chunks=["tok "] * 10_000, delay=0.005))) as upstream:
        provider = provider_for(name, upstream.peer.base_url)
        run_on(loop, lambda: asyncio.wait_for(many_aborts_then_a_full_chat(provider, upstream), 60))
