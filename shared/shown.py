"""How a setting that may hold a secret is printed: a URL's password left out.

Database and Redis URLs carry passwords (``postgresql://user:password@host/db``, or
``?password=``); whatever the relay prints or logs goes to terminals, journals and CI logs.
"""

from __future__ import annotations

import shlex
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

HIDDEN = "***"


def without_password(text: str) -> str:
    """``text`` with a URL's password, in its user part or its query, shown as ``***``."""
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:  # not a URL that parses: nothing to find a password in
        return text
    netloc = parts.netloc
    if password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:{HIDDEN}@{host}"
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(key.lower() == "password" for key, _ in pairs):
        query = urlencode([(k, HIDDEN if k.lower() == "password" else v) for k, v in pairs])
    if netloc == parts.netloc and query == parts.query:
        return text
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def shown(text: str) -> str:
    """A setting as printed in a command to paste: its password left out, quoted for a shell."""
    return shlex.quote(without_password(text))
