"""How a setting that may hold a secret is printed: a URL's password left out.

Database and Redis URLs carry passwords (``postgresql://user:password@host/db``, or
``?password=``); whatever the relay prints or logs goes to terminals, journals and CI logs.
The password is found by its place in the text, not by parsing the URL: a URL that does not
parse (a bracket left open) may still hold one.
"""

from __future__ import annotations

import re
import shlex

HIDDEN = "***"
_USER_PASSWORD = re.compile(r"(://[^:/?#@\s]*:)[^\s]*@")
"""After the scheme: the user, a colon, then the password up to the last ``@``."""
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\s]*", re.IGNORECASE)


def without_password(text: str) -> str:
    """``text`` with a URL's password, in its user part or its query, shown as ``***``."""
    text = _USER_PASSWORD.sub(lambda found: f"{found.group(1)}{HIDDEN}@", text)
    return _QUERY_PASSWORD.sub(lambda found: f"{found.group(1)}{HIDDEN}", text)


_SECRET_FIELDS = re.compile(r'("(?:token|instance|password)"\s*:\s*")([^"]*)"')
"""A connect's secrets as JSON in a transport's log line: a drone's or a person's token, a
drone process's instance secret."""
_TOKENS = re.compile(r"\b(hgd\.[A-Za-z0-9_-]{1,64}\.|hgt_)[A-Za-z0-9_-]+")
"""A drone token (``hgd.<name>.<secret>``: its name is no secret) or an API token."""


def without_secrets(text: str) -> str:
    """``text`` with passwords (``without_password``) and tokens shown as ``***``."""
    text = _SECRET_FIELDS.sub(lambda found: f'{found.group(1)}{_kept(found.group(2))}"', text)
    return without_password(_TOKENS.sub(lambda found: f"{found.group(1)}{HIDDEN}", text))


def _kept(secret: str) -> str:
    found = _TOKENS.match(secret)
    return f"{found.group(1)}{HIDDEN}" if found else HIDDEN


def shown(text: str) -> str:
    """A setting as printed in a command to paste: its password left out, quoted for a shell."""
    return shlex.quote(without_password(text))
