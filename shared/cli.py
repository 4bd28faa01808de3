"""The ``hangar`` command. Each part brings its own subcommands, imported only when used: the
relay's from ``hangar.server.cli`` (``serve``) and ``hangar.server.demo``, the account commands
(``user``, ``token``, ``drone-token``) from ``hangar.server.accounts_cli``, the drone's from
``hangar.drone.cli``.
So ``hangar serve`` never loads the drone or a model SDK, and ``hangar drone`` never loads the
relay.

A part's module offers ``add_commands(subparsers)`` and ``run(args) -> int``.

Settings come from options or from ``HANGAR_*`` environment variables (``add_setting``). A value
is checked only when the command that uses it runs, so ``--help`` works whatever the environment
holds; a bad one is one line on stderr naming the option or the variable, and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

from .logs import configure_logging
from .runtime import UnknownEventLoop
from .shown import without_password

PARTS = {
    "serve": "hangar.server.cli",
    "demo": "hangar.server.demo",
    "user": "hangar.server.accounts_cli",
    "token": "hangar.server.accounts_cli",
    "drone-token": "hangar.server.accounts_cli",
    "drone": "hangar.drone.cli",
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def hangar_version() -> str:
    try:
        return version("hangar")
    except PackageNotFoundError:
        return "0+unknown"


class Parser(argparse.ArgumentParser):
    """Errors in one line (``hangar serve: --port: …``) with exit code 2, never a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")


class SettingError(Exception):
    """A bad value from the environment; argparse reports only the command line's."""


class FromEnv(str):
    """An option's default read from an environment variable, so an error can name it."""

    variable: str

    def __new__(cls, value: str, variable: str) -> FromEnv:
        text = super().__new__(cls, value)
        text.variable = variable
        return text


def add_setting(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    env: str | Sequence[str],
    default: str | None,
    check: Callable[[str], Any] | None = None,
    **options: Any,
) -> None:
    """Add ``flag``, defaulting to the first of ``env`` that is set, else ``default``.

    ``check`` converts the text (a plain string without it) or raises ``ValueError`` saying
    what was expected. argparse converts a default only when the option is not given, after
    ``--help`` has had its turn.
    """
    names = (env,) if isinstance(env, str) else tuple(env)
    found = next((name for name in names if os.environ.get(name)), None)
    value = FromEnv(os.environ[found], found) if found else default
    if isinstance(default, str) and options.get("help"):  # the documented default, never the
        # environment's value (a URL's password, a token)
        options["help"] = options["help"].replace("%(default)s", default.replace("%", "%%"))

    parser.add_argument(flag, default=value, type=_reported(parser, flag, check or str), **options)


def _reported(
    parser: argparse.ArgumentParser, flag: str, check: Callable[[str], Any]
) -> Callable[[str], Any]:
    """``check`` as argparse's ``type``: a refusal names the option, or the variable used."""

    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as error:
            if isinstance(text, FromEnv):
                raise SettingError(
                    f"{parser.prog}: {text.variable} (for {flag}): {error}"
                ) from None
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def add_list_setting(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    env: str,
    check: Callable[[str], str],
    **options: Any,
) -> None:
    """A repeatable ``flag``, each value checked; when it is not given, the comma-separated
    values of ``env``, each checked as well."""

    def each(text: str) -> str | list[str]:
        if isinstance(text, FromEnv):
            return [check(part.strip()) for part in text.split(",") if part.strip()]
        return check(text)

    default = FromEnv(os.environ.get(env, ""), env)
    convert = _reported(parser, flag, each)
    parser.add_argument(flag, default=default, type=convert, action=_Repeated, **options)


class _Repeated(argparse.Action):
    """Each use of the option adds a value; the first replaces the default."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        found = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(found if isinstance(found, list) else []), values])


# ---- checks: each converts an option's text or raises ValueError saying what was expected


def whole_number(low: int, high: int, what: str = "a whole number") -> Callable[[str], int]:
    def check(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = low - 1
        if not low <= number <= high:
            raise ValueError(f"expected {what} from {low} to {high}, got {text!r}.")
        return number

    return check


port = whole_number(0, 65535, "a port number")


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds."""
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"expected a number of seconds, 0 or more, got {text!r}.")
    return number


