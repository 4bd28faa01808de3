"""``hangar``: ``serve`` runs a relay, ``drone`` a worker, ``demo`` both in one process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web

from drone import cli as drone_cli
from shared import runtime

from .app import RelayConfig, build_app
from .demo_model import DEMO_MODEL, DEMO_PATH

log = logging.getLogger("hangar")


def hangar_version() -> str:
    try:
        return version("hangar")
    except PackageNotFoundError:
        return "0+unknown"


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    top = argparse.ArgumentParser(
        prog="hangar", description="Run AI-agent work orders on remote drones; abort them at once."
    )
    top.add_argument("--version", action="version", version=f"hangar {hangar_version()}")
    top.add_argument(
        "--log-level", default=env("HANGAR_LOG_LEVEL", "INFO"), help="(HANGAR_LOG_LEVEL)"
    )
    commands = top.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a relay", description="Run a relay.")
    add_relay_arguments(serve)
    serve.add_argument(
        "--drone-token",
        default=env("HANGAR_DRONE_TOKEN", ""),
        help="token drones must present (HANGAR_DRONE_TOKEN; default: a new one, printed)",
    )

    drone = commands.add_parser(
        "drone", help="run a drone (worker)", description="Run a drone that takes work orders."
    )
    drone_cli.add_arguments(drone)

    demo = commands.add_parser(
        "demo",
        help="run a relay and one drone in one process",
        description="Run a relay and one drone. With no OPENAI_API_KEY or OLLAMA_HOST the drone "
        "talks to the built-in offline demo model.",
    )
    add_relay_arguments(demo)
    demo.add_argument("--model", default=env("HANGAR_MODEL", ""), help="(HANGAR_MODEL)")
    return top


def add_relay_arguments(command: argparse.ArgumentParser) -> None:
    env = os.environ.get
    command.add_argument(
        "--host", default=env("HANGAR_HOST", "127.0.0.1"), help="(HANGAR_HOST; default %(default)s)"
    )
    command.add_argument(
        "--port",
        type=int,
        default=int(env("HANGAR_PORT", "8080")),
        help="(HANGAR_PORT; default %(default)s; 0 picks a free port)",
    )
    command.add_argument(
        "--database",
        default=env("HANGAR_DATABASE", "hangar.db"),
        help="SQLite file, or a postgresql:// URL (HANGAR_DATABASE; default %(default)s)",
    )
    command.add_argument(
        "--redis",
        default=env("HANGAR_REDIS") or None,
        help="Redis URL shared by several relays (HANGAR_REDIS; default: none, one relay)",
    )
    command.add_argument(
        "--abort-grace",
        type=float,
        default=float(env("HANGAR_ABORT_GRACE", "10")),
        help="seconds after an acknowledged abort before the relay ends the turn itself "
        "(HANGAR_ABORT_GRACE; default %(default)s)",
    )
    command.add_argument(
        "--drone-grace",
        type=float,
        default=float(env("HANGAR_DRONE_GRACE", "3")),
        help="seconds a disconnected drone has to come back before its turns end in error "
        "(HANGAR_DRONE_GRACE; default %(default)s)",
    )


def relay_config(args: argparse.Namespace, **overrides: object) -> RelayConfig:
    config = RelayConfig(
        host=args.host,
        port=args.port,
        database=args.database,
        redis=args.redis,
        abort_grace=args.abort_grace,
        drone_grace=args.drone_grace,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


async def start_relay(config: RelayConfig) -> tuple[web.AppRunner, int]:
    """Start a relay; returns its runner and the port it listens on."""
    runner = web.AppRunner(build_app(config), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else config.port
    return runner, port


async def serve(config: RelayConfig, token_was_given: bool) -> int:
    stop = asyncio.Event()
    drone_cli.install_stop(stop)
    try:
        runner, port = await start_relay(config)
    except OSError as error:
        print(
            f"hangar serve: cannot listen on {config.host}:{config.port}: {error.strerror}.",
            file=sys.stderr,
        )
        return 1
    print(f"Hangar relay listening on http://{config.host}:{port}/", flush=True)
    if not token_was_given:
        print(
            f"Drones connect with: hangar drone --server http://{config.host}:{port} "
            f"--token {config.drone_token}",
            flush=True,
        )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


async def demo(config: RelayConfig, model: str) -> int:
    stop = asyncio.Event()
    drone_cli.install_stop(stop)
    openai_key = os.environ.get("OPENAI_API_KEY")
    ollama_host = os.environ.get("OLLAMA_HOST")
    config.demo_model = not (openai_key or ollama_host)
    try:
        runner, port = await start_relay(config)
    except OSError as error:
        print(
            f"hangar demo: cannot listen on {config.host}:{config.port}: {error.strerror}.",
            file=sys.stderr,
        )
        return 1
    base = f"http://{config.host}:{port}"
    drone = drone_cli.DroneConfig(server=base, token=config.drone_token, name="demo-drone")
    if openai_key:
        drone.provider, drone.api_key = "openai", openai_key
        drone.base_url = os.environ.get("OPENAI_BASE_URL")
        drone.model = model or drone_cli.DEFAULT_MODELS["openai"]
        label = f"OpenAI model {drone.model}"
    elif ollama_host:
        drone.provider, drone.ollama_host = "ollama", ollama_host
        drone.model = model or drone_cli.DEFAULT_MODELS["ollama"]
        label = f"Ollama model {drone.model} at {ollama_host}"
    else:
        drone.provider, drone.base_url, drone.model = "openai", base + DEMO_PATH, DEMO_MODEL
        label = "the offline demo model (canned answers, no LLM)"
    print(f"Hangar demo running: open {base}/ in your browser", flush=True)
    print(f"One drone is connected, using {label}. Press Ctrl-C to stop.", flush=True)
    try:
        return await drone_cli.run_drone(drone, stop)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if args.command == "drone":
        return drone_cli.main(args)
    if args.command == "serve":
        token = args.drone_token or secrets.token_urlsafe(24)
        return runtime.run(serve(relay_config(args, drone_token=token), bool(args.drone_token)))
    return runtime.run(demo(relay_config(args), args.model))


if __name__ == "__main__":
    sys.exit(main())
