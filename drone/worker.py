"""A drone, composed: its provider, its connection to the relays and its agent service, all
under one root controller. Ctrl-C and a relay's refusal abort the root; the drone then reports
every running work order aborted and exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hangar.shared.abort import AbortController, AbortError, AbortSignal
from hangar.shared.protocol import DroneRecord, drone_name_of

from .approvals import APPROVAL_TIMEOUT
from .connection import DroneRefusedError, RelayConnection
from .providers import OllamaProvider, OpenAIProvider, Provider
from .service import AgentService, ToolSettings
from .status import StatusLine
from .tools.policy import ToolPolicy
from .tools.sandbox import detect_sandbox

log = logging.getLogger("hangar.drone")

PROVIDERS = ("openai", "ollama")
DEFAULT_MODELS = {"openai": "gpt-4o-mini", "ollama": "llama3.2"}
_INSTANCE = secrets.token_hex(3)
RETRY_DELAYS = (1.0, 2.0, 3.0, 5.0)
"""Seconds between attempts to reach a relay that is not up yet (the last one repeats)."""


@dataclass
class DroneConfig:
    server: str = "http://127.0.0.1:8080"
    token: str = ""
    name: str = ""
    provider: str = "openai"
    model: str = ""
    base_url: str | None = None
    api_key: str | None = None
    ollama_host: str | None = None
    concurrency: int = 1
    deadline: float | None = 1800.0
    stall: float | None = 120.0
    """Seconds a model stream may send nothing before the work order fails (None: no limit)."""
    max_retries: int = 2
    workdir: str | None = "."
    """Where the drone's tools read, write and run commands; None disables tools."""
    tools: ToolPolicy = field(default_factory=ToolPolicy)
    """Which tools run at once, wait for a person's approval, or are refused."""
    approval_timeout: float = APPROVAL_TIMEOUT
    shell_network: bool = False
    """Whether sandboxed shell commands may use the network."""
    allow_private_urls: bool = False
    """Whether ``fetch_url`` may reach private and loopback addresses."""

    def drone_id(self) -> str:
        """The name a drone token carries; otherwise one stable for the life of this process,
        so a reconnect is recognised as the same drone."""
        return drone_name_of(self.token) or f"{self.name}-{_INSTANCE}"


def make_provider(config: DroneConfig) -> Provider:
    if config.provider == "openai":
        return OpenAIProvider(
            config.model or DEFAULT_MODELS["openai"],
            api_key=config.api_key,
            base_url=config.base_url,
            max_retries=config.max_retries,
        )
    if config.provider == "ollama":
        return OllamaProvider(config.model or DEFAULT_MODELS["ollama"], host=config.ollama_host)
    raise ValueError(f"Unknown provider {config.provider!r}: use one of {', '.join(PROVIDERS)}.")


async def reach_relay(connection: RelayConnection, signal: AbortSignal) -> bool:
    """Connect, waiting for a relay that is not up yet; False if ``signal`` fires first.

    Raises ``DroneRefusedError`` when a relay refuses this drone: waiting cannot help then.
    """
    attempt = 0
    while not signal.aborted:
        try:
            await connection.connect()
            return True
        except ConnectionError:
            pass
        delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
        attempt += 1
        urls = connection.urls
        which = f"relay {urls[0]} is" if len(urls) == 1 else f"relays {', '.join(urls)} are"
        log.warning("%s not up yet; trying again in %g s", which, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signal.wait(), delay)
    return False


def tool_settings(config: DroneConfig) -> ToolSettings | None:
    """How this drone's tools run, said in one line at start (the sandbox, or its absence)."""
    if not config.workdir:
        return None
    found = detect_sandbox()
    line = found.describe(network=config.shell_network)
    if found.available:
        log.info(line)
    else:
        log.warning("%s Commands always wait for a person's approval.", line)
    return ToolSettings(
        Path(config.workdir),
        policy=config.tools if found.available else config.tools.unconfined(),
        approval_timeout=config.approval_timeout,
        sandbox=found.sandbox,
        network=config.shell_network,
        allow_private_urls=config.allow_private_urls,
    )


async def run_drone(config: DroneConfig, root: AbortController, live_status: bool = False) -> int:
    """Serve work orders until ``root`` is aborted or the relay refuses this drone.

    Until a relay answers it waits, trying again every few seconds. On the way out every
    running work order is reported ``aborted``; then it returns 0 (2 if a relay refused the
    drone). ``live_status`` draws a status line for a terminal.
    """
    provider = make_provider(config)
    record = DroneRecord(
        drone_id=config.drone_id(),
        name=config.name,
        provider=provider.name,
        model=provider.model,
        concurrency=config.concurrency,
    )
    connection = RelayConnection(config.server, record, config.token)
    service = AgentService(
        provider,
        connection,
        root=root.signal,
        concurrency=config.concurrency,
        deadline=config.deadline,
        tools=tool_settings(config),
        stall=config.stall,
    )
    connection.take_orders(service)
    try:
        if not await reach_relay(connection, root.signal):
            await provider.close()
            return 0  # stopped while it waited
    except DroneRefusedError as error:
        print(f"hangar drone: the relay refused this drone: {error}", file=sys.stderr)
        await provider.close()
        return 2

    async def abort_when_refused() -> None:
        reason = await connection.wait_refused()
        root.abort(AbortError(f"The relay refused this drone: {reason}", cause="relay"))

    refused = asyncio.ensure_future(abort_when_refused())
    drawing = asyncio.ensure_future(StatusLine(connection, service).run()) if live_status else None
    try:
        await root.signal.wait()
    finally:
        refused.cancel()
        if drawing is not None:
            drawing.cancel()
        if service.running:
            log.info("aborting running work orders before exit")
        await service.drain()
        await connection.close()
        await provider.close()
    if connection.refusal:
        print(f"hangar drone: the relay refused this drone: {connection.refusal}", file=sys.stderr)
        return 2
    return 0
