"""Passwords: what one must be, and its argon2 hash (argon2-cffi, off the event loop: one hash
costs ~0.1 s)."""

from __future__ import annotations

import asyncio
import functools
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

_HASHER = PasswordHasher()


class AccountError(Exception):
    """A command cannot be done; the message is a sentence for the person."""


class NotValid(AccountError):
    """What was given (a name, a label, a password) cannot be taken, whatever the database
    holds: a command says so with exit code 2, as for any setting refused."""


@functools.cache
def dummy_hash() -> str:
    """What an unknown name's password is checked against, so it takes as long."""
    return _HASHER.hash(secrets.token_urlsafe(16))


MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_CHARS = 1024
"""Far more than any person types, and far less than the login page's form may send (1 MB)."""


def refuse_weak(password: str) -> None:
    """Raise ``NotValid`` for a password no person may have."""
    if not password:
        raise NotValid("A password cannot be empty.")
    if len(password) < MIN_PASSWORD_CHARS:
        raise NotValid(f"A password needs at least {MIN_PASSWORD_CHARS} characters.")
    if len(password) > MAX_PASSWORD_CHARS:
        raise NotValid(f"A password has at most {MAX_PASSWORD_CHARS} characters.")
    if password.isspace():
        raise NotValid("A password cannot be only white space.")


async def hash_password(password: str) -> str:
    refuse_weak(password)
    return await asyncio.to_thread(_HASHER.hash, password)


async def verify_password(hashed: str, password: str) -> bool:
    def verify() -> bool:
        try:
            return _HASHER.verify(hashed, password)
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False

    return await asyncio.to_thread(verify)
