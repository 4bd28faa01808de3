"""``hangar drone``: a worker that takes work orders from a relay and runs them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from shared import runtime

from .client import DroneClient, DroneIdentity, DroneRefusedError
from .providers import OllamaProvider, OpenAIProvider, Provider
from .service import AgentService

log = logging.getLogger("hangar.drone")

PROVIDERS = ("openai", "ollama")
DEFAULT_MODELS = {"openai": "gpt-4o-mini", "ollama": "llama3.2"}


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
        """Stable for the life of this process, so a reconnect is recognised as the same drone."""
        return f"{self.name}-{_INSTANCE}"


_INSTANCE = secrets.token_hex(3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--server",
        default=env("HANGAR_SERVER", "http://127.0.0.1:8080"),
        help="relay URL, or several separated by commas, tried in turn on reconnect "
        "(HANGAR_SERVER; default %(default)s)",
    )
    parser.add_argument(
        "--token",
        default=env("HANGAR_DRONE_TOKEN", ""),
        help="the relay's drone token (HANGAR_DRONE_TOKEN)",
    )
    parser.add_argument(
        "--name",
        default=env("HANGAR_DRONE_NAME", socket.gethostname()),
        help="name shown to people (HANGAR_DRONE_NAME; default: host name)",
    )
    parser.add_argument(
        "--provider",
        default=env("HANGAR_PROVIDER", "openai"),
        help="openai or ollama (HANGAR_PROVIDER; default %(default)s)",
    )
    parser.add_argument(
        "--model",
        default=env("HANGAR_MODEL", ""),
        help="model name (HANGAR_MODEL; default gpt-4o-mini for openai, llama3.2 for ollama)",
    )
    parser.add_argument(
        "--base-url",
        default=env("HANGAR_BASE_URL") or env("OPENAI_BASE_URL"),
        help="OpenAI-compatible API base URL (HANGAR_BASE_URL or OPENAI_BASE_URL)",
    )
    parser.add_argument(
        "--api-key", default=env("OPENAI_API_KEY"), help="OpenAI API key (OPENAI_API_KEY)"
    )
    parser.add_argument(
        "--ollama-host",
        default=env("OLLAMA_HOST"),
        help="Ollama server URL (OLLAMA_HOST; default http://127.0.0.1:11434)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=int(env("HANGAR_CONCURRENCY", "1")),
        help="work orders run at once (HANGAR_CONCURRENCY; default %(default)s)",
    )
    parser.add_argument(
        "--workdir",
        default=env("HANGAR_WORKDIR", "."),
        help="the only directory the drone's tools may touch (HANGAR_WORKDIR; default: the "
        "current directory)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=float(env("HANGAR_DEADLINE", "1800")),
        help="seconds a work order may run before it ends in error (HANGAR_DEADLINE; "
        "default %(default)s; 0 for none)",
    )


def config_from(args: argparse.Namespace) -> DroneConfig:
    return DroneConfig(
        server=args.server,
        token=args.token,
        name=args.name,
        provider=args.provider,
        model=args.model or DEFAULT_MODELS.get(args.provider, ""),
        base_url=args.base_url,
        api_key=args.api_key,
        ollama_host=args.ollama_host,
        concurrency=args.concurrency,
        deadline=args.deadline or None,
        workdir=args.workdir,
    )


def make_provider(config: DroneConfig) -> Provider:
    if config.provider == "openai":
        return OpenAIProvider(
            config.model,
            api_key=config.api_key,
            base_url=config.base_url,
            max_retries=config.max_retries,
        )
    if config.provider == "ollama":
        return OllamaProvider(config.model, host=config.ollama_host)
    raise ValueError(f"Unknown provider {config.provider!r}: use one of {', '.join(PROVIDERS)}.")


async def run_drone(
    config: DroneConfig, stop: asyncio.Event | None = None, live_status: bool = False
) -> int:
    """Serve work orders until ``stop`` is set or the relay refuses this drone.

    On stop, running work orders are aborted and reported ``aborted`` before it returns 0.
    ``live_status`` draws a status line (for a terminal) under the log lines.
    """
    provider = make_provider(config)
    client = DroneClient(
        config.server,
        DroneIdentity(
            token=config.token,
            drone_id=config.drone_id(),
            name=config.name,
            provider=provider.name,
            model=provider.model,
            concurrency=config.concurrency,
        ),
    )
    service = AgentService(
        provider,
        client,
        concurrency=config.concurrency,
        deadline=config.deadline,
        workdir=Path(config.workdir) if config.workdir else None,
    )
    client.service = service
    stop = stop or asyncio.Event()
    status = StatusLine(client, service) if live_status else None
    try:
        await client.connect()
    except DroneRefusedError as error:
        print(f"hangar drone: the relay refused this drone: {error}", file=sys.stderr)
        await provider.close()
        return 2
    except ConnectionError as error:
        print(f"hangar drone: {error}", file=sys.stderr)
        await provider.close()
        return 1
    stopped = asyncio.ensure_future(stop.wait())
    refused = asyncio.ensure_future(client.wait_refused())
    drawing = asyncio.ensure_future(status.run()) if status else None
    try:
        await asyncio.wait((stopped, refused), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        refused.cancel()
        if drawing is not None:
            drawing.cancel()
        if service.abort_all():
            log.info("aborting running work orders before exit")
        await service.drain()
        await client.close()
        await provider.close()
    if refused.done() and not refused.cancelled() and client.refusal:
        print(f"hangar drone: the relay refused this drone: {client.refusal}", file=sys.stderr)
        return 2
    return 0


class StatusLine(logging.Handler):
    """In a terminal: one live status line at the bottom, log lines scrolling above it."""

    def __init__(self, client: DroneClient, service: AgentService) -> None:
        super().__init__()
        self.client = client
        self.service = service
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))

    def text(self) -> str:
        state = "connected to" if self.client.connected.is_set() else "reconnecting to"
        return (
            f"hangar drone · {state} {self.client.url} · {len(self.service.running)} running"
            f" · {self.client.chunks_streamed} tokens streamed"
        )

    def draw(self) -> None:
        sys.stderr.write("\r\x1b[K" + self.text())
        sys.stderr.flush()

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write("\r\x1b[K" + self.format(record) + "\n")
        self.draw()

    async def run(self) -> None:
        root = logging.getLogger()
        plain = root.handlers[:]
        root.handlers = [self]
        try:
            while True:
                self.draw()
                await asyncio.sleep(0.5)
        finally:
            root.handlers = plain
            sys.stderr.write("\r\x1b[K")


def install_stop(stop: asyncio.Event) -> None:
    """Ctrl-C (or SIGTERM) once: abort running work orders and exit cleanly; twice: exit now."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            os._exit(130)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)


def main(args: argparse.Namespace) -> int:
    if args.provider not in PROVIDERS:
        print(
            f"hangar drone: unknown provider {args.provider!r}; use one of {', '.join(PROVIDERS)}.",
            file=sys.stderr,
        )
        return 2
    if not args.token:
        print(
            "hangar drone: a drone token is required (--token or HANGAR_DRONE_TOKEN).",
            file=sys.stderr,
        )
        return 2
    config = config_from(args)

    async def run() -> int:
        stop = asyncio.Event()
        install_stop(stop)
        return await run_drone(config, stop, live_status=sys.stderr.isatty())

    return runtime.run(run())
