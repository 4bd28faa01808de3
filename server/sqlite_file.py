"""What a SQLite file is, and who holds it: a relay's own lock on its file, the refusal of a
file that is not this Hangar's, and the search function the file's connections are given."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3

from .schema import migrations
from .store import SEARCHED_CHARS

MIGRATIONS = migrations("sqlite")


def relay_lock(path: str) -> int:
    """Hold ``path`` for this relay alone (``flock``, which SQLite's own locks do not touch):
    two relays on one file would each take the other's turns for orphans. Account commands
    open it beside a relay. The file is made readable by its owner only, if it is new."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreInUseError(
            "another relay uses it (one relay per SQLite file; relays that share their work "
            "share a PostgreSQL database)."
        ) from None
    return fd


def new_file(database: str) -> str | None:
    """The SQLite file ``database`` names, if there is none yet: a command refused after it was
    made removes it (``remove_new``), so that a refusal leaves nothing behind."""
    path = database.removeprefix("sqlite:///")
    if "://" in path or path == ":memory:" or os.path.lexists(path):
        return None
    return path


def remove_new(path: str | None) -> None:
    """Remove the SQLite file ``new_file`` found missing, with its journal files."""
    for name in (path, f"{path}-wal", f"{path}-shm", f"{path}-journal") if path else ():
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


class StoreInUseError(Exception):
    """The SQLite file is a running relay's."""


def refuse_foreign(conn: sqlite3.Connection) -> None:
    """Refuse, before writing anything, a file another program's or a newer Hangar's."""
    conn.execute("BEGIN")  # one reading of both: not half of another's first migration
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = int(conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0])
    finally:
        conn.execute("COMMIT")
    if version > len(MIGRATIONS):
        raise sqlite3.DatabaseError("a newer release of Hangar made it; this one cannot use it.")
    if version == 0 and tables:
        raise sqlite3.DatabaseError("it holds another program's tables, not Hangar's.")


def finds(text: str | None, needle: str) -> bool:
    """Whether ``needle`` is in the first ``SEARCHED_CHARS`` of ``text``, both ``folded``:
    SQLite's lower() folds ASCII only."""
    return isinstance(text, str) and folded(needle) in folded(text[:SEARCHED_CHARS])


def folded(text: str) -> str:
    """``text`` in small letters, a final sigma as any other ("ΟΔΥΣΣΕΑΣ" and "οδυσσεας" alike),
    as ``postgres_store`` folds it with PostgreSQL's own lower()."""
    return text.lower().replace("ς", "σ")
