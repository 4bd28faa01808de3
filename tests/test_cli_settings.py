"""Settings as the ``hangar`` command shows and checks them: help gives the documented
defaults, never what the environment holds; a bad URL, a bad Redis option or a bad model for the
demo's drone is one line naming the option or the variable, with exit code 2, before anything
starts; no password or token is ever printed. Every test runs the real command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import HANGAR, ROOT

SECRET = "TopSecretPw"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without Hangar's, OpenAI's or Ollama's settings, plus ``extra``."""
    prefixes = ("HANGAR_", "OPENAI_", "OLLAMA_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)} | extra


async def hangar(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 30
) -> tuple[int, str, str]:
    """Run ``hangar ARGS`` to its end (killed if it outlasts ``timeout``): exit code, stdout,
    stderr."""
    process = await asyncio.create_subprocess_exec(
        *HANGAR, *args, cwd=cwd, env=clean_env(**(env or {})), start_new_session=True,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


# ---- help


@pytest.mark.parametrize(
    ("args", "variable", "value", "default"),
    [
        (
            ["serve"],
            "HANGAR_DATABASE",
            f"postgresql://hangar:{SECRET}@db/hangar",
            "HANGAR_DATABASE; default hangar.db",
        ),
        (
            ["user", "list"],
            "HANGAR_DATABASE",
            f"postgresql://hangar:{SECRET}@db/hangar",
            "HANGAR_DATABASE; default hangar.db",
        ),
        (
            ["drone"],
            "HANGAR_SERVER",
            f"https://u:{SECRET}@relay:8080",
            "HANGAR_SERVER; default http://127.0.0.1:8080",
        ),
    ],
    ids=["serve", "user list", "drone"],
)
async def test_help_shows_the_documented_default_not_the_environments_value(
    args: list[str], variable: str, value: str, default: str
) -> None:
    code, out, err = await hangar(*args, "--help", env={variable: value})

    assert code == 0 and not err
    assert SECRET not in out
    assert default in " ".join(out.split())


# ---- passwords in what is printed


async def test_the_demo_says_which_ollama_it_uses_without_its_password(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--port", "0", "--database", str(tmp_path / "demo.db"),
        cwd=ROOT, env=clean_env(OLLAMA_HOST="http://user:OllamaPw55@127.0.0.1:48821"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        seen: list[str] = []
        async with asyncio.timeout(30):
            while not any("using" in line for line in seen):
                line = (await process.stdout.readline()).decode()
                assert line, "the demo stopped: " + "".join(seen)
                seen.append(line)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(process.communicate(), 30)

    said = "".join(seen) + out.decode() + err.decode()
    assert "OllamaPw55" not in said
    assert "using Ollama model llama3.2 at http://user:***@127.0.0.1:48821." in said


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["drone", "--token", "x", "--server", "https://u:secret@h:99999"],
            {},
            "hangar drone: --server: expected relay URLs starting with http:// or https://, "
            "separated by commas, got 'https://u:***@h:99999'.",
        ),
        (
            ["drone", "--token", "x"],
            {"HANGAR_SERVER": "https://u:secret@h:99999"},
            "hangar drone: HANGAR_SERVER (for --server): expected relay URLs starting with "
            "http:// or https://, separated by commas, got 'https://u:***@h:99999'.",
        ),
        (
            ["drone", "--token", "x", "--ollama-host", "http://u:secret@h:99999"],
            {},
            "hangar drone: --ollama-host: expected a URL starting with http:// or https://, or "
            "host:port, got 'http://u:***@h:99999'.",
        ),
        (
            ["drone", "--token", "x"],
            {"OLLAMA_HOST": "http://u:secret@h:99999"},
            "hangar drone: OLLAMA_HOST (for --ollama-host): expected a URL starting with http:// "
            "or https://, or host:port, got 'http://u:***@h:99999'.",
        ),
        (
            ["serve", "--allowed-origin", "https://u:secret@h"],
            {},
            "hangar serve: --allowed-origin: expected an origin such as https://hangar.example, "
            "got 'https://u:***@h'.",
        ),
        (
            ["serve"],
            {"HANGAR_ALLOWED_ORIGINS": "https://a.example,https://u:secret@h"},
            "hangar serve: HANGAR_ALLOWED_ORIGINS (for --allowed-origin): expected an origin "
            "such as https://hangar.example, got 'https://u:***@h'.",
        ),
    ],
    ids=["--server", "HANGAR_SERVER", "--ollama-host", "OLLAMA_HOST", "--allowed-origin", "env"],
)
async def test_a_refused_urls_password_is_not_printed(
    args: list[str], env: dict[str, str], line: str, tmp_path: Path
) -> None:
    code, out, err = await hangar(*args, env=env, cwd=tmp_path)

    assert (code, out, err) == (2, "", line + "\n")
    assert "secret" not in out + err


# ---- Redis URLs


@pytest.mark.parametrize(
    ("redis", "reason"),
    [
        (
            "redis://:RedisPw@127.0.0.1:48822/0?ssl_cert_reqs=none",
            "redis:// URLs take no option 'ssl_cert_reqs'.",
        ),
        (
            "redis://:RedisPw@127.0.0.1:48822/0?socket_timeout=abc",
            "Invalid value for 'socket_timeout' in connection URL.",
        ),
        (
            "redis://:RedisPw@127.0.0.1:48822/notanumber",
            "the path after the host is a database number, such as /0.",
        ),
    ],
    ids=["an option for rediss://", "a bad value", "a database that is not a number"],
)
@pytest.mark.parametrize("given", ["option", "variable"])
async def test_a_redis_url_redis_py_cannot_use_is_refused_in_one_line(
    redis: str, reason: str, given: str, tmp_path: Path
) -> None:
    database = tmp_path / "hangar.db"
    shown = redis.replace("RedisPw", "***")
    if given == "option":
        args, env, named = ["--redis", redis], {}, "--redis"
    else:
        args, env, named = [], {"HANGAR_REDIS": redis}, "HANGAR_REDIS (for --redis)"
    code, out, err = await hangar(
        "serve", "--port", "0", "--database", str(database), *args, env=env, timeout=15
    )

    line = f"hangar serve: {named}: expected a Redis URL redis-py can use, got {shown!r}: {reason}"
    assert (code, out, err) == (2, "", line + "\n")
    assert not database.exists()


# ---- the demo's drone


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["--model", "m" * 300],
            {"OPENAI_API_KEY": "sk-KeepThisSecret"},
            "hangar demo: --model: expected a model name of 1-256 characters, got 300.",
        ),
        (
            [],
            {"HANGAR_MODEL": "m" * 300},
            "hangar demo: HANGAR_MODEL (for --model): expected a model name of 1-256 "
            "characters, got 300.",
        ),
    ],
    ids=["--model", "HANGAR_MODEL"],
)
async def test_the_demo_checks_its_drones_model_before_anything_starts(
    args: list[str], env: dict[str, str], line: str, tmp_path: Path
) -> None:
    database = tmp_path / "demo.db"
    code, out, err = await hangar(
        "demo", "--port", "0", "--database", str(database), *args, env=env, cwd=tmp_path
    )

    assert (code, out, err) == (2, "", line + "\n")
    assert "KeepThisSecret" not in out + err
    assert os.listdir(tmp_path) == []  # no database left behind


# ---- a database that does not answer


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port that takes connections and never answers (a PostgreSQL that hangs)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield server.getsockname()[1]


async def test_a_database_that_never_answers_is_said_so(tmp_path: Path) -> None:
    """asyncpg gives up after 60 s (it has no setting for less), with an empty TimeoutError."""
    with silent_listener() as port:
        url = f"postgresql://user:s3cretpw@127.0.0.1:{port}/db"
        code, out, err = await hangar("user", "list", "--database", url, timeout=120)

    shown = f"'postgresql://user:***@127.0.0.1:{port}/db'"
    assert (code, out) == (1, "")
    assert err.startswith(f"hangar user list: cannot open {shown}: no answer within ")
    assert err.endswith(" s.\n") and err.count("\n") == 1
    assert "s3cretpw" not in err