def url(*schemes: str) -> Callable[[str], str]:
    """A URL with one of ``schemes`` and, unless it names a Unix socket, a host; a Redis URL
    (``redis`` among ``schemes``) also one redis-py can make connections of."""
    names = [f"{scheme}://" for scheme in schemes]
    wanted = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)

    def check(text: str) -> str:
        parts, said = urlsplit(text.strip()), without_password(text)
        if parts.scheme not in schemes:
            raise ValueError(f"expected a URL starting with {wanted}, got {said!r}.")
        try:
            parts.port  # noqa: B018 (raises ValueError for a port that is not a port number)
        except ValueError:
            raise ValueError(f"expected a port number in the URL, got {said!r}.") from None
        if not (parts.hostname or parts.scheme == "unix") or any(c.isspace() for c in parts.netloc):
            raise ValueError(f"expected a host in the URL, got {said!r}.")
        if "redis" in schemes:
            try:
                _redis_options(text.strip(), parts.scheme)
            except ValueError as error:
                reason = f"expected a Redis URL redis-py can use, got {said!r}: {error}"
                raise ValueError(without_password(reason)) from None
        return text.strip()

    return check


def _redis_options(text: str, scheme: str) -> None:
    """Raise ``ValueError`` saying what redis-py refuses of the Redis URL ``text``: a database
    that is not a number, an option it does not take for ``scheme`` or a bad value. Its
    connection pool and a connection are made as the relay makes them, nothing is connected."""
    from redis.asyncio import ConnectionPool  # only where a Redis URL is given

    if scheme != "unix" and not re.fullmatch(r"/?[0-9]*", urlsplit(text).path):
        raise ValueError("the path after the host is a database number, such as /0.")
    try:
        pool = ConnectionPool.from_url(text)
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as error:  # an option the connection does not take
        option = re.search(r"keyword argument '(\w+)'", str(error))
        said = f"{scheme}:// URLs take no option {option[1]!r}" if option else str(error)
        raise ValueError(f"{said}.") from None
    except Exception as error:
        said = " ".join(str(error).split()).rstrip(".") or type(error).__name__
        raise ValueError(f"{said}.") from None


def origin(text: str) -> str:
    """A web origin: ``http://`` or ``https://``, a host and maybe a port, nothing more; as a
    browser's ``Origin`` header says it (lower case, no default port)."""
    checked = url("http", "https")(text)
    parts = urlsplit(checked)
    if parts.path.strip("/") or "?" in checked or "#" in checked or "@" in parts.netloc:
        said = without_password(text)
        raise ValueError(f"expected an origin such as https://hangar.example, got {said!r}.")
    scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    if ":" in host:
        host = f"[{host}]"
    default = {"http": 80, "https": 443}[scheme]
    return f"{scheme}://{host}" + (f":{port}" if port not in (None, default) else "")


def directory(text: str) -> str:
    """An existing directory, as an absolute path."""
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError(f"there is no directory {text!r}.")
    if not path.is_dir():
        raise ValueError(f"{text!r} is not a directory.")
    return str(path.resolve())


SQLITE_HEADER = b"SQLite format 3\x00"
RELAY_TABLES = {"users", "logins", "drone_tokens"}


def work_directory(text: str) -> str:
    """``--workdir``: an existing directory, and not one that holds a relay's database (its
    tools, and so the model, may read and write everything in it)."""
    path = directory(text)
    found = relay_database_in(Path(path))
    if found is not None:
        raise ValueError(
            f"{text!r} holds {found.name}, a relay's database (its people, logins and tokens): "
            "give the drone a work directory of its own."
        )
    return path


WOULD_HOLD_DATABASE = (
    "would hold the relay's database (its people, logins and tokens): give the drone a work "
    "directory of its own."
)


