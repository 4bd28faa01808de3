"""``hangar serve`` runs a relay (``hangar demo``, a relay with one drone, is in ``demo``)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import sys
import traceback

from aiohttp import web

from hangar.shared import runtime
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.cli import (
    add_list_setting,
    add_log_level,
    add_setting,
    database,
    origin,
    port,
    seconds,
    url,
)
from hangar.shared.protocol import DRONE_TOKEN_PREFIX
from hangar.shared.shown import shown

from .access import networks
from .app import RELAY, SHUTDOWN_WAIT, RelayConfig, build_app
from .sqlite_file import new_file, remove_new

log = logging.getLogger("hangar")

DRONE_START_TIMEOUT = 30.0
DRONE_STOP_TIMEOUT = 10.0
SHUTDOWN = "The relay is shutting down."
DEMO_USER = "demo"
DEMO_DRONE = "demo-drone"


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser("serve", help="run a relay", description="Run a relay.")
    add_relay_arguments(serve)
    add_setting(
        serve,
        "--drone-token",
        env="HANGAR_DRONE_TOKEN",
        default="",
        check=drone_secret,
        help="a secret every drone may present, for a single relay, of 16 characters or more "
        "(HANGAR_DRONE_TOKEN; default: none, drones need their own token from hangar "
        "drone-token create)",
    )


def drone_secret(text: str) -> str:
    """A shared drone token long enough not to be guessed (its text is never repeated)."""
    if text and len(text) < 16:
        raise ValueError(
            "expected a secret of 16 characters or more (whoever guesses it may run a drone "
            f"here), got {len(text)}."
        )
    if text.startswith(DRONE_TOKEN_PREFIX):  # HANGAR_DRONE_TOKEN set for a drone beside it
        raise ValueError(
            f"expected a secret every drone may present, got a drone's own token "
            f"({DRONE_TOKEN_PREFIX}…, from hangar drone-token create), which needs no setting here."
        )
    return text


def listen_host(text: str) -> str:
    """A name or address to listen on (``[::1]`` as ``::1``)."""
    host = text.strip()
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"expected a name or address to listen on, got {text!r}.")
    if ":" in host and not _ipv6(host):  # host:port
        raise ValueError(
            f"expected a name or address to listen on (the port is --port), got {text!r}."
        )
    return host


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def relay_url(host: str, port: int) -> str:
    """Where browsers and drones reach a relay listening on ``host`` (an IPv6 address in
    brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def add_relay_arguments(command: argparse.ArgumentParser) -> None:
    add_log_level(command)
    add_setting(
        command,
        "--host",
        env="HANGAR_HOST",
        default="127.0.0.1",
        check=listen_host,
        help="the name or address to listen on; an IPv6 one with or without its brackets "
        "(HANGAR_HOST; default %(default)s)",
    )
    add_setting(
        command,
        "--port",
        env="HANGAR_PORT",
        default="8080",
        check=port,
        help="(HANGAR_PORT; default %(default)s; 0 picks a free port)",
    )
    add_setting(
        command,
        "--database",
        env="HANGAR_DATABASE",
        default="hangar.db",
        check=database,
        help="SQLite file, or a postgresql:// URL (HANGAR_DATABASE; default %(default)s)",
    )
    add_setting(
        command,
        "--redis",
        env="HANGAR_REDIS",
        default=None,
        check=url("redis", "rediss", "unix"),
        help="Redis URL shared by several relays (HANGAR_REDIS; default: none, one relay)",
    )
    add_setting(
        command,
        "--redis-prefix",
        env="HANGAR_REDIS_PREFIX",
        default="",
        help="what this deployment's Redis keys and channel start with (HANGAR_REDIS_PREFIX; "
        "default: derived from --database, so deployments sharing a Redis do not mix)",
    )
    add_list_setting(
        command,
        "--allowed-origin",
        env="HANGAR_ALLOWED_ORIGINS",
        check=origin,
        help="an origin besides the relay's own that may use it, e.g. a proxy's "
        "https://hangar.example (repeatable; HANGAR_ALLOWED_ORIGINS, comma-separated)",
    )
    add_setting(
        command,
        "--trusted-proxies",
        env="HANGAR_TRUSTED_PROXIES",
        default="",
        check=proxies,
        help="the proxies (addresses or networks, comma-separated) whose X-Forwarded-For says "
        "who a request is from, so failed logins are limited per visitor, not per proxy "
        "(HANGAR_TRUSTED_PROXIES; default: none)",
    )
    add_setting(
        command,
        "--abort-grace",
        env="HANGAR_ABORT_GRACE",
        default="10",
        check=seconds,
        help="seconds after an acknowledged abort before the relay ends the turn itself "
        "(HANGAR_ABORT_GRACE; default %(default)s)",
    )
    add_setting(
        command,
        "--abort-answer",
        env="HANGAR_ABORT_ANSWER",
        default="2",
        check=seconds,
        help="seconds a drone has to acknowledge an abort before the relay ends the turn "
        "itself, aborted (HANGAR_ABORT_ANSWER; default %(default)s)",
    )
    add_setting(
        command,
        "--drone-grace",
        env="HANGAR_DRONE_GRACE",
        default="3",
        check=grace,
        help="a silent drone is noticed within this, and its turns end in error if it is not "
        "back within this again (HANGAR_DRONE_GRACE; default %(default)s)",
    )


MOST_GRACE = 3600.0
"""Seconds of ``--drone-grace`` at most (engine.io's ping timeout is two thirds of it)."""


def grace(text: str) -> float:
    number = seconds(text)
    if number > MOST_GRACE:
        raise ValueError(f"expected a number of seconds from 0 to {MOST_GRACE:g}, got {text!r}.")
    return number


def relay_config(args: argparse.Namespace) -> RelayConfig:
    return RelayConfig(
        host=args.host,
        port=args.port,
        database=args.database,
        redis=args.redis,
        redis_prefix=args.redis_prefix,
        allowed_origins=args.allowed_origin,
        trusted_proxies=args.trusted_proxies,
        abort_grace=args.abort_grace,
        abort_answer=args.abort_answer,
        drone_grace=args.drone_grace,
    )


def proxies(text: str) -> list[str]:
    """Comma-separated addresses or networks (``10.0.0.0/8``) of trusted proxies."""
    found = [part.strip() for part in text.split(",") if part.strip()]
    try:
        networks(found)
    except ValueError:
        raise ValueError(
            f"expected addresses or networks, comma-separated, got {text!r}."
        ) from None
    return found


class RelayStartError(Exception):
    """The relay cannot start: its address, its database or its Redis is not available."""


async def start_relay(config: RelayConfig) -> tuple[web.AppRunner, int]:
    """Start a relay; returns its runner and the port it listens on.

    Raises ``RelayStartError`` with a one-line reason when it cannot.
    """
    try:
        app = build_app(config)
    except ValueError as error:  # an option its libraries refuse (in the Redis URL, say)
        raise RelayStartError(f"cannot use the settings: {' '.join(str(error).split())}") from None
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_WAIT
    )
    try:
        await runner.setup()  # opens the store and the live state
    except BaseException as error:  # also a Ctrl-C: what was opened is closed
        log.debug("the relay could not start", exc_info=True)
        with contextlib.suppress(Exception):
            await runner.cleanup()
        if not isinstance(error, Exception):
            raise
        raise RelayStartError(cannot_open(config, error)) from error
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except BaseException as error:
        await runner.cleanup()
        if not isinstance(error, OSError):
            raise
        said = (error.strerror or str(error)).rsplit(": ", 1)[-1]  # asyncio repeats the address
        reason = f"cannot listen on {config.host}:{config.port}: {said}."
        raise RelayStartError(reason) from error
    runner.app[RELAY].listening = True
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else config.port
    return runner, port


