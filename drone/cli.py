"""``hangar drone``: a worker that takes work orders from a relay and runs them."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from hangar.shared import runtime
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.cli import add_log_level
from hangar.shared.protocol import drone_name_of

from .worker import DEFAULT_MODELS, PROVIDERS, DroneConfig, run_drone

OPERATOR_STOP = "The drone's operator stopped it."
SHUT_DOWN = "The drone was shut down."


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "drone", help="run a drone (worker)", description="Run a drone that takes work orders."
    )
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_log_level(parser)
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
        default=env("HANGAR_DRONE_NAME", ""),
        help="name shown to people (HANGAR_DRONE_NAME; default: the drone token's name, else "
        "the host name)",
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
        default=env("HANGAR_CONCURRENCY", "1"),
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
        default=env("HANGAR_DEADLINE", "1800"),
        help="seconds a work order may run before it ends in error (HANGAR_DEADLINE; "
        "default %(default)s; 0 for none)",
    )


def config_from(args: argparse.Namespace) -> DroneConfig:
    return DroneConfig(
        server=args.server,
        token=args.token,
        name=args.name or drone_name_of(args.token) or socket.gethostname(),
        provider=args.provider,
        model=args.model or DEFAULT_MODELS.get(args.provider, ""),
        base_url=args.base_url,
        api_key=args.api_key,
        ollama_host=args.ollama_host,
        concurrency=args.concurrency,
        deadline=args.deadline or None,
        workdir=args.workdir,
    )


def run(args: argparse.Namespace) -> int:
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
    live_status = sys.stderr.isatty() and os.environ.get("HANGAR_STATUS_LINE") != "off"

    async def main() -> int:
        root = AbortController()
        runtime.abort_on_signals(
            root,
            AbortError(OPERATOR_STOP, cause="operator"),
            AbortError(SHUT_DOWN, cause="shutdown"),
        )
        return await run_drone(config, root, live_status=live_status)

    return runtime.run(main())
