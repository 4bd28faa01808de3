"""``fetch_url`` reaches public addresses only, unless private ones are allowed: the check holds
for written addresses, for names (after resolution) and for every redirect hop. Its body is
read up to a cap.

Local pages listen on 127.0.0.1 and ::1. A name that "resolves" to them comes from a resolver
given to ``fetch_url`` (aiohttp's resolver interface), so no DNS is needed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from hangar.drone.tools import ToolError
from hangar.drone.tools.fetch import MAX_BODY_CHARS, MAX_REDIRECTS, AddressPolicy, fetch_url
from hangar.shared.abort import AbortController


@dataclass
class Pages:
    """A local site that records what it was asked for."""

    host: str
    requests: list[str] = field(default_factory=list)
    port: int = 0
    redirect_to: str = ""
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str = "/") -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}{path}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.host} {request.path}")
        if request.path == "/redirect":
            raise web.HTTPFound(self.redirect_to)
        if request.path == "/loop":
            raise web.HTTPFound("/loop")
        if request.path == "/endless":
            return await self.endless(request)
        return web.Response(text=f"page {request.path} on {self.host}")

    async def endless(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while True:
                await response.write(b"y" * 65536)
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise


async def serve(host: str) -> AsyncIterator[Pages]:
    pages = Pages(host)
    app = web.Application()
    app.router.add_get("/{tail:.*}", pages.handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    pages.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield pages
    await runner.cleanup()


@pytest.fixture
async def v4() -> AsyncIterator[Pages]:
    async for pages in serve("127.0.0.1"):
        yield pages


@pytest.fixture
async def v6() -> AsyncIterator[Pages]:
    async for pages in serve("::1"):
        yield pages


class Names(AbstractResolver):
    """A resolver that knows a few names, as a DNS server under someone else's control would."""

    def __init__(self, **names: str) -> None:
        self.names = {name.replace("_", "."): address for name, address in names.items()}

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        address = self.names[host]
        found = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [
            {"hostname": host, "host": address, "port": port, "family": found, "proto": 0,
             "flags": socket.AI_NUMERICHOST}
        ]  # fmt: skip

    async def close(self) -> None:
        pass


async def fetch(url: str, **options: object) -> str:
    with AbortController() as controller:
        return await fetch_url(url, controller.signal, 10, **options)  # type: ignore[arg-type]


LOOPBACK_FORMS = {
    "IPv4": "http://127.0.0.1:{v4}/",
    "IPv6": "http://[::1]:{v6}/",
    "localhost": "http://localhost:{v4}/",
    "unspecified": "http://0.0.0.0:{v4}/",
    "IPv4-mapped IPv6": "http://[::ffff:127.0.0.1]:{v4}/",
}


@pytest.mark.parametrize("form", LOOPBACK_FORMS)
async def test_fetch_refuses_loopback_addresses_by_default(form: str, v4: Pages, v6: Pages) -> None:
    url = LOOPBACK_FORMS[form].format(v4=v4.port, v6=v6.port)

    with pytest.raises(ToolError) as refused:
        await fetch(url)

    assert str(refused.value).startswith(f"Fetching {url} was refused: ")
    assert str(refused.value).endswith("only public addresses may be fetched.")
    assert v4.requests == v6.requests == []


@pytest.mark.parametrize("form", LOOPBACK_FORMS)
async def test_fetch_reaches_loopback_addresses_when_private_ones_are_allowed(
    form: str, v4: Pages, v6: Pages
) -> None:
    url = LOOPBACK_FORMS[form].format(v4=v4.port, v6=v6.port)

    result = await fetch(url, allow_private=True)

    assert result.startswith("HTTP 200\npage / on ")
    assert len(v4.requests) + len(v6.requests) == 1


