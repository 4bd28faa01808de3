"""Who may use a PostgreSQL database: Hangar alone (not a database of another program's or of a
newer Hangar), and the relays of one deployment (they hear each other on one Redis channel), or
one relay without Redis, alone.

Relays on one database that do not hear each other would each take the other's running turns
for orphans and end them (a drone they do not list runs them). So each relay holds an advisory
lock for as long as it runs, keyed by its deployment: shared by the relays of one deployment,
exclusive for a relay without Redis, and a relay is refused while another key is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib

import asyncpg

log = logging.getLogger("hangar.relay")

GUARD = 726544
"""The advisory locks' first key; the second is the deployment's (0: a relay without Redis)."""
TAKING = 726545
"""Held while a relay looks for other deployments and takes its lock: one relay at a time."""
CHECK_EVERY = 5.0
"""Seconds between checks that the lock's connection lives (it is taken again after the
database restarted)."""

TAKE_WITHIN = 3.0
"""Seconds a relay tries to take its lock before it is refused."""
KEEPALIVES = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
}
"""The database notices within about 25 s that a relay's machine is gone (not hours later, as
TCP would by default), and lets its lock go."""

OTHERS = """
    SELECT count(*) FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND classid = $1 AND objsubid = 2
        AND objid::bigint <> $2
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


class DatabaseShared(Exception):
    """Relays of another deployment (or one without Redis) use the database."""


class ForeignDatabase(Exception):
    """The database is another program's, or a newer Hangar's."""


async def refuse_foreign(db: asyncpg.Connection, migrations: int) -> None:
    """Refuse, before writing anything, a database (its current schema) that holds another
    program's tables, or that a newer release of Hangar migrated."""
    if await db.fetchval("SELECT to_regclass('hangar_schema')") is None:
        tables = await db.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()"
        )
        if tables:
            raise ForeignDatabase("it holds another program's tables, not Hangar's.")
    elif (await db.fetchval("SELECT max(version) FROM hangar_schema") or 0) > migrations:
        raise ForeignDatabase("a newer release of Hangar made it; this one cannot use it.")


def deployment_key(deployment: str | None) -> int:
    if deployment is None:
        return 0
    return (zlib.crc32(deployment.encode()) & 0x7FFFFFFF) or 1


class RelayGuard:
    """This relay's claim on the database (``deployment``: its Redis channel, None without
    Redis)."""

    def __init__(self, url: str, deployment: str | None) -> None:
        self.url = url
        self.deployment = deployment
        self.key = deployment_key(deployment)
        self._conn: asyncpg.Connection | None = None
        self._watch: asyncio.Task[None] | None = None

    async def take(self) -> None:
        """Hold the lock, or raise ``DatabaseShared``; then keep it while the relay runs. A
        relay started again at once after it died may find its old lock still held for a
        moment (until the database has seen the connection close): it tries for a while."""
        deadline = asyncio.get_running_loop().time() + TAKE_WITHIN
        while True:
            try:
                await self._take()
                break
            except DatabaseShared:
                if asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.2)
        self._watch = asyncio.ensure_future(self._keep())

    async def _take(self) -> None:
        conn = await asyncpg.connect(self.url, server_settings=KEEPALIVES)
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", TAKING)
                others = await conn.fetchval(OTHERS, GUARD, self.key)
                mode = "" if self.deployment is None else "_shared"
                taking = f"SELECT pg_try_advisory_lock{mode}($1, $2)"
                if others or not await conn.fetchval(taking, GUARD, self.key):
                    raise DatabaseShared(self._refusal())
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    def _refusal(self) -> str:
        if self.deployment is None:
            return (
                "other relays use this PostgreSQL database: relays that share a database share "
                "a Redis (--redis); one relay alone uses SQLite or a database of its own."
            )
        return (
            "relays that do not share this relay's Redis channel use this PostgreSQL database "
            "(another Redis or Redis database number, another --redis-prefix, or a relay "
            "without --redis): they would end each other's turns."
        )

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY)
            conn = self._conn
            if conn is not None and not conn.is_closed():
                with contextlib.suppress(Exception):
                    await conn.fetchval("SELECT 1")
                    continue
                conn.terminate()  # gone with the database: not waited for
            self._conn = None
            try:
                await self._take()
                log.warning("the relay's lock on the database is held again")
            except DatabaseShared as error:
                log.error("the database is shared against the rules: %s", error)
            except Exception:  # the database is away: tried again later
                continue

    async def release(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._conn is not None:
            self._conn.terminate()  # its lock goes with it; a relay stops without waiting
        self._conn = self._watch = None
