"""Who may use a relay: its own origins only, people who logged in, scripts with an API token.

- **Origins.** A browser request (page form or socket.io, websocket and polling alike) that
  carries an ``Origin`` is refused unless the origin is the relay's own (the scheme and ``Host``
  it was reached at) or one given with ``--allowed-origin``. Requests without one (scripts,
  drones) are not browsers' and pass on to authentication.
- **Logins.** ``/login`` takes a user name and password and sets an HttpOnly, SameSite=Lax
  session cookie (Secure over HTTPS) naming a server-side login that expires; ``POST /logout``
  ends it. Failed logins are limited per user name and per address; every refusal says the same.
  A request from a trusted proxy (``--trusted-proxies``; none by default) is from the address
  its ``X-Forwarded-For`` names (the nearest one not itself a trusted proxy), so a proxy's
  visitors are limited each on their own, not all together as the proxy.
- **Demo.** A relay started by ``hangar demo`` on a loopback address logs a local visitor in as
  its demo user, and the page says so; only a page reached by a loopback name or address
  (``localhost``, ``127.0.0.1``, ``[::1]``), so another site's name pointed at this machine (DNS
  rebinding) gets the login page instead.
"""

from __future__ import annotations

import asyncio
import html
import ipaddress
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import asyncpg
import redis
from aiohttp import web

from .accounts import (
    API_TOKEN_PREFIX,
    LOGIN_SECONDS,
    USER_NAME,
    AccountError,
    Accounts,
    Revocation,
    User,
    token_hash,
    user_key,
)
from .bodies import form_of
from .connections import UNAVAILABLE
from .limits import QuietLog
from .login_checks import LoginChecks, address_group

log = logging.getLogger("hangar.relay")
ORIGIN_REFUSED = "hangar.origin_refused"
"""Set in a request's environ once its origin's refusal is logged."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
revocation_failures = QuietLog(log)
request_failures = QuietLog(log)

LOGIN_COOKIE = "hangar_login"
BAD_LOGIN = "Wrong user name or password."
BAD_FORM = "The login form could not be read; send it again from the login page."
TOO_MANY_LOGINS = "Too many failed logins; try again in a few minutes."
FOREIGN_ORIGIN = "Requests from other sites are refused."
ERROR_MARK = "<!--login-error-->"


@dataclass(frozen=True)
class Credential:
    """What a connection proved: a person, by a login (cookie) or an API token."""

    user: User
    kind: Literal["login", "token"]
    hashed: str
    """The login's or token's hash, as revocations name it."""
    expires_at: float | None = None
    """When a login expires (``time.time()``); an API token lasts until it is revoked."""


OUTAGES: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    sqlite3.Error,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    redis.RedisError,
)
"""What a database or Redis that does not answer raises (refused, reset, timed out)."""


def answer_unavailable(handler: Handler) -> Handler:
    """A page, login or logout asked for while the database (or Redis) does not answer: 503
    and one sentence, logged once per outage, not a traceback."""

    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except OUTAGES as error:
            request_failures.warning(
                "request not answered path=%s (%s: %s)",
                request.path,
                type(error).__name__,
                str(error)[:200],
            )
            return web.Response(status=503, text=UNAVAILABLE, headers={"Retry-After": "5"})

    return answer


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(host: str) -> str:
    """``host`` (a ``Host`` header) without its port: ``[::1]:8080`` -> ``::1``."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def networks(addresses: list[str]) -> list[Network]:
    """Addresses or networks (``10.0.0.0/8``) as networks; ValueError names a bad one."""
    return [ipaddress.ip_network(address.strip(), strict=False) for address in addresses]