async def test_fetch_refuses_a_public_looking_name_that_resolves_to_loopback(v4: Pages) -> None:
    names = Names(www_example_com="127.0.0.1")
    url = f"http://www.example.com:{v4.port}/"

    with pytest.raises(ToolError) as refused:
        await fetch(url, resolver=names)
    reached = await fetch(url, resolver=names, allow_private=True)

    assert str(refused.value) == (
        f"Fetching {url} was refused: www.example.com (127.0.0.1) is a loopback address; "
        "only public addresses may be fetched."
    )
    assert reached == "HTTP 200\npage / on 127.0.0.1"
    assert v4.requests == [f"www.example.com:{v4.port} /"]


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("2002:7f00:1::1", "a 6to4 address of a loopback address"),
        ("2002:a00:1::", "a 6to4 address of a private address"),
        ("fec0::1", "a site-local address"),
        ("192.0.0.8", "a non-public address"),
        ("::ffff:c000:8", "a non-public address"),  # ::ffff:192.0.0.8
        ("3fff::1", "a non-public address"),
    ],
)
async def test_fetch_refuses_ipv6_addresses_that_lead_to_private_networks(
    address: str, why: str
) -> None:
    """A 6to4 address reaches the IPv4 host it wraps (10.0.0.1, 127.0.0.1) where 6to4 is
    routed, and site-local addresses are private: some Python releases call both global, and
    also IETF protocol assignments (192.0.0.0/24) and IPv6's newer documentation block."""
    url = "http://www.example.com/"

    with pytest.raises(ToolError) as refused:
        await fetch(url, resolver=Names(www_example_com=address))

    assert str(refused.value) == (
        f"Fetching {url} was refused: www.example.com ({address}) is {why}; "
        "only public addresses may be fetched."
    )


@pytest.mark.parametrize("hop", ["written address", "name"])
async def test_fetch_checks_every_redirect_hop(hop: str, v4: Pages, v6: Pages) -> None:
    """The first page is allowed (its network is let through); its redirect leads to ::1."""
    first_only = AddressPolicy(also_allowed=[ipaddress.ip_network("127.0.0.1/32")])
    names = Names(intranet_example_com="::1")
    target = "[::1]" if hop == "written address" else "intranet.example.com"
    v4.redirect_to = f"http://{target}:{v6.port}/secret"

    with pytest.raises(ToolError) as refused:
        await fetch(v4.url("/redirect"), policy=first_only, resolver=names)
    followed = await fetch(v4.url("/redirect"), allow_private=True, resolver=names)

    shown = "::1" if hop == "written address" else "intranet.example.com (::1)"
    assert str(refused.value) == (
        f"Fetching {v4.url('/redirect')} was refused: {shown} is a loopback address; "
        "only public addresses may be fetched."
    )
    assert followed == "HTTP 200\npage /secret on ::1"
    assert len(v4.requests) == 2
    assert len(v6.requests) == 1  # the allowed fetch only


async def test_fetch_refuses_a_redirect_to_another_scheme(v4: Pages) -> None:
    v4.redirect_to = "file:///etc/passwd"

    with pytest.raises(ToolError) as refused:
        await fetch(v4.url("/redirect"), allow_private=True)

    assert str(refused.value) == (
        "Only http:// and https:// URLs can be fetched (not 'file:///etc/passwd')."
    )


async def test_fetch_gives_up_after_a_few_redirects(v4: Pages) -> None:
    with pytest.raises(ToolError) as refused:
        await fetch(v4.url("/loop"), allow_private=True)

    assert str(refused.value) == (
        f"Fetching {v4.url('/loop')} followed more than {MAX_REDIRECTS} redirects."
    )
    assert len(v4.requests) == MAX_REDIRECTS + 1


async def test_fetch_reads_an_endless_body_only_up_to_its_cap(v4: Pages) -> None:
    result = await asyncio.wait_for(fetch(v4.url("/endless"), allow_private=True), 10)

    assert result == (
        "HTTP 200\n" + "y" * MAX_BODY_CHARS + "\n[… the rest of the body was not read]"
    )
    await asyncio.wait_for(v4.disconnected.wait(), 5)


async def test_fetch_refuses_urls_that_are_not_http() -> None:
    with pytest.raises(ToolError) as refused:
        await fetch("ftp://example.com/file")

    assert str(refused.value) == (
        "Only http:// and https:// URLs can be fetched (not 'ftp://example.com/file')."
    )
