"""Who a browser connection is, and the limits every connection's input is held to."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from http.cookies import SimpleCookie
from typing import Any

from pydantic import ValidationError

from hangar.shared.protocol import describe

IDENTITY_COOKIE = "hangar_identity"
MAX_EVENT_BYTES = 1_000_000
"""Largest browser event payload answered normally; bigger ones get an error ack."""
TOO_MANY_SUBMITS = "Too many work orders at once; try again in a few seconds."
TOO_MANY_ABORTS = "Too many aborts at once; try again in a moment."
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{32,128}$")


def browser_identity(environ: dict[str, Any], auth: Any) -> str:
    """The owner id of a browser connection.

    A secret token (socket.io ``auth.token``, else the identity cookie the page set) names the
    person; a connection with neither gets a fresh identity of its own.
    """
    token = auth.get("token") if isinstance(auth, dict) else None
    if not (isinstance(token, str) and _TOKEN.match(token)):
        cookie = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        morsel = cookie.get(IDENTITY_COOKIE)
        token = morsel.value if morsel and _TOKEN.match(morsel.value) else None
    if token is None:
        token = secrets.token_urlsafe(32)
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class PayloadError(ValueError):
    """A payload refused before validation; the message is the whole refusal."""


def one_payload(args: tuple[Any, ...], limit: int | None = None) -> Any:
    """The single payload of an event: none means ``{}``; more than one is malformed."""
    if not args:
        return {}
    if len(args) > 1:
        raise PayloadError("Invalid payload (expected one payload object).")
    if limit is not None:
        size = len(json.dumps(args[0], separators=(",", ":"), ensure_ascii=False).encode())
        if size > limit:
            raise PayloadError(
                f"The payload is too large ({size} bytes; the limit is {limit} bytes)."
            )
    return args[0]


def refusal(error: Exception) -> str:
    """The sentence a malformed payload is answered with."""
    if isinstance(error, ValidationError):
        return describe(error)
    if isinstance(error, PayloadError):
        return str(error)
    return f"Invalid payload ({error})."


class RateLimit:
    """A token bucket: ``burst`` events at once, refilled at ``per_second``."""

    def __init__(self, burst: float, per_second: float) -> None:
        self.burst = burst
        self.per_second = per_second
        self.tokens = burst
        self.at = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_second)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
