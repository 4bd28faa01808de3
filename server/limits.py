"""The limits every connection's input is held to, and the sentences that refuse it."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import ValidationError

from hangar.shared.protocol import describe

MAX_EVENT_BYTES = 1_000_000
"""Largest browser event payload answered normally; bigger ones get an error ack."""
TOO_MANY_SUBMITS = "Too many work orders at once; try again in a few seconds."
TOO_MANY_ABORTS = "Too many aborts at once; try again in a moment."
TOO_MANY_ANSWERS = "Too many approvals at once; try again in a moment."


NOT_UNICODE = "Invalid payload (text that is not valid Unicode, such as half of a surrogate pair)."


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
    if isinstance(error, UnicodeError):
        return NOT_UNICODE
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


class QuietLog:
    """One log line per ``every`` seconds for a failure that repeats (a database that is down
    fails every call): the first at once, then how many more there were."""

    def __init__(self, logger: logging.Logger, every: float = 10.0) -> None:
        self.logger = logger
        self.every = every
        self.at = -every
        self.skipped = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.at < self.every:
            self.skipped += 1
            return
        if self.skipped:
            message += f" ({self.skipped} more like it since the last line)"
        self.at, self.skipped = now, 0
        self.logger.warning(message, *args)
