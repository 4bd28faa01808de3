"""``hangar demo``: a relay and one drone, until Ctrl-C.

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
    add_setting,
    holds_database,
    model_name,
    work_directory,
)
from hangar.shared.shown import shown, without_password

from .access import is_loopback
from .accounts import AccountError, Accounts, User
from .app import ACCESS, RELAY, RelayConfig, open_store
from .cli import (
    SHUTDOWN,
    RelayStartError,
    add_relay_arguments,
    cannot_open,
    relay_config,
    relay_url,
    start_relay,
)
from .demo_model import DEMO_MODEL, DEMO_PATH
from .sqlite_file import new_file, remove_new

log = logging.getLogger("hangar")

DRONE_START_TIMEOUT = 30.0
DRONE_STOP_TIMEOUT = 10.0
DEMO_USER = "demo"
DEMO_DRONE = "demo-drone"
TAKEN = (
    "hangar demo: this database has a person named {}, whom the demo would log every visitor in "
    "as; run the demo on a database of its own (--database)."
)


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="run a relay and one drone",
        description="Run a relay and one drone. With no OPENAI_API_KEY or OLLAMA_HOST the drone "
        "talks to the built-in offline demo model.",
    )
    add_relay_arguments(demo)
    add_setting(
        demo, "--model", env="HANGAR_MODEL", default="", check=model_name, help="(HANGAR_MODEL)"
    )
    add_setting(
        demo,
        "--workdir",
        env="HANGAR_WORKDIR",
        default=None,
        check=work_directory,
        help="an existing directory, the only one the drone's tools may touch (HANGAR_WORKDIR; "
        "default: a fresh folder in the system's temporary folder, removed when the demo stops)",
    )


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
        label = f"Ollama model {chosen} at {without_password(ollama_host)}"
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
    made = new_file(config.database)

    def refused(code: int) -> int:
        remove_new(made)  # a demo that cannot start leaves no database behind
        return code

    try:
        async with root.signal.scope():  # Ctrl-C while the database does not answer
            people = await _people(config)
            for p in people if config.demo_user else ():  # whom visitors would be logged in as
                if p.name.lower() == DEMO_USER and (
                    p.name != DEMO_USER or p.has_password or not p.admin
                ):
                    print(TAKEN.format(p.name), file=sys.stderr)
                    return refused(2)
            if not is_loopback(config.host) and not people:
                print(
                    f"hangar demo: on {config.host} the page is open to the network and needs "
                    f"accounts: add one with hangar user add NAME --admin --database "
                    f"{shown(config.database)}",
                    file=sys.stderr,
                )
                return refused(2)
            runner, port = await start_relay(config)
    except RelayStartError as error:
        print(f"hangar demo: {error}", file=sys.stderr)
        return refused(1)
    except AbortError:
        return refused(0)
    accounts = runner.app[RELAY].accounts
    base = relay_url(config.host, port)
    arguments, label = demo_drone_arguments(base, model)
    try:
        token = await _demo_drone_token(accounts)
    except AccountError as error:  # a drone token of that name in another case, say
        await runner.cleanup()
        print(f"hangar demo: {error}", file=sys.stderr)
        return 2
    env = {**os.environ, "HANGAR_DRONE_TOKEN": token, "HANGAR_STATUS_LINE": "off"}
    scratch = tempfile.mkdtemp(prefix="hangar-demo-") if workdir is None else None
    if scratch:  # also when a second Ctrl-C stops the demo at once
        runtime.LAST_WORDS.append(functools.partial(shutil.rmtree, scratch, ignore_errors=True))
    arguments += ["--workdir", workdir or str(scratch), "--log-level", log_level]
    # Its own session: a Ctrl-C in the terminal reaches the demo, which stops the drone once;
    # a demo killed outright takes it along (SIGTERM: it still stops as if Ctrl-C'd).
    drone = await asyncio.create_subprocess_exec(
        sys.executable,
        "-P",  # not the current folder first on the module path: its commands may write there
        "-m",
        "hangar.drone",
        *arguments,
        env=env,
        start_new_session=True,
        preexec_fn=functools.partial(runtime.dies_with, os.getpid()),
    )
    try:
        try:
            async with root.signal.scope():  # Ctrl-C before the drone is up: it stops here
                connected = await _drone_connected(runner, drone)
        except AbortError:
            return 0
        if not connected:
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
        if root.signal.aborted:
            return 0
        print(
            f"hangar demo: its drone stopped ({_how(drone.returncode)}), so the demo stops too.",
            file=sys.stderr,
        )
        return 1
    finally:
        await _stop_child(drone)
        try:
            await end_demo(runner.app)
        except Exception as error:  # the database failed: said, the demo still stops
            print(f"hangar demo: its logins could not be ended: {error}", file=sys.stderr)
        await runner.cleanup()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


async def end_demo(app: web.Application) -> None:
    """What ends with a demo, so that it opens no relay started later on its database: its
    visitors' logins (none is made from now on: a page logged out goes back through ``/`` once a
    relay answers, where a demo started again logs it in) and its drone's token."""
    app[ACCESS].demo_user = None
    accounts = app[RELAY].accounts
    if user := await accounts.user(DEMO_USER):
        await accounts.end_logins(user)
    await accounts.revoke_drone_token(DEMO_DRONE)


def _how(code: int | None) -> str:
    """How a child process ended, as its exit code says."""
    if code is not None and code < 0:
        return f"by the signal {signal.Signals(-code).name}"
    return f"with exit code {code}"


async def _people(config: RelayConfig) -> list[User]:
    store = open_store(config.database)
    try:
        await store.open()
    except Exception as error:
        log.debug("the database could not be opened", exc_info=True)
        raise RelayStartError(cannot_open(config, error)) from error
    try:
        return await Accounts(store).users()
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
    return runtime.run(demo(relay_config(args), args.model, args.workdir, args.log_level))