def _redis_raised(error: BaseException) -> bool:
    """Whether redis-py raised ``error``: one of its own, or another from within it (a
    ``TypeError`` for an option in the URL that its connections do not take, say)."""
    if type(error).__module__.split(".")[0] == "redis":
        return True
    frames = traceback.walk_tb(error.__traceback__)
    return any(frame.f_globals.get("__name__", "").startswith("redis.") for frame, _ in frames)


def cannot_open(config: RelayConfig, error: BaseException) -> str:
    """Which of the relay's services failed, in one line (URLs left out: they hold passwords)."""
    said = " ".join(str(error).split()) or type(error).__name__
    if _redis_raised(error):
        if type(error).__name__ == "ResponseError":  # it answers, and refuses (a script, say)
            return f"Redis refuses what a relay needs: {said}"
        return f"cannot reach Redis: {said}"
    if "://" in config.database.removeprefix("sqlite:///"):
        return f"cannot open the database: {said}"
    return f"cannot open the database {shown(config.database)}: {said}"


async def serve(config: RelayConfig, token_was_given: bool) -> int:
    root = AbortController()
    runtime.abort_on_signals(root, AbortError(SHUTDOWN, cause="shutdown"))
    made = new_file(config.database)  # a relay that cannot start leaves no database behind
    try:
        async with root.signal.scope():  # Ctrl-C while the database does not answer
            runner, port = await start_relay(config)
    except RelayStartError as error:
        remove_new(made)
        print(f"hangar serve: {error}", file=sys.stderr)
        return 1
    except AbortError:
        remove_new(made)
        return 0
    print(f"Hangar relay listening on {relay_url(config.host, port)}/", flush=True)
    relay = runner.app[RELAY]
    if not await relay.accounts.users():
        print(
            f"No accounts yet: add one with hangar user add NAME --admin "
            f"--database {shown(config.database)}",
            flush=True,
        )
    if not token_was_given and all(t.revoked_at for t in await relay.accounts.drone_tokens()):
        print(
            f"Drones need a token: hangar drone-token create NAME --database "
            f"{shown(config.database)}",
            flush=True,
        )
    try:
        await root.signal.wait()
    finally:
        await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    config = relay_config(args)
    if args.drone_token:
        config.drone_token = args.drone_token
    return runtime.run(serve(config, bool(args.drone_token)))
