"""The relay's commands: ``hangar serve`` runs a relay, ``hangar demo`` a relay with one drone.

The demo's drone is a child process (``python -m hangar.drone``): the relay and the drone meet
only on the wire, even here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile

from aiohttp import web

from hangar.shared import runtime
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.cli import (
    WOULD_HOLD_DATABASE,
    add_list_setting,
    add_log_level,
    add_setting,
    database,
    holds_database,
    origin,
    port,
    seconds,
    url,
    work_directory,
)

from .access import is_loopback, networks
from .accounts import Accounts
from .app import RELAY, SHUTDOWN_WAIT, RelayConfig, build_app, open_store
from .demo_model import DEMO_MODEL, DEMO_PATH

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
        help="a secret every drone may present, for a single relay (HANGAR_DRONE_TOKEN; "
        "default: none, drones need their own token from hangar drone-token create)",
    )
    demo = commands.add_parser(
        "demo",
        help="run a relay and one drone",
        description="Run a relay and one drone. With no OPENAI_API_KEY or OLLAMA_HOST the drone "
        "talks to the built-in offline demo model.",
    )
    add_relay_arguments(demo)
    add_setting(demo, "--model", env="HANGAR_MODEL", default="", help="(HANGAR_MODEL)")
    add_setting(
        demo,
        "--workdir",
        env="HANGAR_WORKDIR",
        default=None,
        check=work_directory,
        help="an existing directory, the only one the drone's tools may touch (HANGAR_WORKDIR; "
        "default: a fresh folder in the system's temporary folder, removed when the demo stops)",
    )


def add_relay_arguments(command: argparse.ArgumentParser) -> None:
    add_log_level(command)
    add_setting(
        command,
        "--host",
        env="HANGAR_HOST",
        default="127.0.0.1",
        help="(HANGAR_HOST; default %(default)s)",
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
        check=seconds,
        help="a silent drone is noticed within this, and its turns end in error if it is not "
        "back within this again (HANGAR_DRONE_GRACE; default %(default)s)",
    )


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
    runner = web.AppRunner(
        build_app(config), handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_WAIT
    )
    try:
        await runner.setup()  # opens the store and the live state
    except Exception as error:
        log.debug("the relay could not start", exc_info=True)
        with contextlib.suppress(Exception):
            await runner.cleanup()
        raise RelayStartError(_cannot_open(config, error)) from error
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        reason = f"cannot listen on {config.host}:{config.port}: {error.strerror}."
        raise RelayStartError(reason) from error
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else config.port
    return runner, port


def _cannot_open(config: RelayConfig, error: BaseException) -> str:
    """Which of the relay's services failed, in one line (URLs left out: they hold passwords)."""
    said = " ".join(str(error).split()) or type(error).__name__
    if type(error).__module__.split(".")[0] == "redis":
        return f"cannot reach Redis: {said}"
    if "://" in config.database:
        return f"cannot open the database: {said}"
    return f"cannot open the database {config.database}: {said}"


async def serve(config: RelayConfig, token_was_given: bool) -> int:
    root = AbortController()
    runtime.abort_on_signals(root, AbortError(SHUTDOWN, cause="shutdown"))
    try:
        async with root.signal.scope():  # Ctrl-C while the database does not answer
            runner, port = await start_relay(config)
    except RelayStartError as error:
        print(f"hangar serve: {error}", file=sys.stderr)
        return 1
    except AbortError:
        return 0
    print(f"Hangar relay listening on http://{config.host}:{port}/", flush=True)
    relay = runner.app[RELAY]
    if not await relay.accounts.users():
        print(
            f"No accounts yet: add one with hangar user add NAME --admin "
            f"--database {config.database}",
            flush=True,
        )
    if not token_was_given:
        print(
            f"Drones need a token: hangar drone-token create NAME --database {config.database}",
            flush=True,
        )
    try:
        await root.signal.wait()
    finally:
        await runner.cleanup()
    return 0


def demo_drone_arguments(base: str, model: str) -> tuple[list[str], str]:
    """The demo drone's command-line arguments, and a label for what it talks to."""
    openai_key = os.environ.get("OPENAI_API_KEY")
    ollama_host = os.environ.get("OLLAMA_HOST")
    common = ["--server", base]
    if openai_key:
        chosen = model or "gpt-4o-mini"
        return [*common, "--provider", "openai", "--model", chosen], f"OpenAI model {chosen}"
    if ollama_host:
        chosen = model or "llama3.2"
        label = f"Ollama model {chosen} at {ollama_host}"
        return [*common, "--provider", "ollama", "--model", chosen], label
    arguments = [*common, "--provider", "openai", "--base-url", base + DEMO_PATH]
    return [*arguments, "--model", DEMO_MODEL], "the offline demo model (canned answers, no LLM)"


