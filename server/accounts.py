"""People and what proves who is connecting: accounts (admin or member), login sessions,
personal API tokens, drone tokens, failed-login limits, and the revocations every relay follows.

Secrets are stored only as SHA-256 hashes (a token) or argon2 hashes (a password,
``passwords.py``). The SQL is written once, for both databases (``Database``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from hangar.shared.protocol import DRONE_NAME_PATTERN, DRONE_TOKEN_PREFIX, drone_name_of

from .passwords import AccountError as AccountError
from .passwords import NotValid as NotValid
from .passwords import dummy_hash, hash_password, verify_password
from .store import Database

Role = Literal["admin", "member"]
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
DRONE_NAME = re.compile(DRONE_NAME_PATTERN)
MAX_LABEL = 200
LOGIN_SECONDS = 14 * 24 * 3600
"""How long a login lasts."""
FAILURE_WINDOW = 15 * 60
MAX_USER_FAILURES = 5
"""Failed logins for one user name within ``FAILURE_WINDOW`` before it is refused."""
MAX_ADDRESS_FAILURES = 20
"""Failed logins from one address within ``FAILURE_WINDOW`` before it is refused."""
PRUNE_EVERY = 60.0
"""Seconds between removals of failed logins older than ``FAILURE_WINDOW``."""
API_TOKEN_PREFIX = "hgt_"
REVOKED_DRONE_TOKEN = "DELETE FROM drone_tokens WHERE name = ? AND revoked_at IS NOT NULL"
NEW_USER = (
    "INSERT INTO users (user_id, name, name_key, password_hash, role, created_at)"
    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
NEW_DRONE_TOKEN = (
    "INSERT INTO drone_tokens (name, name_key, token_hash, created_at) VALUES (?, ?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)  # each refused by a name taken in another case (``name_key``), also by one given meanwhile


def user_key(name: str) -> str:
    """What failed logins under a name are counted by."""
    return f"user:{name}"


@dataclass(frozen=True)
class User:
    user_id: str
    name: str
    role: Role
    created_at: float
    has_password: bool

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def may_see(self, owner: str) -> bool:
        """Whether this person may see and abort what ``owner`` owns."""
        return self.admin or owner == self.user_id


@dataclass(frozen=True)
class DroneToken:
    name: str
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class Revocation:
    revocation_id: int
    kind: Literal["login", "token", "user", "drone"]
    revoked: str
    """The login's or token's hash, the user's id, or the drone's name."""


def token_hash(token: str) -> str:
    """(A lone surrogate, which no token holds, hashes as its own bytes: a wrong token.)"""
    return hashlib.sha256(token.encode(errors="surrogatepass")).hexdigest()


class Accounts:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._pruned = 0.0
        """When failed logins past their window were last removed."""

    # ---- people

    async def add_user(self, name: str, password: str | None, role: Role = "member") -> User:
        await self.check_new_name(name)
        hashed = await hash_password(password) if password is not None else None
        user = User(f"u_{secrets.token_hex(8)}", name, role, time.time(), hashed is not None)
        values = (user.user_id, name, name.lower(), hashed, role, user.created_at)
        if not await self.db.execute(NEW_USER, *values):  # given meanwhile, in some case
            await self.check_new_name(name)
            raise AccountError(f"A user named {name!r} already exists.")
        return user

    async def check_new_name(self, name: str) -> None:
        """Raise ``AccountError`` unless ``name`` may be given to a new person."""
        if not USER_NAME.fullmatch(name):
            raise NotValid(
                "A user name is 1-64 letters, digits, '.', '_', '@' or '-', starting with a "
                "letter or digit."
            )
        rows = await self.db.fetch("SELECT name FROM users WHERE lower(name) = ?", name.lower())
        if rows:  # ALICE beside alice: two people a colleague could not tell apart
            raise AccountError(f"A user named {rows[0]['name']!r} already exists.")

    async def users(self) -> list[User]:
        rows = await self.db.fetch("SELECT * FROM users ORDER BY name")
        return [_user(row) for row in rows]

    async def user(self, name: str) -> User | None:
        rows = await self.db.fetch("SELECT * FROM users WHERE name = ?", name)
        return _user(rows[0]) if rows else None

    async def user_by_id(self, user_id: str) -> User | None:
        rows = await self.db.fetch("SELECT * FROM users WHERE user_id = ?", user_id)
        return _user(rows[0]) if rows else None

    async def names(self, user_ids: set[str]) -> dict[str, str]:
        """The names of the people with these ids (those that still exist)."""
        if not user_ids:
            return {}
        marks = ",".join("?" for _ in user_ids)
        rows = await self.db.fetch(
            f"SELECT user_id, name FROM users WHERE user_id IN ({marks})", *user_ids
        )
        return {row["user_id"]: row["name"] for row in rows}

    async def remove_user(self, name: str) -> bool:
        user = await self.user(name)
        if user is None:
            return False
        if user.role == "admin":
            others = [u for u in await self.users() if u.user_id != user.user_id]
            if others and all(u.role != "admin" for u in others):
                raise AccountError(
                    f"{name} is the last admin: add another admin first (hangar user add NAME "
                    "--admin), or remove the others."
                )
        await self.db.execute("DELETE FROM users WHERE user_id = ?", user.user_id)
        await self._revoke("user", user.user_id)
        return True

    async def set_password(self, name: str, password: str) -> None:
        """Set the password, end every login of the person and lift the lock on the name."""
        user = await self.user(name)
        if user is None:
            raise AccountError(f"There is no user named {name!r}.")
        hashed = await hash_password(password)
        await self.db.execute(
            "UPDATE users SET password_hash = ? WHERE user_id = ?", hashed, user.user_id
        )
        await self.end_logins(user)
        await self.db.execute("DELETE FROM login_failures WHERE failure_key = ?", user_key(name))

    async def end_logins(self, user: User) -> None:
        """End every login of the person (other devices included)."""
        for row in await self.db.fetch(
            "SELECT token_hash FROM logins WHERE user_id = ?", user.user_id
        ):
            await self._end_login(row["token_hash"])

    async def check_password(self, name: str, password: str) -> User | None:
        """The person, if the password is theirs. Takes as long for an unknown name."""
        rows = await self.db.fetch("SELECT * FROM users WHERE name = ?", name)
        stored = rows[0]["password_hash"] if rows else None
        if not await verify_password(stored or dummy_hash(), password) or stored is None:
            return None
        return _user(rows[0])

    # ---- logins (the page's session cookie)

    async def log_in(self, user: User, seconds: float = LOGIN_SECONDS) -> str:
        token = secrets.token_urlsafe(32)
        now = time.time()
        await self.db.execute("DELETE FROM logins WHERE expires_at < ?", now)
        await self.db.execute(
            "INSERT INTO logins (token_hash, user_id, created_at, expires_at) VALUES (?, ?, ?, ?)",
            token_hash(token),
            user.user_id,
            now,
            now + seconds,
        )
        return token

    async def logged_in(self, token: str) -> tuple[User, float] | None:
        """The person a login token (the session cookie) belongs to, and when it expires, if it
        is still valid."""
        rows = await self.db.fetch(
            "SELECT users.*, logins.expires_at FROM logins"
            " JOIN users ON users.user_id = logins.user_id"
            " WHERE logins.token_hash = ? AND logins.expires_at > ?",
            token_hash(token),
            time.time(),
        )
        return (_user(rows[0]), float(rows[0]["expires_at"])) if rows else None

    async def log_out(self, token: str) -> None:
        await self._end_login(token_hash(token))

    async def _end_login(self, hashed: str) -> None:
        if await self.db.execute("DELETE FROM logins WHERE token_hash = ?", hashed):
            await self._revoke("login", hashed)

    # ---- personal API tokens (socket.io ``auth.token`` for scripts)

    async def create_api_token(self, name: str, label: str = "") -> str:
        if len(label) > MAX_LABEL or not label.isprintable():  # a line of ``token list``
            raise NotValid(
                f"A label is one line of at most {MAX_LABEL} characters, with no tabs or "
                "control characters."
            )
        user = await self.user(name)
        if user is None:
            raise AccountError(f"There is no user named {name!r}.")
        token = API_TOKEN_PREFIX + secrets.token_urlsafe(32)
        await self.db.execute(
            "INSERT INTO api_tokens (token_hash, user_id, label, created_at) VALUES (?, ?, ?, ?)",
            token_hash(token),
            user.user_id,
            label,
            time.time(),
        )
        return token

    async def api_token_user(self, token: str) -> User | None:
        rows = await self.db.fetch(
            "SELECT users.* FROM api_tokens JOIN users ON users.user_id = api_tokens.user_id"
            " WHERE api_tokens.token_hash = ?",
            token_hash(token),
        )
        return _user(rows[0]) if rows else None

    async def api_tokens(self, name: str) -> list[tuple[str, float]]:
        """The person's API tokens: label and when each was made, oldest first."""
        user = await self.user(name)
        if user is None:
            raise AccountError(f"There is no user named {name!r}.")
        rows = await self.db.fetch(
            "SELECT label, created_at FROM api_tokens WHERE user_id = ? ORDER BY created_at",
            user.user_id,
        )
        return [(row["label"], row["created_at"]) for row in rows]

    async def revoke_api_tokens(self, name: str, label: str | None = None) -> int:
        """Revoke the person's API tokens (those labelled ``label`` if given); how many."""
        user = await self.user(name)
        if user is None:
            raise AccountError(f"There is no user named {name!r}.")
        rows = await self.db.fetch(
            "SELECT token_hash, label FROM api_tokens WHERE user_id = ?", user.user_id
        )
        rows = [row for row in rows if label is None or row["label"] == label]
        for row in rows:
            await self.db.execute("DELETE FROM api_tokens WHERE token_hash = ?", row["token_hash"])
            await self._revoke("token", row["token_hash"])
        return len(rows)

    # ---- drone tokens

    async def create_drone_token(self, name: str) -> str:
        if not DRONE_NAME.fullmatch(name):
            raise NotValid(
                "A drone name is 1-64 letters, digits, '_' or '-', starting with a letter or digit."
            )
        rows = await self.db.fetch(
            "SELECT name FROM drone_tokens WHERE lower(name) = ? AND revoked_at IS NULL",
            name.lower(),
        )
        if rows:  # one drone whatever the case, as a drone's connect is checked
            raise AccountError(
                f"The drone {rows[0]['name']!r} has a token already; revoke it first."
            )
        token = f"{DRONE_TOKEN_PREFIX}{name}.{secrets.token_urlsafe(32)}"
        await self.db.execute(REVOKED_DRONE_TOKEN, name)  # not one made meanwhile
        values = (name, name.lower(), token_hash(token), time.time())
        if not await self.db.execute(NEW_DRONE_TOKEN, *values):  # one was made meanwhile
            return await self.create_drone_token(name)  # says so
        return token

    async def drone_tokens(self) -> list[DroneToken]:
        rows = await self.db.fetch("SELECT * FROM drone_tokens ORDER BY name")
        return [DroneToken(r["name"], r["created_at"], r["revoked_at"]) for r in rows]

    async def revoke_drone_token(self, name: str) -> bool:
        changed = await self.db.execute(
            "UPDATE drone_tokens SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
            time.time(),
            name,
        )
        if changed:
            await self._revoke("drone", name)
        return bool(changed)

    async def has_drone_token(self, name: str) -> bool:
        """Whether the drone ``name`` has (or had: revoked) a token of its own, so only that
        token opens it; in any case ("DESK" is refused when "desk" has one: a look-alike)."""
        return bool(
            await self.db.fetch("SELECT 1 FROM drone_tokens WHERE lower(name) = lower(?)", name)
        )

    async def drone_revoked(self, name: str) -> bool:
        """Whether the drone ``name`` had a token of its own, and has none now (revoked)."""
        sql = "SELECT 1 FROM drone_tokens WHERE name = ? AND revoked_at IS NOT NULL"
        return bool(await self.db.fetch(sql, name))

    async def drone_of(self, token: str) -> str | None:
        """The drone a drone token proves, if the token is valid and not revoked."""
        name = drone_name_of(token)
        if name is None:
            return None
        rows = await self.db.fetch(
            "SELECT token_hash FROM drone_tokens WHERE name = ? AND revoked_at IS NULL", name
        )
        if rows and hmac.compare_digest(rows[0]["token_hash"], token_hash(token)):
            return name
        return None

    # ---- failed logins

    async def login_attempt(self, address_key: str, user_key: str | None) -> bool:
        """Count an attempt against an address and a user name (None: no name a person could
        have) before its password is checked, so guesses sent at once cannot all pass; whether
        either has failed too often lately (then the password is not checked). A name is not
        counted while its address is refused: the record grows by what an address may try."""
        now = time.time()
        if now - self._pruned > PRUNE_EVERY:
            self._pruned = now
            await self.db.execute(
                "DELETE FROM login_failures WHERE since <= ?", now - FAILURE_WINDOW
            )
        for key, limit in ((address_key, MAX_ADDRESS_FAILURES), (user_key, MAX_USER_FAILURES)):
            if key is None:
                continue
            await self.db.execute(
                "INSERT INTO login_failures (failure_key, failures, since) VALUES (?, 1, ?)"
                " ON CONFLICT (failure_key) DO UPDATE SET"
                " failures = CASE WHEN login_failures.since > ?"
                " THEN login_failures.failures + 1 ELSE 1 END,"
                " since = CASE WHEN login_failures.since > ?"
                " THEN login_failures.since ELSE excluded.since END",
                key,
                now,
                now - FAILURE_WINDOW,
                now - FAILURE_WINDOW,
            )
            rows = await self.db.fetch(
                "SELECT failures FROM login_failures WHERE failure_key = ?", key
            )
            if rows and rows[0]["failures"] > limit:
                return True
        return False

    async def login_succeeded(self, address_key: str, user_key: str) -> None:
        """The attempt was no failure: the name's count starts again, the address's loses it."""
        await self.db.execute("DELETE FROM login_failures WHERE failure_key = ?", user_key)
        await self.db.execute(
            "UPDATE login_failures SET failures = failures - 1"
            " WHERE failure_key = ? AND failures > 0",
            address_key,
        )

    # ---- revocations

    async def revocations_after(self, revocation_id: int) -> list[Revocation]:
        rows = await self.db.fetch(
            "SELECT * FROM revocations WHERE revocation_id > ? ORDER BY revocation_id",
            revocation_id,
        )
        return [Revocation(r["revocation_id"], r["kind"], r["revoked"]) for r in rows]

    async def last_revocation(self) -> int:
        rows = await self.db.fetch("SELECT max(revocation_id) AS last FROM revocations")
        return int(rows[0]["last"] or 0)

    async def _revoke(self, kind: str, revoked: str) -> None:
        now = time.time()
        await self.db.execute("DELETE FROM revocations WHERE at < ?", now - 24 * 3600)
        await self.db.execute(
            "INSERT INTO revocations (kind, revoked, at) VALUES (?, ?, ?)", kind, revoked, now
        )


def _user(row: dict[str, Any]) -> User:
    has_password = row["password_hash"] is not None
    return User(row["user_id"], row["name"], row["role"], row["created_at"], has_password)
