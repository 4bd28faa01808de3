"""Account commands, run against the relays' database (``--database``, as ``hangar serve``):

- ``hangar user add NAME [--admin] [--password-stdin | --no-password]``, ``list``,
  ``remove NAME``, ``passwd NAME [--password-stdin]``
- ``hangar token create NAME [--label TEXT]``, ``list NAME``, ``revoke NAME [--label TEXT]``:
  a person's API tokens (all of them, or those with a label; ``--label ""``: those with none)
- ``hangar drone-token create NAME``, ``list``, ``revoke NAME``

Relays follow what these change within a second: a removed person, a revoked token or drone is
disconnected.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
import time
from collections.abc import Awaitable, Callable

from hangar.shared.cli import add_log_level, add_setting, database
from hangar.shared.shown import shown

from .accounts import AccountError, Accounts, NotValid
from .app import open_store
from .passwords import refuse_weak
from .sqlite_file import new_file, remove_new


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    user = commands.add_parser("user", help="manage people's accounts", description="Accounts.")
    users = user.add_subparsers(dest="action", required=True, parser_class=type(user))
    add = users.add_parser("add", help="add a person")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="may manage people and every turn")
    secret = add.add_mutually_exclusive_group()
    secret.add_argument("--password-stdin", action="store_true", help="read the password")
    secret.add_argument(
        "--no-password", action="store_true", help="an account for scripts: API tokens only"
    )
    users.add_parser("list", help="list people")
    users.add_parser("remove", help="remove a person").add_argument("name")
    passwd = users.add_parser("passwd", help="set a person's password (ends their logins)")
    passwd.add_argument("name")
    passwd.add_argument("--password-stdin", action="store_true", help="read the password")

    token = commands.add_parser(
        "token", help="personal API tokens", description="API tokens for scripts."
    )
    tokens = token.add_subparsers(dest="action", required=True, parser_class=type(token))
    create = tokens.add_parser("create", help="make an API token for a person (printed once)")
    create.add_argument("name")
    create.add_argument("--label", default="", help="what the token is for")
    tokens.add_parser("list", help="list a person's API tokens").add_argument("name")
    revoke = tokens.add_parser("revoke", help="revoke a person's API tokens (all, or by label)")
    revoke.add_argument("name")
    revoke.add_argument("--label", default=None, help="only the tokens with this label")

    drone = commands.add_parser(
        "drone-token", help="drones' own tokens", description="Per-drone tokens."
    )
    drones = drone.add_subparsers(dest="action", required=True, parser_class=type(drone))
    drones.add_parser("create", help="make a drone's token (printed once)").add_argument("name")
    drones.add_parser("list", help="list drone tokens")
    drones.add_parser("revoke", help="revoke a drone's token").add_argument("name")

    for parser in (*users.choices.values(), *tokens.choices.values(), *drones.choices.values()):
        add_log_level(parser)
        add_setting(
            parser,
            "--database",
            env="HANGAR_DATABASE",
            default="hangar.db",
            check=database,
            help="SQLite file, or a postgresql:// URL (HANGAR_DATABASE; default %(default)s)",
        )


MAKES_ONE = "(hangar user add or drone-token create makes one)."
NO_LABEL = '(no label: --label "")'


def run(args: argparse.Namespace) -> int:
    actions: dict[tuple[str, str], Callable[[Accounts, argparse.Namespace], Awaitable[int]]] = {
        ("user", "add"): _user_add,
        ("user", "list"): _user_list,
        ("user", "remove"): _user_remove,
        ("user", "passwd"): _user_passwd,
        ("token", "create"): _token_create,
        ("token", "list"): _token_list,
        ("token", "revoke"): _token_revoke,
        ("drone-token", "create"): _drone_create,
        ("drone-token", "list"): _drone_list,
        ("drone-token", "revoke"): _drone_revoke,
    }
    action = actions[(args.command, args.action)]
    prefix = f"hangar {args.command} {args.action}"
    for key in ("name", "label"):  # bytes a terminal could not decode (a path may hold any)
        value = getattr(args, key, None)
        if isinstance(value, str) and not _utf8(value):
            print(f"{prefix}: {key} is not UTF-8 text: {value!r}.", file=sys.stderr)
            return 2
    args.password = None
    path = args.database.removeprefix("sqlite:///")
    fresh = "://" not in path and not os.path.exists(path)
    makes = (args.command, args.action) in (("user", "add"), ("drone-token", "create"))
    if fresh and not makes:  # a mistyped path is not made a database
        print(f"{prefix}: there is no database at {shown(path)} {MAKES_ONE}", file=sys.stderr)
        return 1
    asks = getattr(args, "password_stdin", False) or (
        args.action in ("add", "passwd") and not getattr(args, "no_password", False)
    )
    if asks:  # the name is looked at first: a password is not typed for nothing
        # A SQLite file that is not there yet is not made for it (the prompt may be left).
        where = ":memory:" if fresh else args.database
        checked = asyncio.run(_with_accounts(prefix, args, _before_password, where))
        if checked:
            return checked
        try:
            args.password = _read_password(bool(args.password_stdin))
        except AccountError as error:
            print(f"{prefix}: {error}", file=sys.stderr)
            return 2
    made = new_file(args.database)
    code = asyncio.run(_with_accounts(prefix, args, action, args.database))
    if code:
        remove_new(made)  # a refused name makes no database
    return code


async def _with_accounts(
    prefix: str,
    args: argparse.Namespace,
    action: Callable[[Accounts, argparse.Namespace], Awaitable[int]],
    database: str,
) -> int:
    store = open_store(database)
    started = time.monotonic()
    try:
        await store.open()
    except Exception as error:
        said = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, TimeoutError):  # said nothing itself
            said = f"no answer within {time.monotonic() - started:.0f} s."
        print(f"{prefix}: cannot open {shown(args.database)}: {said}", file=sys.stderr)
        return 1
    try:
        return await action(Accounts(store), args)
    except AccountError as error:
        print(f"{prefix}: {error}", file=sys.stderr)
        return 2 if isinstance(error, NotValid) else 1
    finally:
        await store.close()


async def _before_password(accounts: Accounts, args: argparse.Namespace) -> int:
    """Raise ``AccountError`` if the command cannot take its name, whatever the password."""
    if args.action == "add":
        await accounts.check_new_name(args.name)
    elif await accounts.user(args.name) is None:
        raise AccountError(f"There is no user named {args.name!r}.")
    return 0


def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        if sys.stdin is None:  # closed (``<&-``)
            raise AccountError("No password was given.")
        password = sys.stdin.readline().rstrip("\r\n")
    elif sys.stdin is not None and sys.stdin.isatty():
        try:
            password = getpass.getpass("Password: ")
            if getpass.getpass("Password again: ") != password:
                raise AccountError("The two passwords differ.")
        except EOFError:  # Ctrl-D
            raise AccountError("No password was given.") from None
    else:
        raise AccountError("Give the password on standard input with --password-stdin.")
    refuse_weak(password)  # said before a database is opened, or made
    if not _utf8(password):
        raise AccountError("The password is not UTF-8 text.")
    return password


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


async def _user_add(accounts: Accounts, args: argparse.Namespace) -> int:
    user = await accounts.add_user(args.name, args.password, "admin" if args.admin else "member")
    print(f"Added {user.role} {user.name}.")
    return 0


async def _user_list(accounts: Accounts, args: argparse.Namespace) -> int:
    users = await accounts.users()
    if not users:
        print(
            "No accounts yet: add one with hangar user add NAME --admin --database "
            f"{shown(args.database)}"
        )
    for user in users:
        login = "password" if user.has_password else "API tokens only"
        print(f"{user.name}\t{user.role}\t{_date(user.created_at)}\t{login}")
    return 0


async def _user_remove(accounts: Accounts, args: argparse.Namespace) -> int:
    if not await accounts.remove_user(args.name):
        raise AccountError(f"There is no user named {args.name!r}.")
    print(f"Removed {args.name}; their connections are closed.")
    return 0


async def _user_passwd(accounts: Accounts, args: argparse.Namespace) -> int:
    await accounts.set_password(args.name, args.password)
    print(f"Password of {args.name} set; their other logins are ended.")
    return 0


async def _token_create(accounts: Accounts, args: argparse.Namespace) -> int:
    token = await accounts.create_api_token(args.name, args.label)
    print(token)
    print(
        f"An API token for {args.name}, shown only now: scripts pass it as the socket.io "
        'auth {"token": ...} on /ide.',
        file=sys.stderr,
    )
    return 0


async def _token_list(accounts: Accounts, args: argparse.Namespace) -> int:
    tokens = await accounts.api_tokens(args.name)
    if not tokens:
        print(f"{args.name} has no API tokens yet: make one with hangar token create {args.name}.")
    for label, created_at in tokens:
        print(f"{label or NO_LABEL}\t{_date(created_at)}")
    return 0


async def _token_revoke(accounts: Accounts, args: argparse.Namespace) -> int:
    count = await accounts.revoke_api_tokens(args.name, args.label)
    if args.label is not None and not count:
        raise AccountError(f"{args.name} has no API token labelled {args.label!r}.")
    which = "" if args.label is None else f" ({args.label})"
    print(f"Revoked {count} API token{'s' if count != 1 else ''} of {args.name}{which}.")
    return 0


async def _drone_create(accounts: Accounts, args: argparse.Namespace) -> int:
    token = await accounts.create_drone_token(args.name)
    print(token)
    print(
        f"The drone {args.name}'s token, shown only now: hangar drone --token <it> "
        "(the drone takes its name from the token).",
        file=sys.stderr,
    )
    return 0


async def _drone_list(accounts: Accounts, args: argparse.Namespace) -> int:
    tokens = await accounts.drone_tokens()
    if not tokens:
        print("No drone tokens yet: make one with hangar drone-token create NAME.")
    for token in tokens:
        state = f"revoked {_date(token.revoked_at)}" if token.revoked_at else "active"
        print(f"{token.name}\t{_date(token.created_at)}\t{state}")
    return 0


async def _drone_revoke(accounts: Accounts, args: argparse.Namespace) -> int:
    if not await accounts.revoke_drone_token(args.name):
        raise AccountError(f"The drone {args.name!r} has no active token.")
    print(f"Revoked the drone {args.name}'s token; it is disconnected.")
    return 0


def _date(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at))
