"""Prometheus metrics of one relay, in a registry of its own (relays may share a process)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from hangar.shared.protocol import Usage


class RelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.browsers = Gauge(
            "hangar_browsers_connected",
            "Browser connections on this relay.",
            registry=self.registry,
        )
        self.drones = Gauge(
            "hangar_drones_connected", "Drones connected to this relay.", registry=self.registry
        )
        self.work_orders = Counter(
            "hangar_work_orders",
            "Work orders ended by this relay, by final status.",
            ["status"],
            registry=self.registry,
        )
        self.abort_latency = Histogram(
            "hangar_abort_latency_seconds",
            "From an abort reaching the relay to the drone's acknowledgement.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=self.registry,
        )
        self.progress_events = Counter(
            "hangar_progress_events",
            "Progress events relayed from drones to browsers.",
            registry=self.registry,
        )
        self.endings = Counter(
            "hangar_turn_endings",
            "Turns ended by this relay, by why they ended.",
            ["reason"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "hangar_tokens",
            "Tokens the turns ended by this relay used, as the model service reported them or "
            "as estimated for streams it cut short.",
            ["kind"],
            registry=self.registry,
        )
        for status in ("finished", "aborted", "error"):
            self.work_orders.labels(status)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def ended(self, status: str, reason: str, usage: Usage | None) -> None:
        """Count a turn's ending, and the tokens it used."""
        self.work_orders.labels(status).inc()
        self.endings.labels(reason).inc()
        if usage is not None:
            self.tokens.labels("prompt").inc(usage.prompt_tokens)
            self.tokens.labels("completion").inc(usage.completion_tokens)

    async def serve(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
