"""Bad packets straight on the wire (a raw websocket speaking engine.io's framing by hand): each
gets an error ack or is dropped, never a traceback; a connection sending many is dropped; a
client cannot pass its events off as a connection's start or end."""

from __future__ import annotations

import asyncio
import json
import logging
import socket as socket_module
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from bench.peers import OpenAIPeer, Reply
from hangar.server.transport import (
    BINARY_REFUSED,
    MALFORMED,
    MAX_MALFORMED,
    NOT_IN,
    RESERVED_NAME,
)
from tests.conftest import Browser, RelayHandle, Upstream, drone_hello, eventually

DEEP = "[" * 100_000 + "]" * 100_000


class RawSocket:
    """An engine.io websocket: sends socket.io packets as text frames, collects what comes."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.received: list[str] = []
        self.closed = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for message in self.socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            if message.data == "2":  # engine.io ping
                await self.socket.send_str("3")
            else:
                self.received.append(message.data)
        self.closed.set()

    async def send(self, socket_io_packet: str) -> None:
        await self.socket.send_str("4" + socket_io_packet)  # "4": an engine.io message

    async def ack(self, namespace: str, ack_id: int) -> Any:
        prefix = f"43{namespace},{ack_id}"
        found = await eventually(
            lambda: [m for m in self.received if m.startswith(prefix)], what=f"ack {ack_id}"
        )
        return json.loads(found[0][len(prefix) :])


@pytest.fixture
async def raw(relay: RelayHandle) -> AsyncIterator[Callable[..., Any]]:
    sessions: list[aiohttp.ClientSession] = []

    async def open_socket(connect: str | None = None) -> RawSocket:
        http = aiohttp.ClientSession()
        sessions.append(http)
        url = relay.url.replace("http", "ws") + "/socket.io/?EIO=4&transport=websocket"
        raw_socket = RawSocket(await http.ws_connect(url))
        await eventually(lambda: raw_socket.received, what="the engine.io handshake")
        if connect is not None:
            await raw_socket.send(connect)
            await eventually(
                lambda: any(m.startswith("4" + connect[:6]) for m in raw_socket.received[1:]),
                what="the namespace's answer",
            )
        return raw_socket

    yield open_socket
    for http in sessions:
        await http.close()


@pytest.mark.parametrize(
    "body",
    ["[123,{}]", "not json", "[]", "{}", "[" + "9" * 4400 + "]", DEEP],
    ids=["name-not-a-string", "not-json", "empty", "object", "huge-integer", "deep"],
)
async def test_a_malformed_event_gets_an_error_ack_and_no_traceback(
    relay: RelayHandle, raw: Callable[..., Any], caplog: pytest.LogCaptureFixture, body: str
) -> None:
    caplog.set_level(logging.DEBUG)
    token = await relay.people.token()
    socket: RawSocket = await raw(f'0/ide,{{"token":"{token}"}}')

    await socket.send(f"2/ide,7{body}")

    assert await socket.ack("/ide", 7) == [{"ok": False, "error": MALFORMED}]
    await socket.send('2/ide,8["listSessions",{}]')
    assert await socket.ack("/ide", 8) == [{"ok": True, "sessions": []}]
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        "[123,{}]",
        "not json",
        DEEP,
        '["workOrderProgress",123]',
        '["workOrderProgress",{"turnId":"t_x","kind":"text","text":5}]',
        '["workOrderProgress",{"turnId":"t_x","kind":"text","text":"a"},{"extra":1}]',
        '["workOrderComplete","t_x"]',
        '["workOrderComplete",1,2,3]',
        '["workOrderComplete","t_x",true,"done",{"reason":"nonsense"}]',
    ],
    ids=[
        "name-not-a-string",
        "not-json",
        "deep",
        "progress-not-an-object",
        "progress-text-not-a-string",
        "progress-two-payloads",
        "complete-too-few",
        "complete-wrong-types",
        "complete-bad-ending",
    ],
)
async def test_a_drones_malformed_report_gets_an_error_ack_and_no_traceback(
    relay: RelayHandle, raw: Callable[..., Any], caplog: pytest.LogCaptureFixture, body: str
) -> None:
    """A drone's reports are read in the connection's reader (docs/performance.md): a bad one
    is refused there, and the drone's connection goes on."""
    caplog.set_level(logging.DEBUG)
    drone: RawSocket = await raw(f"0/drone,{json.dumps(drone_hello('sloppy-1'))}")

    await drone.send(f"2/drone,7{body}")

    answer = await drone.ack("/drone", 7)
    assert isinstance(answer, list) and answer[0]["ok"] is False and answer[0]["error"], answer
    assert "retry" not in answer[0]  # refused for good: sending it again would not help
    await drone.send('2/drone,8["workOrderComplete","t_unknown",true,"done"]')
    assert (await drone.ack("/drone", 8))[0]["ok"] is False  # answered: still connected
    assert "sloppy-1" in relay.relay.directory.local
    assert "Traceback" not in caplog.text


