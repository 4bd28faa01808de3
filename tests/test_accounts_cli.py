"""The account commands (``hangar user``, ``token``, ``drone-token``) and what ``hangar demo``
asks for on a network address: each answers in one line, with an exit code."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import select
import signal
import subprocess
import termios
import time
from pathlib import Path

import pytest

from hangar.server.accounts import Accounts
from hangar.server.sqlite_store import SqliteTurnStore
from tests.conftest import HANGAR, ROOT


async def hangar(*arguments: str | bytes, stdin: str | bytes | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HANGAR_", "OPENAI", "OLLAMA"))}
    process = await asyncio.create_subprocess_exec(
        *HANGAR, *arguments,
        cwd=ROOT, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    data = stdin.encode() if isinstance(stdin, str) else stdin or b""
    out, err = await asyncio.wait_for(process.communicate(data), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def modes(folder: Path, prefix: str) -> set[str]:
    """The modes of the files in ``folder`` whose names start with ``prefix``."""
    return {oct(p.stat().st_mode & 0o777) for p in folder.iterdir() if p.name.startswith(prefix)}


async def accounts_of(database: Path) -> tuple[Accounts, SqliteTurnStore]:
    store = SqliteTurnStore(database)
    await store.open()
    return Accounts(store), store


async def test_people_are_added_listed_given_passwords_and_removed(tmp_path: Path) -> None:
    db = str(tmp_path / "hangar.db")

    added = await hangar(
        "user", "add", "ada", "--admin", "--password-stdin", "--database", db,
        stdin="first password\n",
    )  # fmt: skip
    assert added == (0, "Added admin ada.\n", "")
    assert await hangar("user", "add", "bot", "--no-password", "--database", db) == (
        0,
        "Added member bot.\n",
        "",
    )
    code, out, _ = await hangar("user", "list", "--database", db)
    assert code == 0
    assert [line.split("\t")[::3] for line in out.splitlines()] == [
        ["ada", "password"],
        ["bot", "API tokens only"],
    ]
    assert await hangar(
        "user", "passwd", "ada", "--password-stdin", "--database", db, stdin="second password\n"
    ) == (
        0,
        "Password of ada set; their other logins are ended.\n",
        "",
    )
    accounts, store = await accounts_of(tmp_path / "hangar.db")
    try:
        assert await accounts.check_password("ada", "first password") is None
        assert await accounts.check_password("ada", "second password") is not None
    finally:
        await store.close()
    assert (await hangar("user", "remove", "bot", "--database", db))[0] == 0
    assert (await hangar("user", "list", "--database", db))[1].count("\n") == 1


async def test_a_database_an_account_command_makes_is_readable_by_its_owner_only(
    tmp_path: Path,
) -> None:
    """The README's first step makes the database with ``user add``: it was made readable by
    everyone at the machine (umask 022), and its write-ahead log with it: every conversation,
    tool output and password hash."""
    db = tmp_path / "hangar.db"
    previous = os.umask(0o022)
    try:
        added = await hangar(
            "user", "add", "ada", "--admin", "--password-stdin", "--database", str(db),
            stdin="first password\n",
        )  # fmt: skip
    finally:
        os.umask(previous)
    assert added[0] == 0
    assert modes(tmp_path, "hangar.db") == {oct(0o600)}


@pytest.mark.parametrize(
    "command",
    [
        ["user", "list", "--database", "postgresql://hangar:S3cretPassw0rd@127.0.0.1:1/hangar"],
        ["serve", "--database", "postgresql://hangar:S3cretPassw0rd@127.0.0.1:99999/hangar"],
        ["serve", "--database", "postgresql://127.0.0.1:1/hangar?password=S3cretPassw0rd"],
        ["serve", "--redis", "redis://:S3cretPassw0rd@127.0.0.1:99999/0"],
        ["user", "list", "--database", "postgresql://u:S3cretPassw0rd@[::1/db"],
    ],
    ids=["cannot open", "bad port", "in the query", "redis", "not a url that parses"],
)
async def test_a_urls_password_is_not_printed(command: list[str]) -> None:
    """It went to the terminal (and journals, CI logs) in every error naming the URL."""
    code, out, err = await hangar(*command)

    assert code != 0 and err.count("\n") == 1  # one line saying what is wrong
    assert "S3cretPassw0rd" not in out + err


async def test_a_name_the_command_cannot_take_is_refused_before_the_password_is_asked(
    tmp_path: Path,
) -> None:
    """The password was asked (twice, on a terminal) before the name was looked at: a person
    typed it for nothing, and without one the error was about the password."""
    db = str(tmp_path / "hangar.db")
    assert (await hangar("user", "add", "ada", "--no-password", "--database", db))[0] == 0

    nobody = await hangar("user", "passwd", "nobody", "--password-stdin", "--database", db)
    twice = await hangar("user", "add", "ada", "--password-stdin", "--database", db)
    bad = await hangar("user", "add", "no name", "--password-stdin", "--database", db)

    assert nobody == (1, "", "hangar user passwd: There is no user named 'nobody'.\n")
    assert twice == (1, "", "hangar user add: A user named 'ada' already exists.\n")
    assert bad[0] == 2 and bad[2].startswith("hangar user add: A user name is 1-64 letters")


async def test_the_last_admin_is_not_removed_while_others_have_accounts(tmp_path: Path) -> None:
    """Else nobody could see every turn or manage the deployment from the page."""
    db = str(tmp_path / "hangar.db")
    for arguments in (("ada", "--admin"), ("bob",), ("cy", "--admin")):
        assert (await hangar("user", "add", *arguments, "--no-password", "--database", db))[0] == 0

    assert (await hangar("user", "remove", "cy", "--database", db))[0] == 0
    refused = await hangar("user", "remove", "ada", "--database", db)
    assert (await hangar("user", "remove", "bob", "--database", db))[0] == 0
    alone = await hangar("user", "remove", "ada", "--database", db)

    assert refused == (
        1,
        "",
        "hangar user remove: ada is the last admin: add another admin first (hangar user add "
        "NAME --admin), or remove the others.\n",
    )
    assert alone == (0, "Removed ada; their connections are closed.\n", "")
    assert (await hangar("user", "list", "--database", db))[1].startswith("No accounts yet")


async def test_account_commands_refuse_bad_input_in_one_line(tmp_path: Path) -> None:
    db = str(tmp_path / "hangar.db")
    await hangar("user", "add", "ada", "--no-password", "--database", db)

    cases = [
        (("user", "add", "ada", "--no-password"), 1, "A user named 'ada' already exists."),
        # What was given is not valid: 2, as for a password refused; what cannot be done: 1.
        (("user", "add", "bad name!", "--no-password"), 2, "A user name is 1-64 letters"),
        (("user", "add", "nl\n", "--no-password"), 2, "A user name is 1-64 letters"),
        (("drone-token", "create", "dr\n"), 2, "A drone name is 1-64 letters"),
        (("user", "add", "eve"), 2, "Give the password on standard input with --password-stdin."),
        (("user", "remove", "nobody"), 1, "There is no user named 'nobody'."),
        (("token", "create", "nobody"), 1, "There is no user named 'nobody'."),
        (("drone-token", "revoke", "ghost"), 1, "The drone 'ghost' has no active token."),
        # Bytes a terminal could not decode as UTF-8.
        (("user", "remove", b"bad\xff\xfe"), 2, "name is not UTF-8 text: 'bad\\udcff\\udcfe'"),
        (("token", "create", "ada", "--label", b"l\xff"), 2, "label is not UTF-8 text"),
    ]
    for arguments, expected_code, message in cases:
        code, out, err = await hangar(*arguments, "--database", db)
        assert (code, out) == (expected_code, ""), arguments
        assert len(err.splitlines()) == 1 and message in err, (arguments, err)
        assert "Traceback" not in err
    code, out, err = await hangar("user", "add", "eve", "--password-stdin", "--database", db,
                                  stdin=b"\xff\xfebadutf8\n")  # fmt: skip
    assert (code, out, err.strip()) == (2, "", "hangar user add: The password is not UTF-8 text.")


async def test_a_password_of_fewer_than_eight_characters_is_refused(tmp_path: Path) -> None:
    db = str(tmp_path / "hangar.db")
    await hangar("user", "add", "ada", "--password-stdin", "--database", db, stdin="long enough\n")

    added = await hangar("user", "add", "bob", "--password-stdin", "--database", db, stdin="a\n")
    changed = await hangar(
        "user", "passwd", "ada", "--password-stdin", "--database", db, stdin="1234567\n"
    )

    refusal = "A password needs at least 8 characters.\n"
    assert added == (2, "", "hangar user add: " + refusal)  # as for any password refused
    assert changed == (2, "", "hangar user passwd: " + refusal)
    listed = (await hangar("user", "list", "--database", db))[1]
    assert "ada" in listed and "bob" not in listed


async def test_tokens_are_printed_once_and_stored_as_hashes(tmp_path: Path) -> None:
    db = str(tmp_path / "hangar.db")
    await hangar("user", "add", "bot", "--no-password", "--database", db)

    code, api_token, _ = await hangar("token", "create", "bot", "--database", db)
    assert code == 0 and api_token.startswith("hgt_")
    code, drone_token, _ = await hangar("drone-token", "create", "laptop", "--database", db)
    assert code == 0 and drone_token.startswith("hgd.laptop.")
    listed = await hangar("drone-token", "list", "--database", db)
    assert listed[1].split("\t")[::2] == ["laptop", "active\n"]

    raw = (tmp_path / "hangar.db").read_bytes()
    for token in (api_token.strip(), drone_token.strip()):
        assert token.encode() not in raw and token.rsplit(".", 1)[-1].encode() not in raw
    accounts, store = await accounts_of(tmp_path / "hangar.db")
    try:
        user = await accounts.api_token_user(api_token.strip())
        assert user is not None and user.name == "bot"
        assert await accounts.drone_of(drone_token.strip()) == "laptop"
    finally:
        await store.close()
    assert (await hangar("drone-token", "revoke", "laptop", "--database", db))[0] == 0
    assert "revoked" in (await hangar("drone-token", "list", "--database", db))[1]


async def test_a_persons_tokens_are_listed_and_one_is_revoked_by_its_label(
    tmp_path: Path,
) -> None:
    """There was no list, and a leaked script's token could be revoked only with every other
    token of the person; the label was kept and never shown."""
    db = str(tmp_path / "hangar.db")
    await hangar("user", "add", "bot", "--no-password", "--database", db)
    tokens = {}
    for label in ("ci", "laptop"):
        code, token, _ = await hangar("token", "create", "bot", "--label", label, "--database", db)
        assert code == 0
        tokens[label] = token.strip()

    listed = await hangar("token", "list", "bot", "--database", db)
    revoked = await hangar("token", "revoke", "bot", "--label", "ci", "--database", db)
    none = await hangar("token", "revoke", "bot", "--label", "ci", "--database", db)

    assert listed[0] == 0 and [line.split("\t")[0] for line in listed[1].splitlines()] == [
        "ci",
        "laptop",
    ]
    assert revoked == (0, "Revoked 1 API token of bot (ci).\n", "")
    assert none == (1, "", "hangar token revoke: bot has no API token labelled 'ci'.\n")
    accounts, store = await accounts_of(tmp_path / "hangar.db")
    try:
        assert await accounts.api_token_user(tokens["ci"]) is None
        assert await accounts.api_token_user(tokens["laptop"]) is not None
    finally:
        await store.close()


@pytest.mark.parametrize(
    "command",
    [["user", "list"], ["user", "remove", "ada"], ["token", "revoke", "ada"],
     ["token", "create", "ada"], ["drone-token", "list"], ["drone-token", "revoke", "desk"]],
    ids=["user list", "user remove", "token revoke", "token create", "drone-token list",
         "drone-token revoke"],
)  # fmt: skip
@pytest.mark.parametrize("form", ["path", "sqlite:///"])
async def test_a_command_that_only_reads_or_changes_accounts_makes_no_database(
    tmp_path: Path, command: list[str], form: str
) -> None:
    """A mistyped --database made a new, empty database there and said "No accounts yet"."""
    typo = tmp_path / "hangr.db"
    given = str(typo) if form == "path" else f"sqlite:///{typo}"

    code, out, err = await hangar(*command, "--database", given)

    assert (code, out) == (1, "")
    assert err == (
        f"hangar {' '.join(command[:2])}: there is no database at {typo} "
        "(hangar user add or drone-token create makes one).\n"
    )
    assert not typo.exists()


@pytest.mark.parametrize(
    "command",
    [("user", "add", "no name", "--no-password"), ("drone-token", "create", "no name")],
    ids=["user add", "drone-token create"],
)
async def test_a_name_refused_makes_no_database(tmp_path: Path, command: tuple[str, ...]) -> None:
    """A refused name left an empty database behind, which the next command then took for
    the relays' own."""
    typo = tmp_path / "new.db"

    code, out, err = await hangar(*command, "--database", str(typo))

    assert (code, out) == (2, "") and "name is 1-64 letters" in err
    assert os.listdir(tmp_path) == []


