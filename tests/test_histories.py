"""A session's history goes to a drone once: later work orders carry only what it lacks, and a
drone that lost it gets all of it again."""

from __future__ import annotations

import asyncio
from typing import Any

import socketio

from hangar.shared.protocol import DRONE_NAMESPACE, HISTORY_MISS
from tests.conftest import Browser, RelayHandle, drone_hello, eventually


class RecordingDrone:
    """A drone driven by hand that keeps histories: it records each order, answers as told, and
    completes each turn with one assistant message."""

    def __init__(self) -> None:
        self.sio = socketio.AsyncClient(reconnection=False)
        self.orders: list[dict[str, Any]] = []
        self.miss_next = False
        self.sio.on("workOrder", self.on_work_order, namespace=DRONE_NAMESPACE)

    async def connect(self, url: str) -> None:
        auth = {**drone_hello("keeper-1"), "historyCache": True}
        await self.sio.connect(
            url, namespaces=[DRONE_NAMESPACE], transports=["websocket"], auth=auth
        )

    async def on_work_order(self, order: dict[str, Any]) -> dict[str, Any]:
        self.orders.append(order)
        if self.miss_next and order.get("historyBase"):
            self.miss_next = False
            return {"ok": False, "error": HISTORY_MISS}
        asyncio.get_running_loop().create_task(self.answer(order))
        return {"ok": True}

    async def answer(self, order: dict[str, Any]) -> None:
        turn_id = order["turnId"]
        reply = {"role": "assistant", "content": f"answer to {order['prompt']}"}
        message = {"kind": "message", "turnId": turn_id, "message": reply, "number": 0}
        await self.sio.call("workOrderProgress", message, namespace=DRONE_NAMESPACE, timeout=5)
        ending = {"reason": "finished"}
        await self.sio.call(
            "workOrderComplete",
            (turn_id, True, "done", ending),
            namespace=DRONE_NAMESPACE,
            timeout=5,
        )


def contents(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages]


async def test_a_sessions_history_goes_once_then_only_what_the_drone_lacks(
    relay: RelayHandle, browser: Browser
) -> None:
    drone = RecordingDrone()
    await drone.connect(relay.url)
    try:
        await eventually(lambda: relay.relay.directory.local, what="the drone")
        first = await browser.submit("one")
        await browser.completion(first["turnId"])
        for prompt in ("two", "three"):
            ack = await browser.submit(prompt, sessionId=first["sessionId"])
            await browser.completion(ack["turnId"])

        one, two, three = drone.orders
        assert (one.get("historyBase"), one.get("historyFrom", 0), one["history"]) == (None, 0, [])
        # Each later order: the turns since the drone's last order of this session, no more.
        assert (two["historyBase"], two["historyFrom"]) == (one["turnId"], 0)
        assert contents(two["history"]) == ["one", "answer to one"]
        assert (three["historyBase"], three["historyFrom"]) == (two["turnId"], 2)
        assert contents(three["history"]) == ["two", "answer to two"]

        # A drone that lost the history (it restarted) says so and gets all of it.
        drone.miss_next = True
        ack = await browser.submit("four", sessionId=first["sessionId"])
        await browser.completion(ack["turnId"])
        missed, full = drone.orders[3:]
        assert missed["historyBase"] == three["turnId"]
        assert full.get("historyBase") is None
        assert contents(full["history"]) == [
            "one", "answer to one", "two", "answer to two", "three", "answer to three"
        ]  # fmt: skip
    finally:
        await drone.sio.disconnect()