async def test_a_drones_answer_of_no_value_is_a_refusal_not_a_traceback(
    relay: RelayHandle,
    raw: Callable[..., Any],
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A drone answering its work order with an ack that carries nothing (``43/drone,1``, as
    some socket.io clients send an answer of no arguments): python-socketio called the relay's
    callback with ``*None``, logged a traceback, and the turn waited out the drone's time."""
    caplog.set_level(logging.DEBUG)
    drone: RawSocket = await raw(f"0/drone,{json.dumps(drone_hello('terse-1'))}")
    turn_id = (await browser.submit("Answer with nothing"))["turnId"]
    orders = await eventually(
        lambda: [m for m in drone.received if m.startswith("42/drone,")], what="the work order"
    )
    ack_id = orders[0].removeprefix("42/drone,").partition("[")[0]

    await drone.send(f"3/drone,{ack_id}")

    ended = (turn_id, False, "The drone refused the work order.")
    assert await browser.completion(turn_id, timeout=5) == ended
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("body", ["\x1e\x1e", "\x1e", "9zz", '42/ide,4["listSessions",{}]\x1ex'])
async def test_a_long_polling_post_that_is_not_engine_io_ends_its_connection_quietly(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture, body: str
) -> None:
    """Bodies engine.io cannot read made it log "post request handler error" with a traceback
    (an empty packet, a packet type that is no number) and keep the connection."""
    caplog.set_level(logging.DEBUG)
    url = relay.url + "/socket.io/?EIO=4&transport=polling"
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as opened:
            sid = json.loads((await opened.text())[1:])["sid"]
        async with http.post(f"{url}&sid={sid}", data=body.encode()) as posted:
            assert posted.status == 200  # taken as the client closing its connection
        async with http.get(f"{url}&sid={sid}") as after:
            assert after.status == 400  # the connection is gone
    assert "Traceback" not in caplog.text and "handler error" not in caplog.text


async def test_an_event_to_a_namespace_the_client_is_not_in_gets_an_error_ack(
    raw: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """python-socketio drops an event for a namespace its client has not connected to (or has
    left): the client waited out its own timeout for an answer that never came."""
    caplog.set_level(logging.DEBUG)
    drone: RawSocket = await raw(f"0/drone,{json.dumps(drone_hello('lost-1'))}")
    for ack_id, namespace in ((11, "/ide"), (12, "/nope")):
        await drone.send(f'2{namespace},{ack_id}["listSessions",{{}}]')
        answer = await drone.ack(namespace, ack_id)
        assert answer == [{"ok": False, "error": NOT_IN}], namespace
    await drone.send('2/drone,14["workOrderComplete","t_unknown",true,"done"]')
    assert (await drone.ack("/drone", 14))[0]["ok"] is False  # its own namespace still answers
    assert "Traceback" not in caplog.text


async def test_many_bad_packets_drop_the_connection_and_log_a_few_lines(
    relay: RelayHandle, raw: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    socket: RawSocket = await raw()  # not even connected to a namespace

    for index in range(MAX_MALFORMED * 5):
        if socket.closed.is_set():
            break
        await socket.send(f"2/ide,{index}[{index},{{}}]")
    await asyncio.wait_for(socket.closed.wait(), 5)

    assert "Traceback" not in caplog.text
    assert len([r for r in caplog.records if r.name.startswith("hangar")]) <= 3
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 0


@pytest.mark.parametrize(
    "frame",
    ["", "9hello", "b!!not base64", "hello"],
    ids=["empty", "unknown-type", "bad-base64", "not-a-type"],
)
async def test_a_frame_that_is_not_engine_io_ends_the_connection_and_logs_nothing(
    relay: RelayHandle,
    raw: Callable[..., Any],
    browser: Browser,
    caplog: pytest.LogCaptureFixture,
    frame: str,
) -> None:
    """The relay reads its websockets itself (docs/performance.md, section 3): a frame that is
    no engine.io packet ends that connection, with no traceback and no warning (engine.io's own
    reader logs an unknown packet type's failure with ``logger.exception``), and the relay
    serves everyone else."""
    caplog.set_level(logging.DEBUG)
    socket: RawSocket = await raw()

    await socket.socket.send_str(frame)

    await asyncio.wait_for(socket.closed.wait(), 5)
    assert "Traceback" not in caplog.text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (await browser.call("listSessions", {}))["ok"] is True


async def test_a_client_cannot_send_lifecycle_events(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
    raw: Callable[..., Any],
) -> None:
    openai_peer.script(Reply(chunks=[f"w{i} " for i in range(100)], delay=0.03))
    await start_drone(Upstream("openai", openai_peer))
    ack = await browser.submit("Keep going")
    await browser.wait_text(ack["turnId"], pieces=1)
    hello = json.dumps(drone_hello("ghost-1"))
    drone: RawSocket = await raw(f"0/drone,{hello}")
    assert "ghost-1" in relay.relay.directory.local

    await drone.send('2/drone,1["disconnect"]')
    await drone.send('2/drone,2["connect",{"droneId":"ghost-2"}]')

    assert await drone.ack("/drone", 1) == [{"ok": False, "error": RESERVED_NAME}]
    assert await drone.ack("/drone", 2) == [{"ok": False, "error": RESERVED_NAME}]
    assert "ghost-1" in relay.relay.directory.local  # still connected, not "gone"
    assert "ghost-2" not in relay.relay.directory.local
    assert (await browser.completion(ack["turnId"], timeout=10))[1] is True


async def test_an_event_with_a_binary_attachment_gets_an_error_ack_and_no_traceback(
    relay: RelayHandle, raw: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Hangar's events are JSON: one with a binary attachment is answered at once that it is
    not accepted (the client does not wait out its own timeout), and the connection goes on."""
    caplog.set_level(logging.DEBUG)
    token = await relay.people.token()
    socket: RawSocket = await raw(f'0/ide,{{"token":"{token}"}}')

    await socket.send('51-/ide,7["submitWorkOrder",{"_placeholder":true,"num":0}]')
    await socket.socket.send_bytes(b"\x00\x01")  # its attachment

    assert await socket.ack("/ide", 7) == [{"ok": False, "error": BINARY_REFUSED}]
    await socket.send('2/ide,8["listSessions",{}]')
    assert await socket.ack("/ide", 8) == [{"ok": True, "sessions": []}]
    assert "Traceback" not in caplog.text


async def test_a_websocket_whose_client_left_before_the_upgrade_leaves_no_traceback(
    relay: RelayHandle, browser: Browser, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients that gave up on a relay too slow to answer (frozen a while, say) have asked for a
    websocket and reset their connection: the relay drops each quietly, and serves on."""
    caplog.set_level(logging.DEBUG)
    port = int(relay.url.rsplit(":", 1)[1])
    upgrade = (
        "GET /socket.io/?EIO=4&transport=websocket HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    for _ in range(10):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(upgrade)
        await writer.drain()
        linger = writer.get_extra_info("socket")
        linger.setsockopt(
            socket_module.SOL_SOCKET, socket_module.SO_LINGER, struct.pack("ii", 1, 0)
        )
        writer.close()  # a reset, before the relay answers

    await eventually(  # the relay got to answer one: all of them have been handled by then
        lambda: "a websocket's client left before it opened" in caplog.text, what="a drop"
    )
    await eventually(lambda: len(relay.relay.sio.eio.sockets) == 1, what="only the browser's")
    assert "Traceback" not in caplog.text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert (await browser.call("listSessions", {}))["ok"] is True