async def test_a_short_password_makes_no_database(tmp_path: Path) -> None:
    typo = tmp_path / "new.db"

    said = await hangar(
        "user", "add", "ada", "--password-stdin", "--database", str(typo), stdin="short\n"
    )

    assert said == (2, "", "hangar user add: A password needs at least 8 characters.\n")
    assert not typo.exists()


async def test_names_that_differ_only_in_case_are_one_name(tmp_path: Path) -> None:
    """alice and ALICE were two accounts, laptop, Laptop and LAPTOP three drones in the picker,
    which no one could tell apart."""
    db = str(tmp_path / "hangar.db")
    assert (await hangar("user", "add", "alice", "--no-password", "--database", db))[0] == 0
    assert (await hangar("drone-token", "create", "laptop", "--database", db))[0] == 0

    person = await hangar("user", "add", "ALICE", "--no-password", "--database", db)
    drone = await hangar("drone-token", "create", "Laptop", "--database", db)

    assert person == (1, "", "hangar user add: A user named 'alice' already exists.\n")
    assert drone == (
        1,
        "",
        "hangar drone-token create: The drone 'laptop' has a token already; revoke it first.\n",
    )


async def test_the_demo_on_a_network_address_needs_accounts(tmp_path: Path) -> None:
    db = str(tmp_path / "empty.db")

    code, out, err = await hangar("demo", "--host", "0.0.0.0", "--port", "0", "--database", db)

    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "hangar demo: on 0.0.0.0 the page is open to the network and needs accounts: add one "
        f"with hangar user add NAME --admin --database {db}"
    ]
    assert os.listdir(tmp_path) == []  # nor is a database left that it would have used


