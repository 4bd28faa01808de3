"""A drone the test drives by hand over a real socket.io connection to the relay's ``/drone``
namespace: it takes work orders, sends exactly the progress and endings the test asks for, and
answers an abort only when the test lets it (a drone slow to answer)."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Self

import socketio

from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORT_WORK_ORDER,
    DRONE_NAMESPACE,
    WORK_ORDER,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
)
from tests.conftest import drone_hello

ANSWER_TIMEOUT = 10.0


class HandDrone:
    """One drone connection; ``answer_aborts`` is set when aborts may be answered, with
    ``abort_answer``."""

    def __init__(
        self,
        url: str,
        drone_id: str = "hand-1",
        model: str = "m",
        abort_answer: Any = (True, ABORT_SIGNALED),
    ) -> None:
        """``abort_answer``: what it answers an abort with (any value: a drone with a bug)."""
        self.url = url
        self.abort_answer = abort_answer
        self.drone_id = drone_id
        self.model = model
        self.client = socketio.AsyncClient(reconnection=False)
        self.orders: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.aborts: list[dict[str, Any]] = []
        self.abort_asked = asyncio.Event()
        self.answer_aborts = asyncio.Event()
        self.answer_aborts.set()
        self.client.on(WORK_ORDER, self._order, namespace=DRONE_NAMESPACE)
        self.client.on(ABORT_WORK_ORDER, self._abort, namespace=DRONE_NAMESPACE)

    async def __aenter__(self) -> Self:
        await self.client.connect(
            self.url,
            namespaces=[DRONE_NAMESPACE],
            auth={**drone_hello(self.drone_id), "model": self.model},
            transports=["websocket"],
        )
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.answer_aborts.set()
        if self.client.connected:
            await self.client.disconnect()

    async def _order(self, data: dict[str, Any]) -> dict[str, Any]:
        await self.orders.put(data)
        return {"ok": True}

    async def _abort(self, data: dict[str, Any]) -> Any:
        self.aborts.append(data)
        self.abort_asked.set()
        await self.answer_aborts.wait()
        return self.abort_answer

    async def next_order(self) -> str:
        """The turn id of the next work order the relay sends."""
        order = await asyncio.wait_for(self.orders.get(), ANSWER_TIMEOUT)
        turn_id: str = order["turnId"]
        return turn_id

    async def _progress(self, payload: dict[str, Any]) -> None:
        ack = await self.client.call(
            WORK_ORDER_PROGRESS, payload, namespace=DRONE_NAMESPACE, timeout=ANSWER_TIMEOUT
        )
        assert not isinstance(ack, dict) or ack.get("ok", True), ack

    async def text(self, turn_id: str, text: str, depth: int = 0) -> None:
        await self._progress({"kind": "text", "turnId": turn_id, "text": text, "depth": depth})

    async def tool(
        self,
        turn_id: str,
        call_id: str,
        state: str,
        name: str = "read_file",
        arguments: str | None = None,
        result: str | None = None,
        depth: int = 0,
    ) -> None:
        payload: dict[str, Any] = {
            "kind": "tool",
            "turnId": turn_id,
            "callId": call_id,
            "name": name,
            "state": state,
            "depth": depth,
        }
        if arguments is not None:
            payload["arguments"] = arguments
        if result is not None:
            payload["result"] = result
        await self._progress(payload)

    async def message(self, turn_id: str, number: int, message: dict[str, Any]) -> None:
        """A finished message of the turn's own conversation, for the relay to store."""
        await self._progress(
            {"kind": "message", "turnId": turn_id, "number": number, "message": message}
        )

    async def complete(
        self, turn_id: str, success: bool, message: str, ending: dict[str, Any] | None = None
    ) -> None:
        ack = await self.client.call(
            WORK_ORDER_COMPLETE,
            (turn_id, success, message, *([ending] if ending else [])),
            namespace=DRONE_NAMESPACE,
            timeout=ANSWER_TIMEOUT,
        )
        assert not isinstance(ack, dict) or ack.get("ok", True), ack
