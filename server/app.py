"""The relay process: an aiohttp app carrying the socket.io server, the page and its assets."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from importlib.resources import files
from pathlib import Path

import socketio
from aiohttp import web

from hangar.shared.protocol import DRONE_NAMESPACE, IDE_NAMESPACE

from .access import Access, follow_revocations
from .bodies import quiet_client_faults, unreadable_bodies
from .browsers import IdeNamespace
from .channel import HEARING_WAIT, RedisChannel
from .drones import DroneNamespace
from .live_state import LiveState, LocalLiveState
from .relay import Relay
from .sqlite_store import SqliteTurnStore
from .store import TurnStore
from .transport import RelayServer

log = logging.getLogger("hangar.relay")

MAX_TRANSPORT_BYTES = 4_000_000
"""Engine.IO drops a connection sending more in one message; smaller ones get error acks."""
RELAY = web.AppKey("relay", Relay)
ACCESS = web.AppKey("access", Access)
PING_FLOOR = 0.5
SHUTDOWN_WAIT = 0.5
"""Seconds a stopping relay gives each connection's handler to finish before cancelling it
(engine.io closes every connection first, so none needs longer)."""
ABORTS_MARGIN = 1.0
"""Seconds past ``--abort-answer`` a stopping relay waits for the aborts under way to be answered
(the drone's answer, then the store's writes) before it closes the connections."""


def web_dir() -> Path:
    """Where the page is: the installed ``hangar.web`` package, or ``HANGAR_WEB_DIR``."""
    override = os.environ.get("HANGAR_WEB_DIR")
    return Path(override) if override else Path(str(files("hangar.web")))


@dataclass
class RelayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    database: str = "hangar.db"
    drone_token: str = ""
    """A secret shared by every drone (``--drone-token``); empty: drones need their own token."""
    allowed_origins: list[str] = field(default_factory=list)
    """Origins besides the relay's own that may use it (a proxy's public address)."""
    trusted_proxies: list[str] | None = None
    """Proxies whose ``X-Forwarded-For`` names who a request is from (none by default)."""
    demo_user: str | None = None
    """On a demo relay: the user a visitor on this machine is logged in as."""
    abort_grace: float = 10.0
    """Seconds a drone that acknowledged an abort has to complete the turn."""
    abort_answer: float = 2.0
    """Seconds a drone has to acknowledge an abort before the relay ends the turn itself."""
    drone_grace: float = 3.0
    """A drone that went silent is noticed within this (engine.io pings), and its turns end if
    it is not back within this again."""
    redis: str | None = None
    """Redis URL shared by several relays; None for a relay on its own."""
    redis_prefix: str = ""
    """What this deployment's Redis keys and channel start with; empty: one derived from the
    database, so deployments sharing a Redis server do not hear each other."""

    def deployment(self) -> str:
        if self.redis_prefix:
            return self.redis_prefix
        return "hangar-" + hashlib.sha256(self.database.encode()).hexdigest()[:12]

    ping: tuple[float, float] | None = None
    """engine.io's ping interval and timeout; None: derived from ``drone_grace`` (below)."""

    demo_model: bool = False
    """Serve the offline demo model at ``/demo/v1`` (OpenAI-compatible, slow canned answers)."""


def open_store(database: str, *, relay: bool = False, deployment: str | None = None) -> TurnStore:
    """The store a database setting names: ``postgresql://…`` (which a relay shares with its
    ``deployment``'s relays alone), else a SQLite path (which a relay holds for itself alone)."""
    if database.startswith(("postgresql://", "postgres://")):
        from .postgres_store import PostgresTurnStore

        return PostgresTurnStore(database, relay=relay, deployment=deployment)
    return SqliteTurnStore(database.removeprefix("sqlite:///"), relay=relay)


def open_live_state(
    redis: str | None, prefix: str, presence: float = 0.0, channel: RedisChannel | None = None
) -> LiveState:
    """``presence``: how long this relay's drones stay listed for the others if it dies;
    ``channel``: the relays' channel, which must listen for them to be listed."""
    if redis:
        from .redis_state import RedisLiveState

        state = RedisLiveState(redis, prefix, presence)
        if channel is not None:
            state.hears_relays = partial(channel.hearing, HEARING_WAIT)
        return state
    return LocalLiveState()


