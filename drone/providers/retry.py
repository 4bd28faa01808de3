"""When a request to the model service is tried again, and after how long.

The drone tries again itself rather than inside the openai SDK, so that the wait is known: the
service's ``Retry-After`` is the service answering, not the model falling silent, and the stall
watch is told so (``ChatOptions.hold``). The rules are the SDK's: a timeout, a connection that
failed, or ``408``, ``409``, ``429`` or ``5xx`` (unless the service says ``x-should-retry:
false``), after the wait the service asks for, or after 0.5 s doubling to 8 s with jitter. A wait
asked for of more than two minutes is not waited out: the turn fails at once and says so.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Mapping

import openai

LONGEST_WAIT = 120.0
"""Seconds of ``Retry-After`` the drone waits out at most (the SDK's own bound)."""
FIRST_BACKOFF, LAST_BACKOFF = 0.5, 8.0
A_DAY = 86_400.0
RETRIED_STATUSES = frozenset({408, 409, 429})


def asked_wait(headers: Mapping[str, str]) -> float | None:
    """Seconds ``Retry-After-Ms`` or ``Retry-After`` (seconds or an HTTP date) ask for."""
    for name, unit in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / unit
        except ValueError:
            continue
        if not math.isnan(seconds):
            return seconds
    value = headers.get("retry-after")
    try:
        when = email.utils.parsedate_tz(value) if value else None
        return None if when is None else email.utils.mktime_tz(when) - time.time()
    except (ValueError, OverflowError):  # a date past what the calendar takes
        return None


def retry_wait(error: openai.APIError, tries_left: int, tried: int) -> float | None:
    """Seconds to wait before trying a failed request again, or None: not again."""
    if tries_left <= 0:
        return None
    asked: float | None = None
    if isinstance(error, openai.APIStatusError):
        headers = error.response.headers
        asked = asked_wait(headers)
        if asked is not None and asked > LONGEST_WAIT:
            return None
        should = headers.get("x-should-retry")
        if should == "false" or (
            should != "true"
            and error.status_code not in RETRIED_STATUSES
            and error.status_code < 500
        ):
            return None
    elif not isinstance(error, openai.APIConnectionError):  # a timeout is one too
        return None
    if asked is not None and asked > 0:
        return asked
    return min(FIRST_BACKOFF * 2.0**tried, LAST_BACKOFF) * (1 - 0.25 * random.random())


def too_long(error: openai.APIError) -> str:
    """What to add to the error of a service that asked for a wait the drone does not take."""
    if not isinstance(error, openai.APIStatusError):
        return ""
    asked = asked_wait(error.response.headers)
    if asked is None or asked <= LONGEST_WAIT:
        return ""
    if asked > A_DAY:
        return " It asks to be tried again much later."
    return f" It asks to be tried again in {math.ceil(asked)} s."
