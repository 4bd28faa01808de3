"""A drone, composed: its provider, its connection to the relays and its agent service, all
under one root controller. Ctrl-C and a relay's refusal abort the root; the drone then reports
every running work order aborted and exits."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from hangar.shared.abort import AbortController, AbortError
from hangar.shared.protocol import DroneRecord, drone_name_of

from .connection import DroneRefusedError, RelayConnection
from .providers import OllamaProvider, OpenAIProvider, Provider
from .service import AgentService
from .status import StatusLine

log = logging.getLogger("hangar.drone")

PROVIDERS = ("openai", "ollama")
DEFAULT_MODELS = {"openai": "gpt-4o-mini", "ollama": "llama3.2"}
_INSTANCE = secrets.token_hex(3)


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
    max_retries: int = 2
    workdir: str | None = "."
    """Where the drone's tools read, write and run commands; None disables tools."""

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


async def run_drone(config: DroneConfig, root: AbortController, live_status: bool = False) -> int:
    """Serve work orders until ``root`` is aborted or the relay refuses this drone.

    On the way out every running work order is reported ``aborted``; then it returns 0 (2 if a
    relay refused the drone). ``live_status`` draws a status line for a terminal.
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
        workdir=Path(config.workdir) if config.workdir else None,
    )
    connection.take_orders(service)
    try:
        await connection.connect()
    except DroneRefusedError as error:
        print(f"hangar drone: the relay refused this drone: {error}", file=sys.stderr)
        await provider.close()
        return 2
    except ConnectionError as error:
        print(f"hangar drone: {error}", file=sys.stderr)
        await provider.close()
        return 1

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