CLIENTS_DOING = (
    "bad-origin", "bad-sid", "bad-transport", "bad-jsonp-index", "bad-upgrade", "not-connected",
    "unexpected-http", "bad-version",
)  # fmt: skip
"""engine.io's names for the requests it refuses."""


def build_app(config: RelayConfig, store: TurnStore | None = None) -> web.Application:
    """The relay as an aiohttp application; the store opens and closes with it."""
    manager = RedisChannel(config.redis, config.deployment()) if config.redis else None
    # Relays on one PostgreSQL database must hear each other: the same channel on one Redis.
    deployment = f"{config.deployment()} on {redis_server(config.redis)}" if config.redis else None
    store = store or open_store(config.database, relay=True, deployment=deployment)
    relay_access: list[Access] = []
    sio = RelayServer(
        client_manager=manager,
        async_mode="aiohttp",
        # Every request carrying an Origin (websocket and polling) must come from the relay's
        # own origins; only /ide and /drone accept connections (not the default "/").
        cors_allowed_origins=lambda origin, environ: relay_access[0].origin_allowed(
            origin, environ
        ),
        namespaces=[IDE_NAMESPACE, DRONE_NAMESPACE],
        max_http_buffer_size=MAX_TRANSPORT_BYTES,
        # A ping every third of the grace, answered within the other two thirds: a frozen or
        # vanished peer (drone, browser, or this relay as its drones see it) is noticed within
        # ``drone_grace`` (engine.io's defaults, 25 s + 20 s, took 35-52 s). Never below
        # 0.5 s + 1 s: a busy event loop must not read as a dead one.
        ping_interval=config.ping[0] if config.ping else max(PING_FLOOR, config.drone_grace / 3),
        ping_timeout=config.ping[1]
        if config.ping
        else max(2 * PING_FLOOR, config.drone_grace * 2 / 3),
    )
    # A foreign origin, an unknown or closed session, a bad transport: a client's doing, not the
    # relay's failure. engine.io logs them at INFO, not at ERROR the first time.
    sio.eio.log_message_keys.update(CLIENTS_DOING)
    # So are a request aiohttp cannot read and a body that does not decode: 400, one INFO line.
    quiet_client_faults()
    app = web.Application(middlewares=[unreadable_bodies])
    sio.attach(app)
    relay = Relay(
        store,
        sio,
        open_live_state(config.redis, config.deployment(), config.drone_grace, manager),
        drone_token=config.drone_token,
        abort_grace=config.abort_grace,
        drone_grace=config.drone_grace,
        abort_answer=config.abort_answer,
    )
    access = Access(
        relay.accounts, config.allowed_origins, config.demo_user, config.trusted_proxies
    )
    relay_access.append(access)
    browsers, drones = IdeNamespace(relay, access), DroneNamespace(relay)
    sio.register_namespace(browsers)
    sio.register_namespace(drones)
    sio.handle_inline(DRONE_NAMESPACE, drones.inline)
    app[RELAY], app[ACCESS] = relay, access

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await relay.store.open()
        try:
            if manager is not None and not sio.manager_initialized:
                # Measured: the Redis listener otherwise starts with the first client
                # connection, and acks aimed at clients on other relays time out until then.
                sio.manager_initialized = True
                manager.initialize()
            await relay.start()
        except BaseException:  # Redis failing, or Ctrl-C, mid-start: close what was opened
            for opened in (relay.close, relay.store.close, *([manager.close] if manager else [])):
                with contextlib.suppress(Exception):
                    await opened()
            raise
        revocations = asyncio.ensure_future(
            follow_revocations(
                relay.accounts, [browsers.revoked, drones.revoked, relay.reports.person_removed]
            )
        )
        yield
        said = log.info if relay.listening else log.debug
        said("stopping: finishing what is in flight")
        revocations.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await revocations
        await relay.close()
        await relay.store.close()
        if manager is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await manager.flush()
            await manager.close()
        # engine.io's own task that watches the connections ends only when told (a cancel at
        # the instant its wait times out is lost in Python 3.11's ``wait_for``). Told, it ends
        # after its round over the connections left, by itself if not within the bound.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await sio.shutdown()
        said("stopped in %.2f s", time.monotonic() - stopping[0] if stopping else 0.0)

    stopping: list[float] = []

    async def stop_connections(app: web.Application) -> None:
        """On shutdown, before aiohttp waits for requests in flight (a pending long-poll among
        them): drones are dropped, so they move to another relay (or come back to this one when
        it is up again) with their work going on; browsers reconnect the same way."""
        stopping.append(time.monotonic())
        (log.info if relay.listening else log.debug)(
            "stopping: no new connections; drones moving to another relay: %d, browsers "
            "closing: %d",
            len(relay.directory.local),
            len(browsers.connections),
        )
        # An abort under way is carried out: its person hears so before the connection closes.
        await browsers.aborts_answered(config.abort_answer + ABORTS_MARGIN)
        relay.reaper.stopping = True
        await close_connections(sio)

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(stop_connections)
    app.on_response_prepare.append(secure_headers)
    page_dir = web_dir()
    access.add_routes(app, page_dir)
    add_static(app, page_dir)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", relay.metrics.serve)
    if config.demo_model:
        from .demo_model import add_demo_model

        add_demo_model(app)
    return app