def ip_of(text: str) -> Address | None:
    """The address in ``text`` (``1.2.3.4``, ``1.2.3.4:5678``, ``[::1]:80``, an IPv4-mapped
    IPv6 address as its IPv4 one), or None."""
    text = text.strip()
    if text.startswith("["):
        text = text[1 : text.find("]")]
    elif text.count(":") == 1:
        text = text.split(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class Access:
    def __init__(
        self,
        accounts: Accounts,
        allowed_origins: list[str],
        demo_user: str | None = None,
        trusted_proxies: list[str] | None = None,
    ) -> None:
        self.accounts = accounts
        self.allowed_origins = {origin.rstrip("/") for origin in allowed_origins}
        self.demo_user = demo_user
        """The user a loopback visitor is logged in as, on a demo relay."""
        self.proxies = networks(trusted_proxies or [])
        self.checks = LoginChecks()

    def client_address(self, request: web.BaseRequest) -> str:
        """Who sent ``request``: its peer, or the address a trusted proxy says it forwards (the
        nearest hop of ``X-Forwarded-For`` that is not a trusted proxy itself)."""
        peer = ip_of(request.remote or "")
        if peer is None or not self._proxy(peer):
            return request.remote or ""
        hops = ",".join(request.headers.getall("X-Forwarded-For", [])).split(",")
        for hop in reversed([h for h in hops if h.strip()]):
            address = ip_of(hop)
            if address is None:
                break  # not an address: the proxy's own is all that is known
            if not self._proxy(address):
                return str(address)
        return str(peer)

    def _proxy(self, address: Address) -> bool:
        return any(address in network for network in self.proxies)

    # ---- origins

    def origin_allowed(self, origin: str | None, environ: dict[str, Any]) -> bool:
        """python-engineio's ``cors_allowed_origins`` check, for every socket.io request."""
        if not origin:
            return True
        own = f"{environ.get('wsgi.url_scheme', 'http')}://{environ.get('HTTP_HOST', '')}"
        if origin == own or origin in self.allowed_origins:
            return True
        if not environ.get(ORIGIN_REFUSED):  # engine.io asks again for its refusal's headers
            environ[ORIGIN_REFUSED] = True
            log.info("refused a connection from the origin %r", origin[:200])
        return False

    def _request_origin_allowed(self, request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        if not origin or (origin == "null" and request.method == "GET"):
            return True
        return origin == f"{request.scheme}://{request.host}" or origin in self.allowed_origins

    # ---- who a connection is

    async def browser(self, environ: dict[str, Any], auth: Any) -> Credential | None:
        """The person a socket.io connection belongs to, or None (refused)."""
        token = auth.get("token") if isinstance(auth, dict) else None
        if isinstance(token, str) and token.startswith(API_TOKEN_PREFIX):
            user = await self.accounts.api_token_user(token)
            return Credential(user, "token", token_hash(token)) if user else None
        cookie = cookie_value(environ.get("HTTP_COOKIE", ""), LOGIN_COOKIE)
        return await self._login(cookie) if cookie else None

    async def _login(self, token: str) -> Credential | None:
        found = await self.accounts.logged_in(token)
        return Credential(found[0], "login", token_hash(token), found[1]) if found else None

    async def _request_login(self, request: web.Request) -> Credential | None:
        token = request.cookies.get(LOGIN_COOKIE)
        return await self._login(token) if token else None

    # ---- routes

    def add_routes(self, app: web.Application, page_dir: Path) -> None:
        async def index(request: web.Request) -> web.StreamResponse:
            page = page_dir / "index.html"
            if not page.exists():
                return web.Response(text="Hangar relay is running; the web page is not installed.")
            response = web.FileResponse(page, headers={"Cache-Control": "no-cache"})
            if await self._request_login(request) is not None:
                return response
            demo = await self._demo_login(request)
            if demo is None:
                raise web.HTTPSeeOther("/login")
            self._set_cookie(request, response, demo)
            return response

        async def login_page(request: web.Request) -> web.StreamResponse:
            if await self._request_login(request) is not None:
                raise web.HTTPSeeOther("/")
            return self._login_page(page_dir)

        async def login(request: web.Request) -> web.StreamResponse:
            if not self._request_origin_allowed(request):
                raise web.HTTPForbidden(text=FOREIGN_ORIGIN)
            form = await form_of(request)
            if form is None:
                return self._login_page(page_dir, BAD_FORM, 400)
            name, password = form.get("username"), form.get("password")
            if not isinstance(name, str) or not isinstance(password, str):
                return self._login_page(page_dir, BAD_LOGIN, 400)
            address = address_group(self.client_address(request))
            # A name no person can have is not kept (nor checked): only the address counts.
            stripped = name.strip()
            named = USER_NAME.fullmatch(stripped) is not None
            address_key, name_key = f"address:{address}", user_key(stripped)
            if await self.accounts.login_attempt(address_key, name_key if named else None):
                log.info("login refused (too many failures) user=%r", name[:64])
                return self._login_page(page_dir, TOO_MANY_LOGINS, 429, name)
            async with self.checks.turn(address):
                user = await self.accounts.check_password(stripped, password) if named else None
            if user is None:
                log.info("login failed user=%r address=%s", name[:64], address)
                return self._login_page(page_dir, BAD_LOGIN, 401, name)
            await self.accounts.login_succeeded(address_key, name_key)
            response = web.HTTPSeeOther("/")
            self._set_cookie(request, response, await self.accounts.log_in(user))
            log.info("login user=%s", user.name)
            raise response

        async def logout(request: web.Request) -> web.StreamResponse:
            if not self._request_origin_allowed(request):
                raise web.HTTPForbidden(text=FOREIGN_ORIGIN)
            token = request.cookies.get(LOGIN_COOKIE)
            if token:
                await self.accounts.log_out(token)
            response = web.HTTPSeeOther("/login")
            response.del_cookie(LOGIN_COOKIE, path="/")
            raise response

        app.router.add_get("/", answer_unavailable(index))
        app.router.add_get("/login", answer_unavailable(login_page))
        app.router.add_post("/login", answer_unavailable(login))
        app.router.add_post("/logout", answer_unavailable(logout))

    def _login_page(
        self, page_dir: Path, error: str | None = None, status: int = 200, name: str = ""
    ) -> web.Response:
        """The login form; after a refusal, with its message and the name given kept."""
        page = (page_dir / "login.html").read_text()
        if error:
            notice = f'<p class="login-error" role="alert">{html.escape(error)}</p>'
            page = page.replace(ERROR_MARK, notice)
        if name:
            page = page.replace(
                'name="username" value=""', f'name="username" value="{html.escape(name[:64])}"'
            ).replace(" required autofocus />", " required />", 1)
            page = page.replace(
                'autocomplete="current-password" required />',
                'autocomplete="current-password" required autofocus />',
            )
        return web.Response(
            text=page,
            status=status,
            content_type="text/html",
            headers={"Cache-Control": "no-store"},
        )

    async def _demo_login(self, request: web.Request) -> str | None:
        """A login token for the demo user, for a visitor on this machine; else None."""
        if self.demo_user is None or not is_loopback(self.client_address(request)):
            return None
        if not is_loopback(_host_name(request.headers.get("Host", ""))):
            return None  # a name that only points here (DNS rebinding) is not this machine's
        user = await self.accounts.user(self.demo_user)
        if user is None:
            try:
                user = await self.accounts.add_user(self.demo_user, None, "admin")
            except AccountError:  # the name is a person's now (in another case): no demo login
                return None
        return await self.accounts.log_in(user)

    def _set_cookie(self, request: web.Request, response: web.StreamResponse, token: str) -> None:
        secure = request.secure or request.headers.get("X-Forwarded-Proto") == "https"
        response.set_cookie(
            LOGIN_COOKIE,
            token,
            max_age=LOGIN_SECONDS,
            path="/",
            httponly=True,
            samesite="Lax",
            secure=secure,
        )


REVOCATION_POLL = 0.5
"""How often a relay looks for revoked logins, tokens, people and drones (seconds)."""
REVOCATION_TRIES = 120
"""Polls at which a revocation its listeners failed on (the store down) is tried again."""

Listener = Callable[[Revocation], Awaitable[None]]


async def follow_revocations(accounts: Accounts, listeners: list[Listener]) -> None:
    """Tell ``listeners`` of every revocation from now on, whichever relay or command made it.
    First, the people removed and the drones revoked (and given no token since) that the store
    still keeps (a day): a relay that was not running then never heard of them, and their turns
    would wait or run. A revocation the listeners failed on is told again at the next poll."""
    last = await accounts.last_revocation()
    due: dict[int, tuple[Revocation, int]] = {}
    for missed in await accounts.revocations_after(0):
        if missed.kind == "user" or (
            missed.kind == "drone" and await accounts.drone_revoked(missed.revoked)
        ):
            due[missed.revocation_id] = (missed, REVOCATION_TRIES)
    while True:
        for revocation_id, (revocation, tries) in list(due.items()):
            if await _tell(listeners, revocation) or tries <= 1:
                del due[revocation_id]
            else:
                due[revocation_id] = (revocation, tries - 1)
        await asyncio.sleep(REVOCATION_POLL)
        try:
            revocations = await accounts.revocations_after(last)
        except Exception as error:  # the store is down: read again at the next poll
            revocation_failures.warning(
                "reading revocations failed (%s: %s)", type(error).__name__, str(error)[:200]
            )
            continue
        for revocation in revocations:
            last = revocation.revocation_id
            due[last] = (revocation, REVOCATION_TRIES)


async def _tell(listeners: list[Listener], revocation: Revocation) -> bool:
    """Whether every listener acted on ``revocation`` (each does all it can, as often as told)."""
    told = True
    for listener in listeners:
        try:
            await listener(revocation)
        except Exception as error:
            revocation_failures.warning(
                "acting on a revocation failed, to be tried again (%s: %s)",
                type(error).__name__,
                str(error)[:200],
            )
            told = False
    return told


def cookie_value(header: str, name: str) -> str | None:
    """The value of the cookie ``name`` in a ``Cookie`` header, read as aiohttp reads it for
    the page's routes: pairs split at ``;``, one another program wrote unreadably skipped, not
    those after it (``http.cookies.SimpleCookie`` dropped them all); of two, the last."""
    found = None
    for pair in header.split(";"):
        key, sep, value = pair.partition("=")
        if sep and key.strip() == name:
            value = value.strip()
            found = value[1:-1] if len(value) > 1 and value[0] == value[-1] == '"' else value
    return found