async def demo(config: RelayConfig, model: str, workdir: str | None, log_level: str) -> int:
    """Run a relay and its drone until Ctrl-C; the drone's tools work in ``workdir``, else in
    a fresh folder removed at the end."""
    if workdir and holds_database(workdir, config.database):
        print(f"hangar demo: --workdir: {workdir!r} {WOULD_HOLD_DATABASE}", file=sys.stderr)
        return 2
    root = AbortController()
    runtime.abort_on_signals(root, AbortError(SHUTDOWN, cause="shutdown"))
    config.demo_model = not (os.environ.get("OPENAI_API_KEY") or os.environ.get("OLLAMA_HOST"))
    if is_loopback(config.host):
        config.demo_user = DEMO_USER
    try:
        async with root.signal.scope():  # Ctrl-C while the database does not answer
            if not is_loopback(config.host) and not await _has_accounts(config):
                print(
                    f"hangar demo: on {config.host} the page is open to the network and needs "
                    f"accounts: add one with hangar user add NAME --admin --database "
                    f"{config.database}",
                    file=sys.stderr,
                )
                return 2
            runner, port = await start_relay(config)
    except RelayStartError as error:
        print(f"hangar demo: {error}", file=sys.stderr)
        return 1
    except AbortError:
        return 0
    base = f"http://{config.host}:{port}"
    arguments, label = demo_drone_arguments(base, model)
    token = await _demo_drone_token(runner.app[RELAY].accounts)
    env = {**os.environ, "HANGAR_DRONE_TOKEN": token, "HANGAR_STATUS_LINE": "off"}
    scratch = tempfile.mkdtemp(prefix="hangar-demo-") if workdir is None else None
    arguments += ["--workdir", workdir or str(scratch), "--log-level", log_level]
    # Its own session: a Ctrl-C in the terminal reaches the demo, which stops the drone once;
    # a demo killed outright takes it along (SIGTERM: it still stops as if Ctrl-C'd).
    drone = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hangar.drone",
        *arguments,
        env=env,
        start_new_session=True,
        preexec_fn=functools.partial(runtime.dies_with, os.getpid()),
    )
    try:
        if not await _drone_connected(runner, drone):
            print("hangar demo: the demo drone did not start.", file=sys.stderr)
            return 1
        print(f"Hangar demo running: open {base}/ in your browser", flush=True)
        print(f"One drone is connected, using {label}. Press Ctrl-C to stop.", flush=True)
        where = f"{scratch} (removed when the demo stops)" if scratch else workdir
        print(f"Its tools work in {where}.", flush=True)
        stopped = asyncio.ensure_future(root.signal.wait())
        exited = asyncio.ensure_future(drone.wait())
        await asyncio.wait((stopped, exited), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        exited.cancel()
        return 0 if root.signal.aborted else 1
    finally:
        await _stop_child(drone)
        await runner.cleanup()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


async def _has_accounts(config: RelayConfig) -> bool:
    store = open_store(config.database)
    try:
        await store.open()
    except Exception as error:
        log.debug("the database could not be opened", exc_info=True)
        raise RelayStartError(_cannot_open(config, error)) from error
    try:
        return bool(await Accounts(store).users())
    finally:
        await store.close()


async def _demo_drone_token(accounts: Accounts) -> str:
    """A fresh token for the demo's drone (an earlier run's is revoked)."""
    await accounts.revoke_drone_token(DEMO_DRONE)
    return await accounts.create_drone_token(DEMO_DRONE)


async def _drone_connected(runner: web.AppRunner, drone: asyncio.subprocess.Process) -> bool:
    relay = runner.app[RELAY]
    deadline = asyncio.get_running_loop().time() + DRONE_START_TIMEOUT
    while not relay.directory.local:
        if drone.returncode is not None or asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)  # polling a child process start, bounded above
    return True


async def _stop_child(process: asyncio.subprocess.Process) -> None:
    """Shut the drone down (it aborts its turns and reports them aborted by a shutdown), then
    kill it if it lingers."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), DRONE_STOP_TIMEOUT)
        except TimeoutError:
            process.kill()
            await process.wait()


def run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        config = relay_config(args)
        if args.drone_token:
            config.drone_token = args.drone_token
        return runtime.run(serve(config, bool(args.drone_token)))
    return runtime.run(demo(relay_config(args), args.model, args.workdir, args.log_level))