async def close_connections(sio: socketio.AsyncServer) -> None:
    """Close every engine.io connection now, without waiting for clients to read the close.

    Otherwise a polling client's pending long-poll holds the shutdown for the ping interval
    (~25 s), and ``AsyncServer.disconnect()`` waits for ever on a polling client that is gone.
    """
    sockets = list(sio.eio.sockets.values())
    if sockets:
        await asyncio.gather(*(s.close(wait=False) for s in sockets), return_exceptions=True)


SECURITY_HEADERS = {
    # The page and its modules come from the relay alone, and nothing may frame it: another
    # site cannot run script in it, load what it wants into it, or trick a click on Cancel.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


async def secure_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response says where the page may load from, and that it is never framed."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


PAGE_FILES = (".html", ".js", ".css")
"""What ``/static/`` serves of the page's folder and its ``vendor/``: what the package ships
(``pyproject.toml``), never the rest of a checkout's ``web/`` (npm's tree, its manifests)."""


def add_static(app: web.Application, page_dir: Path) -> None:
    """Serve the page's modules and vendored libraries under ``/static/``."""
    if not (page_dir / "index.html").exists():
        return
    if not (page_dir / "vendor").is_dir():
        log.warning("the page's libraries are missing from %s/vendor: run make", page_dir)

    async def page_file(request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        folder = page_dir / request.match_info.get("folder", "")
        path = folder / name
        if (
            "/" in name  # an escaped slash, %2F
            or name.startswith(".")
            or not name.endswith(PAGE_FILES)
            or not plain_file(path)
        ):
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app.router.add_get("/static/{name}", page_file)
    app.router.add_get("/static/{folder:vendor}/{name}", page_file)


def redis_server(url: str) -> str:
    """The Redis database ``url`` names (where, and which number), not who logs in to it."""
    parts = urllib.parse.urlsplit(url)
    number = urllib.parse.parse_qs(parts.query).get("db", ["0"])[0]
    if parts.scheme == "unix":
        return f"unix:{parts.path}/{number}"
    return f"{parts.hostname}:{parts.port or 6379}/{parts.path.strip('/') or number}"


def plain_file(path: Path) -> bool:
    """Whether ``path`` is a file, not a link to one. A name longer than the file system takes
    is neither: Python 3.11 raises ``ENAMETOOLONG`` for it, where it answers False for a name
    that is not there."""
    try:
        return not path.is_symlink() and path.is_file()
    except OSError:
        return False


async def healthz(request: web.Request) -> web.Response:
    relay = request.app[RELAY]
    return web.json_response(
        {"ok": True, "drones": len(relay.directory.local), "live": len(relay.turns.live)}
    )
