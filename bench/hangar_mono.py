"""Run the ``hangar`` command with every log line stamped with ``time.monotonic()``.

Same entry point as ``.venv/bin/hangar``; only the log format differs, so a benchmark can put
the relay's and drones' log events on the clock it uses itself (CLOCK_MONOTONIC is system-wide).

What-if experiments (not the shipped behaviour), to measure where a latency comes from:

- ``HANGAR_BENCH_NO_LANES=1``: the relay handles each drone event directly in the task
  python-socketio gives it, without the per-turn ordering lane (order is then not guaranteed).
- ``HANGAR_BENCH_ENGINEIO_LOOPS=1``: a drone's websocket is read and written by engine.io's own
  client loops instead of ``drone/engine.py``'s.

Profiling (behaviour unchanged): ``HANGAR_BENCH_CPROFILE=DIR``: SIGUSR1 starts cProfile on the
main thread, on its CPU time, SIGUSR2 stops it and writes ``DIR/<pid>.prof``
(``bench.abort_burst --cprofile``).

Tracing (behaviour unchanged): ``HANGAR_BENCH_TRACE_ACKS=1`` logs ``trace ack written`` when a
drone writes an ``(True, "Abort signaled")`` ack frame and ``trace ack read`` when the relay's
engine.io layer reads one. ``HANGAR_BENCH_TRACE_GC=1`` logs every garbage collection that
stops the process for 2 ms or more (``trace gc gen=N ms=X``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from hangar.shared.cli import main


class _Monotonic(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.mono = time.monotonic()
        return True


def _no_lanes() -> None:
    from hangar.server.lanes import TurnLanes

    async def directly(self: TurnLanes, turn_id: str, job: Callable[[], Any]) -> Any:
        return await job()

    TurnLanes.run = directly  # type: ignore[assignment,method-assign]
    logging.getLogger("bench").warning("what-if: drone events without per-turn lanes")


def _engineio_loops() -> None:
    import engineio

    from hangar.drone.engine import RelayClient

    class EngineioLoops(engineio.AsyncClient):  # type: ignore[misc]
        went_silent = False  # what the drone asks of its engine.io client after a disconnect

    def engineio_client(self: RelayClient) -> Any:
        return EngineioLoops

    RelayClient._engineio_client_class = engineio_client  # type: ignore[method-assign]
    logging.getLogger("bench").warning("what-if: engine.io's own client loops in the drone")


def _trace_acks() -> None:
    import aiohttp
    import engineio.async_socket

    trace = logging.getLogger("bench")
    send_str = aiohttp.ClientWebSocketResponse.send_str
    receive = engineio.async_socket.AsyncSocket.receive

    async def send_traced(self: Any, data: str, *args: Any, **kwargs: Any) -> None:
        await send_str(self, data, *args, **kwargs)
        if data.startswith("43/drone") and "Abort signaled" in data:
            trace.info("trace ack written %s", data[:24])

    async def receive_traced(self: Any, pkt: Any) -> None:
        if isinstance(pkt.data, str) and pkt.data.startswith("3/drone") and "Abort" in pkt.data:
            trace.info("trace ack read %s", pkt.data[:24])
        await receive(self, pkt)

    aiohttp.ClientWebSocketResponse.send_str = send_traced  # type: ignore[method-assign]
    engineio.async_socket.AsyncSocket.receive = receive_traced


def _trace_gc() -> None:
    import gc

    trace = logging.getLogger("bench")
    started: list[float] = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (ms := (time.perf_counter() - started[0]) * 1000) >= 2:
            trace.info(
                "trace gc gen=%d collected=%d old=%d frozen=%d ms=%.1f",
                info["generation"],
                info["collected"],
                len(gc.get_objects(generation=2)) if ms >= 20 else -1,
                gc.get_freeze_count(),
                ms,
            )

    gc.callbacks.append(timed)


def _cprofile(folder: str) -> None:
    import cProfile
    import signal

    profile = cProfile.Profile(time.thread_time)  # CPU time: waiting for a core is not cost

    def start(signum: int, frame: object) -> None:
        profile.enable()

    def stop(signum: int, frame: object) -> None:
        profile.disable()
        path = os.path.join(folder, f"{os.getpid()}.prof")
        profile.dump_stats(path)
        logging.getLogger("bench").warning("cprofile written to %s", path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def run(argv: list[str]) -> int:
    handler = logging.StreamHandler()
    handler.addFilter(_Monotonic())
    handler.setFormatter(logging.Formatter("%(mono).6f %(levelname)s %(name)s %(message)s"))
    # Configured first, so the command's own basicConfig() is a no-op.
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    if os.environ.get("HANGAR_BENCH_NO_LANES"):
        _no_lanes()
    if os.environ.get("HANGAR_BENCH_ENGINEIO_LOOPS"):
        _engineio_loops()
    if os.environ.get("HANGAR_BENCH_TRACE_ACKS"):
        _trace_acks()
    if folder := os.environ.get("HANGAR_BENCH_CPROFILE"):
        _cprofile(folder)
    if os.environ.get("HANGAR_BENCH_TRACE_GC"):
        _trace_gc()
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
