"""``fetch_url``: an HTTP GET of a public address, closed the moment the work order is aborted.

Private (IPv6 site-local included), loopback, link-local, multicast, reserved and unspecified
addresses, and IPv4-mapped or 6to4 addresses of those, are refused unless allowed: checked on
the addresses a name resolves to (in the connector's resolver, so the connection goes to the
address that was checked) and on every redirect, which is followed here, one hop at a time. The
body is read in bounded chunks up to a cap.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from hangar.shared.abort import AbortSignal, AbortTimeoutError

from .errors import ToolError

MAX_BODY_CHARS = 50_000
MAX_BODY_BYTES = 4 * MAX_BODY_CHARS
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressRefusedError(OSError):
    """A host resolved to an address the policy refuses (an ``OSError``, so that aiohttp's
    connector passes it on as a connection error)."""


NOT_GLOBAL = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("3fff::/20"))
"""IETF protocol assignments and IPv6's newer documentation block: not globally reachable, and
global to Python before 3.11.10 and 3.12.4 (the first) and 3.13 (the second)."""
EXCEPTED = (ipaddress.ip_address("192.0.0.9"), ipaddress.ip_address("192.0.0.10"))
"""The two of them that are globally reachable (port control, traversal relays)."""


@dataclass(frozen=True)
class AddressPolicy:
    """Which addresses ``fetch_url`` may connect to: public ones, unless ``allow_private``;
    ``also_allowed`` lets chosen networks through (a known internal host)."""

    allow_private: bool = False
    also_allowed: Collection[Network] = ()

    def refusal(self, address: Address) -> str | None:
        """Why ``address`` is refused ("a loopback address"), or None if it is allowed."""
        if self.allow_private or any(address in network for network in self.also_allowed):
            return None
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is not None:
                return self.refusal(address.ipv4_mapped)
            # Where 6to4 is routed, its address reaches the IPv4 host it wraps; and site-local
            # addresses are private (Python before 3.11.10 and 3.12.4 calls both global).
            if address.sixtofour is not None and (wrapped := self.refusal(address.sixtofour)):
                return f"a 6to4 address of {wrapped}"
            if address.is_site_local:
                return "a site-local address"
        kinds = (
            ("an unspecified", address.is_unspecified),
            ("a loopback", address.is_loopback),
            ("a link-local", address.is_link_local),
            ("a multicast", address.is_multicast),
            ("a private", address.is_private),
            ("a reserved", address.is_reserved),
            ("a non-public", not address.is_global),
            ("a non-public", any(address in n for n in NOT_GLOBAL) and address not in EXCEPTED),
        )
        return next((f"{kind} address" for kind, found in kinds if found), None)

    def check(self, host: str, address: Address) -> None:
        why = self.refusal(address)
        if why is not None:
            shown = host if host == str(address) else f"{host} ({address})"
            raise AddressRefusedError(f"{shown} is {why}; only public addresses may be fetched.")


class CheckedResolver(AbstractResolver):
    """Resolves with ``inner`` and keeps only the addresses the policy allows; refuses a name
    with none. The connector connects to what this returns, so no second lookup can differ."""

    def __init__(self, policy: AddressPolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self.owns_inner = inner is None
        self.inner = inner if inner is not None else DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        allowed = [r for r in found if self.policy.refusal(_address(r["host"])) is None]
        if found and not allowed:
            self.policy.check(host, _address(found[0]["host"]))
        return allowed

    async def close(self) -> None:
        if self.owns_inner:
            await self.inner.close()


async def fetch_url(
    url: str,
    signal: AbortSignal,
    seconds: float,
    *,
    allow_private: bool = False,
    policy: AddressPolicy | None = None,
    resolver: AbstractResolver | None = None,
) -> str:
    """GET ``url``; "HTTP <status>\\n<body>". ``policy`` (default: public addresses only, or
    any with ``allow_private``) and ``resolver`` (default: the system's) may be replaced."""
    rules = policy if policy is not None else AddressPolicy(allow_private=allow_private)
    target = _http_url(url, url)

    async def fetch() -> str:
        checked = CheckedResolver(rules, resolver)
        try:
            connector = aiohttp.TCPConnector(resolver=checked)
            async with aiohttp.ClientSession(connector=connector) as session:
                return await _follow(session, rules, target)
        finally:
            await checked.close()

    try:
        # On abort the scope cancels the read: the ``async with`` blocks close the connection.
        async with signal.scope(seconds):
            return await fetch()
    except AbortTimeoutError:
        signal.throw_if_aborted()  # the person's abort, not the fetch's own time limit
        raise ToolError(f"Fetching {url} timed out after {seconds:g} s.") from None
    except AddressRefusedError as error:
        raise ToolError(f"Fetching {url} was refused: {error}") from None
    except aiohttp.ClientConnectorError as error:
        if isinstance(error.os_error, AddressRefusedError):
            raise ToolError(f"Fetching {url} was refused: {error.os_error}") from None
        raise ToolError(f"Fetching {url} failed: {error}") from None
    except aiohttp.ClientError as error:
        raise ToolError(f"Fetching {url} failed: {error}") from None


async def _follow(session: aiohttp.ClientSession, rules: AddressPolicy, target: URL) -> str:
    """GET ``target``, following redirects here so that each hop is checked."""
    for _ in range(MAX_REDIRECTS + 1):
        _check_literal(rules, target)
        async with session.get(target, allow_redirects=False) as response:
            location = response.headers.get("Location")
            if response.status not in REDIRECTS or not location:
                return f"HTTP {response.status}\n{await _body(response)}"
        target = _http_url(str(target.join(URL(location))), location)
    raise ToolError(f"Fetching {target} followed more than {MAX_REDIRECTS} redirects.")


async def _body(response: aiohttp.ClientResponse) -> str:
    """At most ``MAX_BODY_BYTES`` of the body, read in chunks; the rest is left unread."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) >= MAX_BODY_BYTES:
            break
    try:
        text = bytes(body[:MAX_BODY_BYTES]).decode(response.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        text = bytes(body[:MAX_BODY_BYTES]).decode("utf-8", errors="replace")
    cut = len(text) > MAX_BODY_CHARS or not response.content.at_eof()
    if cut:
        return text[:MAX_BODY_CHARS] + "\n[… the rest of the body was not read]"
    return text


def _http_url(text: str, shown: str) -> URL:
    try:
        url = URL(text)
    except ValueError:
        raise ToolError(f"{shown!r} is not a valid URL.") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ToolError(f"Only http:// and https:// URLs can be fetched (not {shown!r}).")
    return url


def _check_literal(rules: AddressPolicy, url: URL) -> None:
    """An address written in the URL: aiohttp connects to it without asking the resolver."""
    host = url.raw_host or ""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return
    rules.check(host, address)


def _address(text: str) -> Address:
    return ipaddress.ip_address(text.split("%", 1)[0])