def _at_the_password_prompt(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``hangar user add`` on a terminal of its own (a pty), once it asks for the password."""
    leader, follower = pty.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    process = subprocess.Popen(
        [*HANGAR, "user", "add", "ada", "--database", str(tmp_path / "hangar.db")],
        cwd=ROOT, stdin=follower, stdout=follower, stderr=follower, preexec_fn=own_terminal,
    )  # fmt: skip
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 30
    while b"Password: " not in screen and time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1)
        if ready:
            screen += os.read(leader, 1024)
    assert b"Password: " in screen, screen
    return process, leader


def _rest_of(leader: int) -> str:
    """What the command wrote after the prompt, until it closed its terminal."""
    screen = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 10)
        if not ready:
            break
        try:
            chunk = os.read(leader, 1024)
        except OSError:  # the other end is closed
            break
        if not chunk:
            break
        screen += chunk
    os.close(leader)
    return screen.decode(errors="replace")


@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-d"])
def test_leaving_the_password_prompt_is_one_line_and_adds_no_one(tmp_path: Path, how: str) -> None:
    process, leader = _at_the_password_prompt(tmp_path)

    if how == "ctrl-c":
        process.send_signal(signal.SIGINT)
    else:
        os.write(leader, b"\x04")  # end of input, as Ctrl-D at the start of a line
    code = process.wait(10)
    said = _rest_of(leader)

    assert "Traceback" not in said and "Error" not in said, said
    if how == "ctrl-c":
        assert code == 130
    else:
        assert code == 2 and "No password was given." in said
    assert not (tmp_path / "hangar.db").exists()


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        ([], "Give the password on standard input with --password-stdin."),
        (["--password-stdin"], "No password was given."),
    ],
    ids=["prompt", "password-stdin"],
)
async def test_a_password_asked_for_with_standard_input_closed_gets_one_line(
    tmp_path: Path, arguments: list[str], line: str
) -> None:
    """``hangar user add NAME <&-``: Python has no ``sys.stdin`` then, and the command failed
    with a traceback."""
    db = str(tmp_path / "hangar.db")
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "user", "add", "ada", *arguments, "--database", db,
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)

    assert (process.returncode, out, err) == (2, b"", f"hangar user add: {line}\n".encode())
    assert not (tmp_path / "hangar.db").exists()


@pytest.mark.parametrize(
    ("password", "line"),
    [
        (" " * 12, "A password cannot be only white space."),
        ("x" * 1_025, "A password has at most 1024 characters."),
    ],
    ids=["white-space", "too-long"],
)
async def test_a_password_no_one_could_log_in_with_or_guess_less_is_refused(
    tmp_path: Path, password: str, line: str
) -> None:
    """Twelve spaces were taken; so was a password of 10 MB, which the login page, whose form
    takes at most 1 MB, could never send."""
    db = str(tmp_path / "hangar.db")

    refused = await hangar(
        "user", "add", "ada", "--password-stdin", "--database", db, stdin=password + "\n"
    )

    assert refused == (2, "", f"hangar user add: {line}\n")


@pytest.mark.parametrize("label", ["a\tb", "two\nlines", "\x1b[2J", "x" * 201])
async def test_a_token_label_is_one_line_of_at_most_200_characters(
    tmp_path: Path, label: str
) -> None:
    """A tab or a line break in a label broke ``hangar token list``'s lines, and a label had
    no length limit."""
    db = str(tmp_path / "hangar.db")
    assert (await hangar("user", "add", "ada", "--no-password", "--database", db))[0] == 0

    refused = await hangar("token", "create", "ada", "--label", label, "--database", db)

    assert refused == (
        2,
        "",
        "hangar token create: A label is one line of at most 200 characters, with no tabs or "
        "control characters.\n",
    )
    assert await hangar("token", "list", "ada", "--database", db) == (
        0,
        "ada has no API tokens yet: make one with hangar token create ada.\n",
        "",
    )
