"""The relay process: an aiohttp app carrying the socket.io server, the page and its assets."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import socketio
from aiohttp import web

from .browsers import IdeNamespace
from .drones import DroneNamespace
from .identity import IDENTITY_COOKIE
from .live_state import LiveState, LocalLiveState
from .relay import Relay
from .sqlite_store import SqliteTurnStore
from .store import TurnStore

log = logging.getLogger("hangar.relay")

MAX_TRANSPORT_BYTES = 4_000_000
"""Engine.IO drops a connection sending more in one message; smaller ones get error acks."""
RELAY = web.AppKey("relay", Relay)


def web_dir() -> Path:
    """Where the page is: the installed ``hangar.web`` package, or ``HANGAR_WEB_DIR``."""
    override = os.environ.get("HANGAR_WEB_DIR")
    return Path(override) if override else Path(str(files("hangar.web")))


@dataclass
class RelayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    database: str = "hangar.db"
    drone_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    abort_grace: float = 10.0
    drone_grace: float = 3.0
    redis: str | None = None
    """Redis URL shared by several relays; None for a relay on its own."""
    demo_model: bool = False
    """Serve the offline demo model at ``/demo/v1`` (OpenAI-compatible, slow canned answers)."""


def open_store(database: str) -> TurnStore:
    """The store a database setting names: ``postgresql://…``, else a SQLite path."""
    if database.startswith(("postgresql://", "postgres://")):
        from .postgres_store import PostgresTurnStore

        return PostgresTurnStore(database)
    return SqliteTurnStore(database.removeprefix("sqlite:///"))


def open_live_state(redis: str | None) -> LiveState:
    if redis:
        from .redis_state import RedisLiveState

        return RedisLiveState(redis)
    return LocalLiveState()


def build_app(config: RelayConfig, store: TurnStore | None = None) -> web.Application:
    """The relay as an aiohttp application; the store opens and closes with it."""
    manager = socketio.AsyncRedisManager(config.redis) if config.redis else None
    sio = socketio.AsyncServer(
        client_manager=manager,
        async_mode="aiohttp",
        cors_allowed_origins=[],
        max_http_buffer_size=MAX_TRANSPORT_BYTES,
    )
    app = web.Application()
    sio.attach(app)
    relay = Relay(
        store or open_store(config.database),
        sio,
        open_live_state(config.redis),
        drone_token=config.drone_token,
        abort_grace=config.abort_grace,
        drone_grace=config.drone_grace,
    )
    sio.register_namespace(IdeNamespace(relay))
    sio.register_namespace(DroneNamespace(relay))
    app[RELAY] = relay

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await relay.store.open()
        if manager is not None and not sio.manager_initialized:
            # Measured: the Redis listener otherwise starts with the first client connection,
            # and acks aimed at clients on other relays time out until then.
            sio.manager_initialized = True
            manager.initialize()
        await relay.start()
        yield
        await relay.close()
        await relay.store.close()

    app.cleanup_ctx.append(lifecycle)
    add_page(app, web_dir())
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", relay.metrics.serve)
    if config.demo_model:
        from .demo_model import add_demo_model

        add_demo_model(app)
    return app


def add_page(app: web.Application, page_dir: Path) -> None:
    """Serve the page at ``/`` and its modules and vendored libraries under ``/static/``."""

    async def index(request: web.Request) -> web.StreamResponse:
        page = page_dir / "index.html"
        if not page.exists():
            return web.Response(text="Hangar relay is running; the web page is not installed.")
        response = web.FileResponse(page, headers={"Cache-Control": "no-cache"})
        if IDENTITY_COOKIE not in request.cookies:
            response.set_cookie(
                IDENTITY_COOKIE,
                secrets.token_urlsafe(32),
                max_age=365 * 24 * 3600,
                httponly=True,
                samesite="Lax",
            )
        return response

    app.router.add_get("/", index)
    if (page_dir / "index.html").exists():
        if not (page_dir / "vendor").is_dir():
            log.warning("the page's libraries are missing from %s/vendor: run make", page_dir)
        app.router.add_static("/static/", page_dir, follow_symlinks=False)


async def healthz(request: web.Request) -> web.Response:
    relay = request.app[RELAY]
    return web.json_response(
        {"ok": True, "drones": len(relay.directory.local), "live": len(relay.turns.live)}
    )
