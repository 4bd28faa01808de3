"""The ``hangar`` command. Each part brings its own subcommands, imported only when used: the
relay's (``serve``, ``demo``) from ``hangar.server.cli``, the account commands (``user``,
``token``, ``drone-token``) from ``hangar.server.accounts_cli``, the drone's from
``hangar.drone.cli``.
So ``hangar serve`` never loads the drone or a model SDK, and ``hangar drone`` never loads the
relay.

A part's module offers ``add_commands(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import NoReturn

PARTS = {
    "serve": "hangar.server.cli",
    "demo": "hangar.server.cli",
    "user": "hangar.server.accounts_cli",
    "token": "hangar.server.accounts_cli",
    "drone-token": "hangar.server.accounts_cli",
    "drone": "hangar.drone.cli",
}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def hangar_version() -> str:
    try:
        return version("hangar")
    except PackageNotFoundError:
        return "0+unknown"


class Parser(argparse.ArgumentParser):
    """Errors in one line (``hangar serve: …``) with exit code 2, never a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def add_log_level(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """``--log-level`` before or after the subcommand; the one after it wins."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get("HANGAR_LOG_LEVEL", "INFO") if top else argparse.SUPPRESS,
        help="DEBUG, INFO, WARNING or ERROR (HANGAR_LOG_LEVEL; default INFO)",
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
    parts = _parts_for(argv)
    args = parser(parts).parse_args(argv)
    level = str(args.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        print(f"hangar: unknown log level {args.log_level!r}.", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format=LOG_FORMAT)
    part = importlib.import_module(PARTS[args.command])
    code: int = part.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