def holds_database(workdir: str, database: str) -> bool:
    """Whether the SQLite file ``database`` is, or will be, in ``workdir`` or below it."""
    if "://" in database.removeprefix("sqlite:///"):
        return False
    path = Path(database.removeprefix("sqlite:///")).resolve()
    return Path(workdir).resolve() in path.parents


def relay_database_in(folder: Path) -> Path | None:
    """A relay's SQLite database directly in ``folder``, if there is one."""
    try:
        with os.scandir(folder) as entries:
            for entry in entries:  # every one: the database may come last of very many
                if entry.is_file(follow_symlinks=False) and _is_relay_database(entry.path):
                    return Path(entry.path)
    except OSError as error:
        raise ValueError(f"{str(folder)!r} cannot be read: {error.strerror}.") from None
    return None


def _is_relay_database(path: str) -> bool:
    try:
        with open(path, "rb") as file:
            if file.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
                return False
        with contextlib.closing(sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    except (OSError, sqlite3.Error):
        return False
    return tables >= RELAY_TABLES


def database(text: str) -> str:
    """A ``postgresql://`` URL, or a SQLite file in a folder that exists."""
    scheme = text.split("://", 1)[0] if "://" in text else ""
    expected = f"expected a SQLite file or a postgresql:// URL, got {without_password(text)!r}."
    if scheme in ("postgresql", "postgres"):
        try:
            urlsplit(text).port  # noqa: B018 (raises ValueError for a port out of range)
        except ValueError:
            raise ValueError(expected) from None
        return text
    if scheme not in ("", "sqlite") or not text.strip():
        raise ValueError(expected)
    path = Path(text.removeprefix("sqlite:///"))
    if path.is_dir():
        raise ValueError(f"{text!r} is a directory, not a SQLite file.")
    if path.exists() and not path.is_file():  # a named pipe's open would wait for a writer
        raise ValueError(f"{text!r} is not a file (a pipe or a device), so not a SQLite file.")
    if not path.parent.is_dir():
        raise ValueError(f"there is no folder {str(path.parent)!r} for the SQLite file {text!r}.")
    return text


def model_name(text: str) -> str:
    if len(text) > 256:
        raise ValueError(f"expected a model name of 1-256 characters, got {len(text)}.")
    return text


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        names = ", ".join(level.lower() for level in LOG_LEVELS)
        raise ValueError(f"expected one of {names}, got {text!r}.")
    return text.upper()


def add_log_level(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """``--log-level`` before or after the subcommand; the one after it wins."""
    add_setting(
        parser,
        "--log-level",
        # After the subcommand no default: the value before it (or HANGAR_LOG_LEVEL) stands.
        env="HANGAR_LOG_LEVEL" if top else (),
        default="INFO" if top else argparse.SUPPRESS,
        check=log_level,
        help="debug, info, warning, error or critical (HANGAR_LOG_LEVEL; default info)",
    )


def parser(parts: list[ModuleType]) -> Parser:
    top = Parser(
        prog="hangar",
        description="Run AI-agent work orders on remote drones; abort them at once.",
    )
    top.add_argument("--version", action="version", version=f"hangar {hangar_version()}")
    add_log_level(top, top=True)
    commands = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    for part in parts:
        part.add_commands(commands)
    return top


def _parts_for(argv: list[str]) -> list[ModuleType]:
    named = next((arg for arg in argv if arg in PARTS), None)
    modules = [PARTS[named]] if named else list(dict.fromkeys(PARTS.values()))
    return [importlib.import_module(name) for name in modules]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser(_parts_for(argv)).parse_args(argv)
        configure_logging(args.log_level)
        code: int = importlib.import_module(PARTS[args.command]).run(args)
    except (SettingError, UnknownEventLoop) as error:
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a part handles it (while loading, at a prompt)
        print(file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    # Run the imported module, not this ``__main__`` copy, whose SettingError the parts' checks
    # would not raise.
    from hangar.shared import cli

    sys.exit(cli.main())
