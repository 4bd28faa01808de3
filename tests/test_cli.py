"""The ``hangar`` command as a person meets it: one clear line for every bad value, help that
always works, ``--log-level`` anywhere, a drone that waits for its relay, quiet logs and quiet
stops. Every test runs the real command in a subprocess."""

from __future__ import annotations

import argparse
import asyncio
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.drone.cli import add_arguments, config_from
from hangar.server.access import LOGIN_COOKIE
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.shared import cli
from hangar.shared.protocol import DroneRecord
from tests.conftest import (
    DRONE_TOKEN,
    HANGAR,
    ROOT,
    Browser,
    RelayHandle,
    Upstream,
    eventually,
    relay_folder,
)
from tests.test_drone_workers import children_of


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without Hangar's, OpenAI's or Ollama's settings, plus ``extra``."""
    prefixes = ("HANGAR_", "OPENAI_", "OLLAMA_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)} | extra


async def hangar(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> tuple[int, str, str]:
    """Run ``hangar ARGS`` to its end: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        *HANGAR, *args, cwd=cwd, env=clean_env(**(env or {})),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def start(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    """Start ``hangar ARGS`` with its stdout and stderr readable."""
    return await asyncio.create_subprocess_exec(
        *HANGAR, *args, cwd=ROOT, env=clean_env(**(env or {})),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def lines_until(
    stream: asyncio.StreamReader | None, wanted: Callable[[str], bool], timeout: float = 20
) -> list[str]:
    """Read lines from ``stream`` up to and including the first one ``wanted`` accepts."""
    assert stream is not None
    seen: list[str] = []
    async with asyncio.timeout(timeout):
        while not seen or not wanted(seen[-1]):
            line = await stream.readline()
            assert line, f"the output ended before the line waited for: {seen}"
            seen.append(line.decode().rstrip("\n"))
    return seen


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def loud_lines(text: str) -> list[str]:
    """Log lines at WARNING or above, and any traceback."""
    return [
        line
        for line in text.splitlines()
        if re.search(r" (WARNING|ERROR|CRITICAL) ", line) or "Traceback" in line
    ]


NO_DIR = "/nonexistent/hangar-work"
URLS = "expected relay URLs starting with http:// or https://, separated by commas"
SECONDS = "expected a number of seconds, 0 or more"
LEVELS = "expected one of debug, info, warning, error, critical"


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["drone", "--server", "relay:8080"], {},
         f"hangar drone: --server: {URLS}, got 'relay:8080'."),
        (["drone"], {"HANGAR_SERVER": "http://a:8080,b:8080"},
         f"hangar drone: HANGAR_SERVER (for --server): {URLS}, got 'b:8080'."),
        (["drone", "--base-url", "localhost:11434/v1"], {},
         "hangar drone: --base-url: expected a URL starting with http:// or https://, "
         "got 'localhost:11434/v1'."),
        (["drone"], {"OPENAI_BASE_URL": "http://"},
         "hangar drone: OPENAI_BASE_URL (for --base-url): expected a host in the URL, "
         "got 'http://'."),
        (["drone"], {"HANGAR_PROVIDER": "claude"},
         "hangar drone: HANGAR_PROVIDER (for --provider): expected one of openai, ollama, "
         "got 'claude'."),
        (["drone", "--server", "http://a b:80"], {},
         f"hangar drone: --server: {URLS}, got 'http://a b:80'."),
        (["serve", "--host", ""], {},
         "hangar serve: --host: expected a name or address to listen on, got ''."),
        (["serve", "--host", "127.0.0.1:8080"], {},
         "hangar serve: --host: expected a name or address to listen on (the port is --port), "
         "got '127.0.0.1:8080'."),
        (["drone", "--ollama-host", "ftp://ollama"], {},
         "hangar drone: --ollama-host: expected a URL starting with http:// or https://, "
         "or host:port, got 'ftp://ollama'."),
        (["serve", "--redis", "cache:6379"], {},
         "hangar serve: --redis: expected a URL starting with redis://, rediss:// or unix://, "
         "got 'cache:6379'."),
        (["demo"], {"HANGAR_REDIS": "redis://cache:port"},
         "hangar demo: HANGAR_REDIS (for --redis): expected a port number in the URL, "
         "got 'redis://cache:port'."),
        (["serve", "--database", "mysql://db/hangar"], {},
         "hangar serve: --database: expected a SQLite file or a postgresql:// URL, "
         "got 'mysql://db/hangar'."),
        (["serve"], {"HANGAR_DATABASE": f"{NO_DIR}/hangar.db"},
         f"hangar serve: HANGAR_DATABASE (for --database): there is no folder '{NO_DIR}' "
         f"for the SQLite file '{NO_DIR}/hangar.db'."),
        (["serve", "--port", "http"], {},
         "hangar serve: --port: expected a port number from 0 to 65535, got 'http'."),
        (["demo"], {"HANGAR_PORT": "70000"},
         "hangar demo: HANGAR_PORT (for --port): expected a port number from 0 to 65535, "
         "got '70000'."),
        (["drone", "--concurrency", "0"], {},
         "hangar drone: --concurrency: expected a whole number from 1 to 1024, got '0'."),
        (["drone"], {"HANGAR_CONCURRENCY": "two"},
         "hangar drone: HANGAR_CONCURRENCY (for --concurrency): expected a whole number "
         "from 1 to 1024, got 'two'."),
        (["serve", "--drone-token", "abc"], {},
         "hangar serve: --drone-token: expected a secret of 16 characters or more (whoever "
         "guesses it may run a drone here), got 3."),
        (["serve"], {"HANGAR_DRONE_TOKEN": "secret"},
         "hangar serve: HANGAR_DRONE_TOKEN (for --drone-token): expected a secret of 16 "
         "characters or more (whoever guesses it may run a drone here), got 6."),
        (["serve", "--abort-grace", "soon"], {},
         f"hangar serve: --abort-grace: {SECONDS}, got 'soon'."),
        (["serve"], {"HANGAR_DRONE_GRACE": "-1"},
         f"hangar serve: HANGAR_DRONE_GRACE (for --drone-grace): {SECONDS}, got '-1'."),
        (["drone", "--deadline", "nan"], {},
         f"hangar drone: --deadline: {SECONDS}, got 'nan'."),
        (["drone"], {"HANGAR_DEADLINE": "inf"},
         f"hangar drone: HANGAR_DEADLINE (for --deadline): {SECONDS}, got 'inf'."),
        (["drone", "--cut-off", "never"], {},
         f"hangar drone: --cut-off: {SECONDS}, got 'never'."),
        (["drone", "--status-line", "maybe"], {},
         "hangar drone: --status-line: expected on or off, got 'maybe'."),
        (["drone"], {"HANGAR_STATUS_LINE": "no"},  # was taken as on
         "hangar drone: HANGAR_STATUS_LINE (for --status-line): expected on or off, got 'no'."),
        (["drone", "--tools", "run_shell=maybe"], {},
         "hangar drone: --tools: expected TOOL=allow|ask|deny, got 'run_shell=maybe'."),
        (["user", "list", "--database", f"{NO_DIR}/x.db"], {},
         f"hangar user list: --database: there is no folder '{NO_DIR}' for the SQLite file "
         f"'{NO_DIR}/x.db'."),
        (["serve", "--database", "/dev/null"], {},
         "hangar serve: --database: '/dev/null' is not a file (a pipe or a device), so not a "
         "SQLite file."),
        (["drone-token", "list"], {"HANGAR_DATABASE": "mysql://x/y"},
         "hangar drone-token list: HANGAR_DATABASE (for --database): expected a SQLite file or "
         "a postgresql:// URL, got 'mysql://x/y'."),
        (["serve", "--allowed-origin", "proxy.example"], {},
         "hangar serve: --allowed-origin: expected a URL starting with http:// or https://, got "
         "'proxy.example'."),
        (["serve"], {"HANGAR_ALLOWED_ORIGINS": "https://ok.example,https://x.example/app"},
         "hangar serve: HANGAR_ALLOWED_ORIGINS (for --allowed-origin): expected an origin such "
         "as https://hangar.example, got 'https://x.example/app'."),
        (["drone", "--name", "bad name"], {},
         "hangar drone: --name: expected 1-64 letters, digits, '.', '_' or '-', starting with a "
         "letter or digit, got 'bad name'."),
        (["drone", "--model", "m" * 300], {},
         "hangar drone: --model: expected a model name of 1-256 characters, got 300."),
        (["drone", "--workdir", NO_DIR], {},
         f"hangar drone: --workdir: there is no directory '{NO_DIR}'."),
        (["drone", "--workdir", "pyproject.toml"], {},
         "hangar drone: --workdir: 'pyproject.toml' is not a directory."),
        (["demo"], {"HANGAR_WORKDIR": NO_DIR},
         f"hangar demo: HANGAR_WORKDIR (for --workdir): there is no directory '{NO_DIR}'."),
        (["--log-level", "loud", "serve"], {},
         f"hangar: --log-level: {LEVELS}, got 'loud'."),
        (["drone", "--log-level", "loud"], {},
         f"hangar drone: --log-level: {LEVELS}, got 'loud'."),
        (["user", "list"], {"HANGAR_LOG_LEVEL": "loud"},
         f"hangar: HANGAR_LOG_LEVEL (for --log-level): {LEVELS}, got 'loud'."),
        (["serve"], {"HANGAR_DRONE_TOKEN": "hgd.desk.0123456789abcdefghij"},  # a drone's
         "hangar serve: HANGAR_DRONE_TOKEN (for --drone-token): expected a secret every drone "
         "may present, got a drone's own token (hgd.…, from hangar drone-token create), which "
         "needs no setting here."),
        (["serve", "--drone-grace", "1e300"], {},  # it started, and no drone could connect
         "hangar serve: --drone-grace: expected a number of seconds from 0 to 3600, "
         "got '1e300'."),
    ],
    ids=[
        "server-without-scheme", "server-env-list", "base-url-without-scheme",
        "base-url-env-without-host", "provider-env", "server-with-a-space", "host-empty",
        "host-with-a-port",
        "ollama-host-scheme", "redis-without-scheme", "redis-env-port", "database-scheme",
        "database-env-folder", "port", "port-env",
        "concurrency", "concurrency-env", "drone-token", "drone-token-env", "abort-grace",
        "drone-grace-env", "deadline",
        "deadline-env", "cut-off", "status-line", "status-line-env", "tools", "allowed-origin",
        "allowed-origin-env",
        "accounts-database", "database-a-device", "accounts-database-env", "name", "model",
        "workdir-missing", "workdir-a-file", "demo-workdir-env",
        "log-level-before", "log-level-after", "log-level-env", "a-drones-own-token",
        "drone-grace-too-long",
    ],
)  # fmt: skip
async def test_a_bad_value_is_one_line_naming_it_with_exit_code_2(
    args: list[str], env: dict[str, str], line: str
) -> None:
    code, stdout, stderr = await hangar(*args, env=env)

    assert (code, stdout) == (2, "")
    assert stderr.splitlines() == [line]


@pytest.mark.parametrize("command", ["serve", "drone", "demo"])
async def test_an_event_loop_hangar_cannot_run_on_is_refused_before_anything_starts(
    tmp_path: Path, command: str
) -> None:
    database = tmp_path / "hangar.db"
    args = {
        "serve": ["--port", "0", "--database", str(database)],
        "drone": ["--server", "http://127.0.0.1:9", "--token", DRONE_TOKEN, "--api-key", "k"],
        "demo": ["--port", "0", "--database", str(database)],
    }[command]

    code, stdout, stderr = await hangar(command, *args, env={"HANGAR_EVENT_LOOP": "tokio"})

    assert (code, stdout) == (2, "")
    assert stderr.splitlines() == [
        "hangar: HANGAR_EVENT_LOOP: expected uvloop or asyncio, got 'tokio'."
    ]
    assert not database.exists()


@pytest.mark.parametrize(
    "args",
    [["--help"], ["serve", "--help"], ["demo", "--help"], ["drone", "--help"],
     ["user", "add", "--help"]],
    ids=["hangar", "serve", "demo", "drone", "user-add"],
)  # fmt: skip
async def test_help_works_whatever_the_environment_holds(args: list[str]) -> None:
    bad = {
        name: "bad"
        for name in (
            "HANGAR_PORT", "HANGAR_LOG_LEVEL", "HANGAR_CONCURRENCY", "HANGAR_DEADLINE",
            "HANGAR_ABORT_GRACE", "HANGAR_DRONE_GRACE", "HANGAR_SERVER", "HANGAR_WORKDIR",
            "HANGAR_REDIS", "HANGAR_BASE_URL", "OLLAMA_HOST",
        )
    }  # fmt: skip

    code, stdout, stderr = await hangar(*args, env=bad)

    assert (code, stderr) == (0, "")
    assert stdout.startswith("usage: hangar")


async def test_a_bad_variable_is_reported_only_by_a_command_that_uses_it() -> None:
    code, _, stderr = await hangar(
        "drone", env={"HANGAR_PORT": "abc", "HANGAR_ABORT_GRACE": "later"}
    )

    assert code == 2
    assert stderr.splitlines() == [
        "hangar drone: a drone token is required (--token or HANGAR_DRONE_TOKEN)."
    ]


async def test_an_openai_drone_without_a_key_or_a_service_address_does_not_start() -> None:
    """It started, and every turn failed later (OpenAI answered 401 to the key "unused")."""
    code, _, stderr = await hangar("drone", "--token", "x" * 20, "--provider", "openai")

    assert (code, stderr) == (
        2,
        "hangar drone: the openai provider needs an API key (--api-key or OPENAI_API_KEY), or "
        "--base-url for a service that needs none.\n",
    )


async def test_the_relay_asks_for_drone_tokens_only_while_there_are_none(tmp_path: Path) -> None:
    """It said "Drones need a token: hangar drone-token create…" on every start."""
    db = str(tmp_path / "hangar.db")
    said = []
    for round_ in range(2):
        relay = await start("serve", "--port", "0", "--database", db)
        await lines_until(relay.stdout, lambda line: "listening on" in line)
        relay.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(relay.communicate(), 20)
        said.append(out.decode())
        if round_ == 0:
            assert (await hangar("drone-token", "create", "desk", "--database", db))[0] == 0

    assert "Drones need a token" in said[0]
    assert "Drones need a token" not in said[1]


def waiting_drone_args(port: int) -> list[str]:
    return [
        "drone", "--server", f"http://127.0.0.1:{port}", "--token", DRONE_TOKEN,
        "--base-url", "http://127.0.0.1:9/v1", "--api-key", "k", "--workdir", str(ROOT),
    ]  # fmt: skip


def not_up_yet(port: int, delay: int = 1) -> Callable[[str], bool]:
    said = f"WARNING hangar.drone relay http://127.0.0.1:{port} is not up yet; trying again in "
    return lambda line: line.endswith(f"{said}{delay} s")


def before_the_program(stderr: bytes, launcher: str) -> bool:
    """A Ctrl-C that came while the interpreter was still starting or finding the program's
    first module: Python's report of it holds the launcher and its own frozen code only."""
    lines = stderr.decode().splitlines()
    frames = [line.strip() for line in lines if line.lstrip().startswith("File ")]
    ours = [f for f in frames if not f.startswith(('File "<frozen ', f'File "{launcher}"'))]
    return any(line.startswith("KeyboardInterrupt") for line in lines) and not ours


async def test_ctrl_c_while_the_command_loads_exits_130_without_a_traceback() -> None:
    """README: Ctrl-C while the program is still loading exits 130 with no more to say. The
    installed ``hangar`` imported the command before it could catch the Ctrl-C: in its first
    tenth of a second, a Ctrl-C printed a traceback (exit code 1)."""
    command = str(Path(sys.executable).parent / "hangar")
    for attempt in range(20):  # the first 0.1 s, in steps of 5 ms
        process = await asyncio.create_subprocess_exec(
            command, "drone", "--token", DRONE_TOKEN, env=clean_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.sleep(attempt * 0.005)  # when the Ctrl-C comes is what is tried
        process.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(process.communicate(), 20)
        if b"Fatal Python error" in stderr or before_the_program(stderr, command):
            continue  # the interpreter's own start, before any of the program runs
        assert b"Traceback" not in stderr, (attempt, stderr.decode())
        assert process.returncode in (130, -signal.SIGINT), (attempt, stderr.decode())


async def test_a_relay_urls_password_is_not_in_the_drones_log() -> None:
    """A relay behind a proxy that asks for basic auth is given as http://user:password@…:
    the drone wrote the password in every line about that relay."""
    port = free_port()
    args = waiting_drone_args(port)
    args[2] = f"http://probe:s3cret-pass@127.0.0.1:{port}"
    drone = await start(*args)
    said = f"relay http://probe:***@127.0.0.1:{port} is not up yet; trying again in 1 s"
    try:
        lines = await lines_until(drone.stderr, lambda line: line.endswith(said))
    finally:
        drone.send_signal(signal.SIGINT)
        _, rest = await asyncio.wait_for(drone.communicate(), 10)

    assert not [line for line in [*lines, *rest.decode().splitlines()] if "s3cret" in line]


@pytest.mark.parametrize(
    ("before", "after", "env"),
    [
        (["--log-level", "debug"], [], {}),
        ([], ["--log-level", "DEBUG"], {}),
        ([], [], {"HANGAR_LOG_LEVEL": "debug"}),
        (["--log-level", "error"], ["--log-level", "debug"], {"HANGAR_LOG_LEVEL": "error"}),
    ],
    ids=["before-the-subcommand", "after-it", "from-the-environment", "after-wins"],
)
async def test_the_log_level_is_taken_before_or_after_the_subcommand_or_from_the_environment(
    before: list[str], after: list[str], env: dict[str, str]
) -> None:
    port = free_port()
    drone = await start(*before, *waiting_drone_args(port), *after, env=env)
    try:
        lines = await lines_until(drone.stderr, not_up_yet(port))
    finally:
        drone.send_signal(signal.SIGINT)
        await asyncio.wait_for(drone.wait(), 10)

    assert any(" DEBUG " in line for line in lines), lines
    assert drone.returncode == 0


async def test_a_drone_started_before_its_relay_waits_and_connects_when_it_comes_up(
    tmp_path: Path,
) -> None:
    port = free_port()
    drone = await start(*waiting_drone_args(port))
    try:
        await lines_until(drone.stderr, not_up_yet(port, delay=1))
        config = RelayConfig(
            port=port, database=str(relay_folder(tmp_path) / "relay.db"), drone_token=DRONE_TOKEN
        )
        runner, _ = await start_relay(config)
        try:
            url = f"http://127.0.0.1:{port}/healthz"

            async def drones_online() -> int:
                async with aiohttp.ClientSession() as http, http.get(url) as health:
                    count: int = (await health.json())["drones"]
                    return count

            assert await eventually(drones_online, timeout=15, what="the drone") == 1
            assert runner.app[RELAY].directory.local
        finally:
            drone.send_signal(signal.SIGINT)
            await asyncio.wait_for(drone.wait(), 10)
            await runner.cleanup()
    finally:
        if drone.returncode is None:
            drone.kill()
            await drone.wait()
    assert drone.stderr is not None
    rest = (await drone.stderr.read()).decode()
    assert f"INFO hangar.drone connected to relay http://127.0.0.1:{port}" in rest
    assert drone.returncode == 0


async def test_ctrl_c_stops_a_drone_waiting_for_its_relay_at_once() -> None:
    port = free_port()
    drone = await start(*waiting_drone_args(port))
    # The third attempt waits 3 s: an exit well within that did not sit the wait out.
    lines = await lines_until(drone.stderr, not_up_yet(port, delay=3))

    drone.send_signal(signal.SIGINT)

    assert await asyncio.wait_for(drone.wait(), 2) == 0
    assert [line.rsplit(" in ", 1)[1] for line in lines if "not up yet" in line] == [
        "1 s",
        "2 s",
        "3 s",
    ]


async def first_retry(args: list[str]) -> list[str]:
    """What a drone started with ``args`` writes up to its first "trying again" warning; then
    a Ctrl-C stops it, with exit code 0."""
    drone = await start(*args)
    try:
        lines = await lines_until(drone.stderr, lambda line: "trying again in" in line)
        drone.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(drone.wait(), 10) == 0
    finally:
        if drone.returncode is None:
            drone.kill()
            await drone.wait()
    return lines


@pytest.mark.parametrize(
    ("scheme", "said"),
    [
        ("http", "it answers HTTP 404 Not Found at /socket.io/, as no Hangar relay does"),
        ("https", "it does not speak HTTPS (http:// instead?)"),
    ],
)
async def test_a_drone_pointed_at_what_is_not_a_relay_says_what_answers_there(
    scheme: str, said: str
) -> None:
    """python-socketio says only "Connection error": "not up yet" would have its operator wait
    for ever on a mistyped address."""
    runner = web.AppRunner(web.Application())  # a web server, not a relay: 404 everywhere
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    args = waiting_drone_args(port)
    args[args.index("--server") + 1] = f"{scheme}://127.0.0.1:{port}"
    try:
        lines = await first_retry(args)
    finally:
        await runner.cleanup()

    assert lines[-1].endswith(
        f"WARNING hangar.drone relay {scheme}://127.0.0.1:{port} is not reachable as a relay: "
        f"{said}; trying again in 1 s"
    )


async def test_a_drone_pointed_at_a_relay_that_accepts_but_never_answers_says_so() -> None:
    """A relay frozen (or its machine overloaded) still completes TCP handshakes in its kernel:
    the drone waited 5 s for its websocket and 3 s for a look, then said "not up yet; trying
    again in 1 s", nine seconds apart, as if nothing listened there."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # handshakes complete; nothing is ever read or written
        port = silent.getsockname()[1]
        lines = await first_retry(waiting_drone_args(port))

    assert lines[-1].endswith(
        f"WARNING hangar.drone relay http://127.0.0.1:{port} is not reachable as a relay: it "
        "accepts connections but answers nothing (a relay frozen or overloaded?); trying again "
        "in 1 s"
    )


async def test_a_second_relay_on_the_same_sqlite_file_is_refused_while_the_first_runs(
    tmp_path: Path,
) -> None:
    """Two relays on one SQLite file would each take the other's turns for orphans and end
    them; several relays share a PostgreSQL database instead."""
    db = str(tmp_path / "hangar.db")
    first = await start("serve", "--port", "0", "--database", db, "--drone-token", DRONE_TOKEN)
    try:
        await lines_until(first.stdout, lambda line: "listening on" in line)

        second = await hangar("serve", "--port", "0", "--database", db)
        as_url = await hangar("serve", "--port", "0", "--database", f"sqlite:///{db}")
        accounts = await hangar("user", "add", "ada", "--no-password", "--database", db)

        assert second == (
            1,
            "",
            f"hangar serve: cannot open the database {db}: another relay uses it (one relay per "
            "SQLite file; relays that share their work share a PostgreSQL database).\n",
        )
        assert f"cannot open the database sqlite:///{db}: another relay" in as_url[2]
        assert accounts[0] == 0  # the account commands work beside the running relay
    finally:
        first.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(first.wait(), 10) == 0
    again = await start("serve", "--port", "0", "--database", db, "--drone-token", DRONE_TOKEN)
    try:  # once the first has stopped, the file is free
        await lines_until(again.stdout, lambda line: "listening on" in line)
    finally:
        again.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(again.wait(), 10) == 0


@pytest.mark.parametrize("command", ["serve", "demo"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
async def test_ctrl_c_stops_a_relay_waiting_for_its_database_at_once(
    command: str, signum: signal.Signals
) -> None:
    """A database server that takes the connection and never answers (a stalled PostgreSQL).
    A closed terminal (SIGHUP) stops it as Ctrl-C does."""
    connected = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        connected.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        relay = await start(
            command, "--port", "0", "--database", f"postgresql://x@127.0.0.1:{port}/x"
        )
        await asyncio.wait_for(connected.wait(), 20)

        relay.send_signal(signum)

        assert await asyncio.wait_for(relay.wait(), 5) == 0
        assert relay.stderr is not None
        assert "Traceback" not in (await relay.stderr.read()).decode()
    finally:
        for writer in held:
            writer.close()
        server.close()


async def test_a_work_order_at_info_logs_no_request_lines(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(Reply(chunks=["one ", "answer"]))
    process = drone_process(Upstream("openai", openai_peer), server=relay.url, name="quiet")
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")

    ack = await browser.submit("Say something")
    assert (await browser.completion(ack["turnId"]))[1:] == (True, "one answer")
    process.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(process.wait, 10) == 0

    log = (tmp_path / "quiet-0.log").read_text()
    assert "accepted=True" in log  # the drone's own INFO lines are there
    assert "HTTP Request" not in log


async def test_ctrl_c_stops_a_drone_with_no_warning(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    process = drone_process(Upstream("openai", openai_peer), server=relay.url, name="calm")
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")

    process.send_signal(signal.SIGINT)

    assert await asyncio.to_thread(process.wait, 10) == 0
    log = (tmp_path / "calm-0.log").read_text()
    assert "connected to relay" in log
    assert loud_lines(log) == []


async def test_log_lines_in_a_terminal_are_written_above_the_status_line_never_on_it(
    relay: RelayHandle, openai_peer: OpenAIPeer, browser: Browser, tmp_path: Path
) -> None:
    openai_peer.script(Reply(chunks=["a", "b", "c"]))
    leader, follower = pty.openpty()
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "drone", "--server", relay.url, "--token", DRONE_TOKEN, "--workdir",
        str(tmp_path), "--base-url", openai_peer.base_url + "/v1", "--api-key", "k",
        cwd=ROOT, env=clean_env(), stdin=follower, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    screen = ""

    async def read_until(text: str) -> None:
        nonlocal screen
        while text not in screen:
            chunk = await asyncio.wait_for(asyncio.to_thread(os.read, leader, 4096), 15)
            screen += chunk.decode(errors="replace")

    try:
        await read_until("chunks streamed")
        ack = await browser.submit("Hello")
        await browser.completion(ack["turnId"])
        await read_until("3 chunks streamed")
    finally:
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 10)
        os.close(leader)

    # Each stretch between two "clear the line" sequences is the status line, or log lines
    # (each ending its own line) followed by the status line drawn again.
    stretches = screen.split("\r\x1b[K")
    logged = [s for s in stretches if "\n" in s]
    assert any("work order turn=" in s for s in logged)
    assert [s for s in logged if not re.match(r"\d{4}-\d\d-\d\d ", s)] == []
    assert process.returncode == 0


TRANSPORT_NOTE = """
import logging, sys
import socketio
from hangar.shared.logs import configure_logging
configure_logging(sys.argv[1])
client = socketio.AsyncClient()  # as the drone makes its own: after the logging is set up
logging.getLogger("engineio.client").error("packet queue is empty, aborting")
"""


@pytest.mark.parametrize(
    ("level", "shown"),
    [("INFO", []), ("DEBUG", ["DEBUG engineio.client packet queue is empty, aborting"])],
    ids=["info", "debug"],
)
async def test_socketio_notes_about_a_connection_are_debug_lines_not_errors(
    level: str, shown: list[str]
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TRANSPORT_NOTE, level, cwd=ROOT, env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 30)

    assert process.returncode == 0
    assert [line.split(" ", 2)[2] for line in stderr.decode().splitlines()] == shown


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_stopping_a_relay_logs_no_warning(
    tmp_path: Path, openai_peer: OpenAIPeer, signum: signal.Signals
) -> None:
    relay = await start(
        "serve", "--port", "0", "--database", str(relay_folder(tmp_path) / "relay.db"),
        "--drone-token", DRONE_TOKEN,
    )  # fmt: skip
    (line,) = await lines_until(relay.stdout, lambda line: "listening on" in line)
    url = line.rsplit(" ", 1)[1].rstrip("/")
    drone = await start(
        "drone", "--server", url, "--token", DRONE_TOKEN, "--workdir", str(tmp_path),
        "--base-url", openai_peer.base_url + "/v1", "--api-key", "k",
    )  # fmt: skip
    try:
        await lines_until(relay.stderr, lambda line: "drone online" in line)
        drone.send_signal(signal.SIGINT)
        await asyncio.wait_for(drone.wait(), 10)
        await lines_until(relay.stderr, lambda line: "drone offline" in line)

        relay.send_signal(signum)

        _, rest = await asyncio.wait_for(relay.communicate(), 10)
    finally:
        for process in (drone, relay):
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert relay.returncode == 0
    assert loud_lines(rest.decode()) == []


@pytest.fixture
async def demo_peer() -> AsyncIterator[OpenAIPeer]:
    """An OpenAI peer the demo's drone talks to (through OPENAI_BASE_URL)."""
    async with OpenAIPeer() as peer:
        yield peer


async def run_demo(
    peer: OpenAIPeer, tmp_path: Path, *args: str, cwd: Path | None = None
) -> tuple[asyncio.subprocess.Process, str, Browser]:
    """Start ``hangar demo`` on the peer; its page's URL and a logged-in browser."""
    env = clean_env(OPENAI_API_KEY="k", OPENAI_BASE_URL=peer.base_url + "/v1")
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--port", "0", "--database", str(relay_folder(tmp_path) / "demo.db"),
        *args,
        cwd=cwd or tmp_path, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    lines = await lines_until(process.stdout, lambda line: line.startswith("Its tools work in"))
    url = re.search(r"open (http://\S+)/ in your browser", "\n".join(lines))
    assert url, lines
    async with aiohttp.ClientSession() as http, http.get(url.group(1)) as page:
        login = page.cookies[LOGIN_COOKIE].value
    browser = await Browser(url.group(1), login=login).connect()
    return process, lines[-1], browser


async def stop_demo(process: asyncio.subprocess.Process, browser: Browser) -> str:
    """Ctrl-C the demo; returns what it wrote on stderr."""
    await browser.close()
    process.send_signal(signal.SIGINT)
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    return stderr.decode()


def in_system_temp_folder(path: Path) -> bool:
    return path.parent.resolve() == Path(tempfile.gettempdir()).resolve()


def exists(path: Path) -> bool:
    return path.exists()


def tool_results(peer: OpenAIPeer) -> list[Any]:
    return [m["content"] for r in peer.requests for m in r.messages if m["role"] == "tool"]


async def test_the_demo_drone_works_in_the_folder_given(
    demo_peer: OpenAIPeer, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker.txt").write_text("here")
    demo_peer.script(
        Reply(tool_calls=[ScriptedToolCall("list_directory", {"path": "."})]),
        Reply(chunks=["Listed."]),
    )
    process, where, browser = await run_demo(demo_peer, tmp_path, "--workdir", str(work))
    try:
        ack = await browser.submit("What is in the folder?")
        assert (await browser.completion(ack["turnId"], timeout=30))[1] is True
    finally:
        stderr = await stop_demo(process, browser)

    assert where == f"Its tools work in {work}."
    assert any("marker.txt" in str(result) for result in tool_results(demo_peer))
    assert process.returncode == 0
    assert loud_lines(stderr) == []


async def test_the_demo_drone_works_in_a_fresh_folder_removed_when_the_demo_stops(
    demo_peer: OpenAIPeer, tmp_path: Path
) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    demo_peer.script(
        Reply(tool_calls=[ScriptedToolCall("write_file", {"path": "n.txt", "content": "hi"})]),
        Reply(chunks=["Written."]),
    )
    process, where, browser = await run_demo(demo_peer, tmp_path, cwd=checkout)
    try:
        found = re.fullmatch(r"Its tools work in (\S+) \(removed when the demo stops\)\.", where)
        assert found, where
        scratch = Path(found.group(1))
        assert in_system_temp_folder(scratch)
        ack = await browser.submit("Write a note")
        # The demo's drone keeps the default policy: a write waits for the person.
        waiting = await eventually(
            lambda: [p for p in browser.progress(ack["turnId"], "tool") if p["state"] == "waiting"],
            30,
            "the write to wait for approval",
        )
        answer = {"turnId": ack["turnId"], "callId": waiting[0]["callId"], "approve": True}
        assert await browser.call("approveToolCall", answer) == {"ok": True}
        assert (await browser.completion(ack["turnId"], timeout=30))[1] is True
        assert (scratch / "n.txt").read_text() == "hi"
    finally:
        stderr = await stop_demo(process, browser)

    assert not exists(scratch)
    assert list(checkout.iterdir()) == []
    assert process.returncode == 0
    assert loud_lines(stderr) == []


async def test_a_demo_whose_drone_dies_says_so_as_it_stops(
    demo_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """It stopped with exit code 1 and no word of why: the last lines were the relay's."""
    process, _, browser = await run_demo(demo_peer, tmp_path)
    await browser.close()
    [drone] = children_of(process.pid)

    os.kill(drone, signal.SIGKILL)
    _, stderr = await asyncio.wait_for(process.communicate(), 30)

    assert process.returncode == 1
    assert (
        "hangar demo: its drone stopped (by the signal SIGKILL), so the demo stops too.\n"
        in stderr.decode()
    )


async def test_a_second_ctrl_c_on_the_demo_still_removes_its_fresh_folder(
    demo_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """A second Ctrl-C (or GNU timeout's two SIGTERMs) exits at once: the folder the demo said
    it would remove, which may hold what the model wrote, was left behind."""
    process, where, browser = await run_demo(demo_peer, tmp_path)
    found = re.fullmatch(r"Its tools work in (\S+) \(removed when the demo stops\)\.", where)
    assert found, where
    await browser.close()

    # Two signals of one kind sent at once may be delivered as one: a SIGTERM, then a Ctrl-C.
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGINT)
    await asyncio.wait_for(process.communicate(), 30)

    assert process.returncode == 130  # the second stopped it at once
    assert not exists(Path(found.group(1)))


async def test_a_drone_refuses_a_work_directory_that_holds_a_relays_database(
    tmp_path: Path,
) -> None:
    """Its tools, and so the model, could read every login and token in it, and write it."""
    code, _, _ = await hangar("drone-token", "create", "d1", "--database", str(tmp_path / "x.db"))
    assert code == 0
    refusal = (
        "holds x.db, a relay's database (its people, logins and tokens): give the drone a "
        "work directory of its own."
    )

    given = await hangar("drone", "--workdir", str(tmp_path))
    current = await hangar("drone", cwd=tmp_path)
    demo = await hangar("demo", env={"HANGAR_WORKDIR": str(tmp_path)})

    assert given == (2, "", f"hangar drone: --workdir: '{tmp_path}' {refusal}\n")
    assert current == (2, "", f"hangar drone: --workdir: '.' {refusal}\n")
    assert demo == (
        2,
        "",
        f"hangar demo: HANGAR_WORKDIR (for --workdir): '{tmp_path}' {refusal}\n",
    )
    # The demo's own database, which it would make there, counts too.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    made_there = await hangar("demo", "--workdir", str(fresh), cwd=fresh)
    assert made_there == (
        2,
        "",
        f"hangar demo: --workdir: '{fresh}' would hold the relay's database (its people, "
        "logins and tokens): give the drone a work directory of its own.\n",
    )
    assert not (fresh / "hangar.db").exists()
    # In a folder of its own, the relay's database no longer stands in the way.
    (tmp_path / "x.db").rename(relay_folder(tmp_path) / "x.db")
    _, _, stderr = await hangar("drone", "--workdir", str(tmp_path))
    assert "--workdir" not in stderr


async def test_an_ollama_host_the_sdk_cannot_read_gets_one_line_and_help_still_works(
    tmp_path: Path,
) -> None:
    """The ollama SDK makes a client of ``OLLAMA_HOST`` as it is imported: a value it cannot
    read failed ``hangar --help``, ``hangar drone`` and ``hangar demo`` with its traceback."""
    bad = {"OLLAMA_HOST": "host:abc"}

    code, usage, _ = await hangar("--help", env=bad)
    drone = await hangar("drone", "--token", "x" * 16, "--workdir", str(tmp_path), env=bad)

    assert code == 0 and usage.startswith("usage: hangar")
    assert drone == (
        2,
        "",
        "hangar drone: OLLAMA_HOST (for --ollama-host): expected a URL starting with http:// "
        "or https://, or host:port, got 'host:abc'.\n",
    )


@pytest.mark.parametrize("command", [["serve"], ["user", "list"]], ids=["serve", "user"])
async def test_a_named_pipe_given_as_the_database_is_refused_at_once(
    tmp_path: Path, command: list[str]
) -> None:
    """Opening a named pipe waits for a writer: the relay hung before its event loop ran, and
    only SIGKILL stopped it."""
    pipe = tmp_path / "hangar.db"
    os.mkfifo(pipe)

    code, _, stderr = await hangar(*command, "--database", str(pipe))

    assert (code, stderr) == (
        2,
        f"hangar {' '.join(command)}: --database: '{pipe}' is not a file (a pipe or a device), "
        "so not a SQLite file.\n",
    )


async def test_a_drone_finds_a_relays_database_among_many_files_in_its_work_directory(
    tmp_path: Path,
) -> None:
    """The check looked at a folder's first 1,000 entries only: beside 20,000 files the
    database was found about one time in twenty, and the drone started."""
    folder = tmp_path / "many"
    folder.mkdir()
    for number in range(20_000):
        (folder / f"file-{number}").touch()
    code, _, _ = await hangar("drone-token", "create", "d1", "--database", str(folder / "x.db"))
    assert code == 0

    code, _, stderr = await hangar("drone", "--workdir", str(folder))

    assert code == 2 and "holds x.db, a relay's database" in stderr


def test_allowed_origins_come_from_each_flag_or_else_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def parsed(*argv: str) -> Any:
        return cli.parser(cli._parts_for(list(argv))).parse_args(list(argv)).allowed_origin

    monkeypatch.delenv("HANGAR_ALLOWED_ORIGINS", raising=False)
    assert parsed("serve") == []
    given = ("--allowed-origin", "https://a.example", "--allowed-origin", "http://b.example:81/")
    assert parsed("serve", *given) == ["https://a.example", "http://b.example:81"]
    monkeypatch.setenv("HANGAR_ALLOWED_ORIGINS", "https://c.example, https://d.example")
    assert parsed("serve") == ["https://c.example", "https://d.example"]
    assert parsed("serve", *given[:2]) == ["https://a.example"]
    # As a browser's Origin header says it: lower case, no default port.
    assert parsed("serve", "--allowed-origin", "HTTPS://Hangar.Example:443/") == [
        "https://hangar.example"
    ]


@pytest.mark.parametrize("where", ["a host that does not resolve", "a port in use"])
async def test_a_relay_that_cannot_listen_says_why_in_one_line_and_nothing_else(
    tmp_path: Path, where: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = "999.1.1.1" if where == "a host that does not resolve" else "127.0.0.1"
        db = str(tmp_path / "relay.db")

        code, stdout, stderr = await hangar(
            "serve", "--host", host, "--port", str(port), "--database", db
        )

    reason = "Name or service not known" if host == "999.1.1.1" else "address already in use"
    assert (code, stdout) == (1, "")
    assert stderr == f"hangar serve: cannot listen on {host}:{port}: {reason}.\n"
    assert os.listdir(tmp_path) == []  # the database it would have made is not left behind


async def test_ctrl_c_while_the_demo_starts_its_drone_stops_it_without_saying_it_runs(
    tmp_path: Path,
) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    demo = await start(
        "demo", "--port", "0", "--database", str(relay_folder(tmp_path) / "demo.db"),
        env={"TMPDIR": str(temporary)},
    )  # fmt: skip
    children = Path(f"/proc/{demo.pid}/task/{demo.pid}/children")
    await eventually(lambda: children.read_text().strip(), 20, "the demo to start its drone")

    demo.send_signal(signal.SIGINT)  # before the drone has connected
    stdout, stderr = await asyncio.wait_for(demo.communicate(), 15)

    assert demo.returncode == 0
    assert "running" not in stdout.decode()
    assert loud_lines(stderr.decode()) == []
    assert list(temporary.iterdir()) == []  # its fresh work folder is gone too


async def test_a_relay_stopped_while_it_waits_for_redis_lets_go_of_its_sqlite_file(
    tmp_path: Path,
) -> None:
    """Stopped mid-start (Ctrl-C while Redis does not answer), a relay closes what it opened,
    so a relay started again in the same process gets the file."""
    greeted: list[bytes] = []
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        greeted.append(await reader.read(100))  # and never answers

    redis = await asyncio.start_server(silent, "127.0.0.1", 0)
    db = str(relay_folder(tmp_path) / "relay.db")
    stalled = RelayConfig(
        port=0, database=db, redis=f"redis://127.0.0.1:{redis.sockets[0].getsockname()[1]}/0"
    )
    try:
        starting = asyncio.ensure_future(start_relay(stalled))
        # The relay's live state and python-socketio's Redis manager each connect and say
        # HELLO; then both wait for an answer.
        await eventually(lambda: len(greeted) == 2, 20, "the relay to wait for Redis")

        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        runner, _ = await start_relay(RelayConfig(port=0, database=db))
        await runner.cleanup()
    finally:
        for writer in held:
            writer.close()
        redis.close()


@pytest.mark.parametrize(
    ("host", "shown"),
    [
        ("build-07.example.org", "build-07.example.org"),
        ("büro pc", "b-ro-pc"),
        ("-" + "x" * 80, "x" * 64),
        ("ÄÖÜ", "drone"),
    ],
)
def test_a_drone_without_a_name_is_shown_under_its_hosts_name_as_a_relay_takes_it(
    monkeypatch: pytest.MonkeyPatch, host: str, shown: str
) -> None:
    """A relay lets a drone in only under a name that cannot read as another drone's: a host
    named outside that (a space, a letter beyond ASCII, 80 characters) would have kept its drone
    out for good. Its drone is shown under what a name may hold of it."""
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--server", "http://127.0.0.1:1", "--token", "secret-1234567"])

    record = config_from(args).record()

    assert record.name == shown
    assert DroneRecord.model_validate(record.model_dump(by_alias=True)).name == shown
