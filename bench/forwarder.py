"""A bare python-socketio forwarder: the baseline the relay's throughput is compared with.

It speaks just enough of the relay's protocol for the same client code to run against both:
``submitWorkOrder`` on ``/ide`` hands a work order to a drone on ``/drone`` (to each connected
drone in turn), ``abortWorkOrder`` is passed to the turn's drone and its answer back; the
drone's ``workOrderProgress`` and ``workOrderComplete`` are re-emitted, unchecked, to the
submitter's room.
No validation, no storage, no ordering lanes.

    .venv/bin/python -m bench.forwarder   # prints "Forwarder listening on http://127.0.0.1:PORT/"
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import socketio
from aiohttp import web

from hangar.shared import runtime

IDE, DRONE = "/ide", "/drone"


def build() -> web.Application:
    sio = socketio.AsyncServer(
        async_mode="aiohttp", cors_allowed_origins=[], max_http_buffer_size=2_000_000
    )
    app = web.Application()
    sio.attach(app)
    drones: list[str] = []
    rooms: dict[str, str] = {}  # turn id -> session room
    runs_on: dict[str, str] = {}  # turn id -> drone sid
    ids = itertools.count(1)

    @sio.on("connect", namespace=DRONE)  # type: ignore[untyped-decorator]
    async def drone_connect(sid: str, environ: dict[str, Any], auth: Any) -> None:
        drones.append(sid)

    @sio.on("disconnect", namespace=DRONE)  # type: ignore[untyped-decorator]
    async def drone_disconnect(sid: str, *reason: Any) -> None:
        drones.remove(sid)

    @sio.on("submitWorkOrder", namespace=IDE)  # type: ignore[untyped-decorator]
    async def submit(sid: str, data: dict[str, Any]) -> dict[str, Any]:
        n = next(ids)
        turn_id, session_id = f"t_{n:016x}", f"s_{n:016x}"
        rooms[turn_id] = f"session:{session_id}"
        await sio.enter_room(sid, rooms[turn_id], namespace=IDE)
        order = {"turnId": turn_id, "sessionId": session_id, "prompt": data["prompt"]}
        runs_on[turn_id] = drones[n % len(drones)]
        await sio.call("workOrder", {**order, "history": []}, to=runs_on[turn_id], namespace=DRONE)
        return {"ok": True, "turnId": turn_id, "sessionId": session_id}

    @sio.on("abortWorkOrder", namespace=IDE)  # type: ignore[untyped-decorator]
    async def abort(sid: str, data: dict[str, Any]) -> tuple[bool, str]:
        answer = await sio.call(
            "abortWorkOrder",
            {"turnId": data["turnId"]},
            to=runs_on[data["turnId"]],
            namespace=DRONE,
        )
        return answer[0], answer[1]

    @sio.on("workOrderProgress", namespace=DRONE)  # type: ignore[untyped-decorator]
    async def progress(sid: str, data: dict[str, Any]) -> dict[str, Any]:
        room = rooms[data["turnId"]]
        data["sessionId"] = room.removeprefix("session:")
        await sio.emit("workOrderProgress", data, room=room, namespace=IDE)
        return {"ok": True}

    @sio.on("workOrderComplete", namespace=DRONE)  # type: ignore[untyped-decorator]
    async def complete(
        sid: str, turn_id: str, success: bool, message: str, *ending: Any
    ) -> dict[str, Any]:
        room = rooms.pop(turn_id)
        runs_on.pop(turn_id, None)
        await sio.emit("workOrderComplete", (turn_id, success, message), room=room, namespace=IDE)
        return {"ok": True}

    return app


async def serve() -> None:
    runner = web.AppRunner(build(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"Forwarder listening on http://127.0.0.1:{port}/", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        runtime.run(serve())
