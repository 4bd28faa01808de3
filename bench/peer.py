"""An upstream peer (tests.peers) in its own process, streaming endlessly at a fixed pace.

``GET /bench/requests`` lists what it saw: the last user prompt of each generation request and
``time.monotonic()`` stamps (comparable with other processes' on the same machine).
``POST /bench/pace?interval=S`` sets the pace of replies started from then on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from aiohttp import web

from bench.peers import OllamaPeer, OpenAIPeer, Reply, UpstreamPeer
from hangar.shared import runtime


def _prompt(messages: list[dict[str, Any]]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def add_report(peer: UpstreamPeer) -> None:
    add_routes = peer._add_routes

    async def requests(request: web.Request) -> web.Response:
        rows = [
            {
                "prompt": _prompt(r.messages),
                "started": r.started,
                "chunks": r.chunks_sent,
                "disconnectedAt": r.disconnected_at,
                "ended": r.ended,
            }
            for r in peer.requests
            if r.reply is not None
        ]
        return web.json_response(rows)

    async def pace(request: web.Request) -> web.Response:
        peer.default.delay = float(request.query["interval"])
        return web.json_response({"interval": peer.default.delay})

    def patched(app: web.Application) -> None:
        add_routes(app)
        app.router.add_get("/bench/requests", requests)
        app.router.add_post("/bench/pace", pace)

    peer._add_routes = patched  # type: ignore[method-assign]


async def serve(provider: str, interval: float, chunks: int) -> None:
    reply = Reply(chunks=["tok "] * chunks, delay=interval)
    peer: UpstreamPeer = (
        OpenAIPeer(default=reply) if provider == "openai" else OllamaPeer(default=reply)
    )
    add_report(peer)
    async with peer:
        print(f"PEER {peer.base_url}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--provider", choices=("openai", "ollama"), required=True)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between chunks")
    parser.add_argument("--chunks", type=int, default=1_000_000, help="chunks per reply")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        runtime.run(serve(args.provider, args.interval, args.chunks))


if __name__ == "__main__":
    main()
