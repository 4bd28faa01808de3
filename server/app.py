"""The relay process: an aiohttp app carrying the socket.io server, the page and its assets."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import socketio
from aiohttp import web

from .relay import Relay
from .sessions import IDENTITY_COOKIE, DroneNamespace, IdeNamespace
from .sqlite_store import SqliteTurnStore
from .store import TurnStore

log = logging.getLogger("hangar.relay")

WEB_DIR = Path(os.environ.get("HANGAR_WEB_DIR", Path(__file__).resolve().parent.parent / "web"))
SOCKET_IO_CLIENT = "node_modules/socket.io-client/dist/socket.io.esm.min.js"
MAX_PAYLOAD_BYTES = 2_000_000
RELAY = web.AppKey("relay", Relay)


@dataclass
class RelayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    database: str = "hangar.db"
    drone_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    abort_grace: float = 10.0
    drone_grace: float = 3.0
    demo_model: bool = False
    """Serve the offline demo model at ``/demo/v1`` (OpenAI-compatible, slow canned answers)."""


def open_store(database: str) -> TurnStore:
    """The store a database setting names: a SQLite path (or ``sqlite:///path``)."""
    if database.startswith("sqlite:///"):
        database = database.removeprefix("sqlite:///")
    return SqliteTurnStore(database)


def build_app(config: RelayConfig, store: TurnStore | None = None) -> web.Application:
    """The relay as an aiohttp application; the store opens and closes with it."""
    sio = socketio.AsyncServer(
        async_mode="aiohttp",
        cors_allowed_origins=[],
        max_http_buffer_size=MAX_PAYLOAD_BYTES,
    )
    app = web.Application()
    sio.attach(app)
    relay = Relay(
        store or open_store(config.database),
        sio,
        drone_token=config.drone_token,
        abort_grace=config.abort_grace,
        drone_grace=config.drone_grace,
    )
    sio.register_namespace(IdeNamespace(relay))
    sio.register_namespace(DroneNamespace(relay))
    app[RELAY] = relay

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await relay.store.open()
        await recover(relay)
        yield
        await relay.close()
        await relay.store.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/vendor/socket.io.esm.min.js", socket_io_client)
    if (WEB_DIR / "index.html").exists():
        app.router.add_static("/static/", WEB_DIR, follow_symlinks=False)
    if config.demo_model:
        from .demo_model import add_demo_model

        add_demo_model(app)
    return app


async def recover(relay: Relay) -> None:
    """Turns a previous relay process left ``processing`` can never complete here: end them."""
    for turn in await relay.store.processing_turns():
        if turn.turn_id not in relay.live:
            await relay.store.end_turn(turn.turn_id, "error", "The relay restarted.", turn.text)
            log.info("recovered turn=%s as error", turn.turn_id)


async def index(request: web.Request) -> web.StreamResponse:
    page = WEB_DIR / "index.html"
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


async def socket_io_client(request: web.Request) -> web.StreamResponse:
    path = WEB_DIR / SOCKET_IO_CLIENT
    if not path.exists():
        raise web.HTTPNotFound(text="socket.io-client is not installed: run npm ci in web/.")
    return web.FileResponse(path)


async def healthz(request: web.Request) -> web.Response:
    relay = request.app[RELAY]
    return web.json_response(
        {"ok": True, "drones": len(relay.drones), "processing": len(relay.live)}
    )
