"""What a client sends over HTTP that the relay cannot use (a file name too long for the file
system, a body said to be compressed that is not, a broken chunk) is refused with a 4xx and a
short message, never a 500, and no ERROR line or traceback reaches the relay's log."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest
import socketio

from hangar.server.access import BAD_FORM
from hangar.server.app import RelayConfig
from hangar.shared.protocol import IDE_NAMESPACE
from tests.conftest import DRONE_TOKEN, RelayHandle, relay_folder, relay_on

FORM = {"Content-Type": "application/x-www-form-urlencoded"}
PLAIN_FORM = b"username=ada&password=not-compressed-at-all"
BROKEN_CHUNK = b"zz\r\nabc\r\n0\r\n\r\n"  # "zz" is no chunk size


def wire(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    """An HTTP/1.1 request as it goes on the wire, asking the relay to close the connection
    once it has answered; a body without ``Transfer-Encoding`` is sent with its length."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body and "Transfer-Encoding" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join([*lines, "", ""]).encode() + body


async def exchange(url: str, *parts: bytes) -> tuple[int, str]:
    """Send ``parts`` on a connection of their own, each once the one before has gone out, and
    read the answer up to the relay's close: whatever the relay logs of the request is logged
    by then (aiohttp goes on with a request after answering it)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def assert_no_failure_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The log holds no ERROR line and no traceback: a client's input is not the relay's
    failure."""
    failures = [
        f"{record.levelname} {record.name}: {record.getMessage()}"
        for record in caplog.records
        if record.levelno >= logging.ERROR or record.exc_info
    ]
    assert failures == []
    assert "Traceback" not in caplog.text


# ---- page files


@pytest.mark.parametrize("folder", ["", "vendor/"], ids=["the page's folder", "vendor"])
async def test_a_page_file_named_past_the_file_systems_limit_is_not_found(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture, folder: str
) -> None:
    """A name of 300 characters failed the look for a link (``ENAMETOOLONG``): 500 and a
    traceback, where any other missing file is 404."""
    caplog.set_level(logging.DEBUG)
    status, _ = await exchange(relay.url, wire("GET", f"/static/{folder}{'x' * 300}.js", {}))
    assert status == 404
    status, _ = await exchange(relay.url, wire("GET", f"/static/{folder}no-such-file.js", {}))
    assert status == 404
    assert_no_failure_logged(caplog)


# ---- the login form


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_a_login_form_said_to_be_compressed_that_is_not_is_refused_without_a_traceback(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture, encoding: str
) -> None:
    """gzip and deflate were answered 500; an encoding the relay does not decode at all was
    answered 400, each with a traceback in the log."""
    caplog.set_level(logging.DEBUG)
    await relay.relay.accounts.add_user("ada", "not-compressed-at-all")  # as the form says
    headers = {**FORM, "Content-Encoding": encoding}
    status, text = await exchange(relay.url, wire("POST", "/login", headers, PLAIN_FORM))
    assert status == 400
    # The login page says so; or aiohttp does, for an encoding it cannot decode at all.
    assert BAD_FORM in text or "Can not decode content-encoding" in text, text[:200]
    assert_no_failure_logged(caplog)


@pytest.mark.parametrize("apart", [False, True], ids=["at once", "after the head"])
async def test_a_login_form_with_a_broken_chunk_is_refused_without_a_traceback(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture, apart: bool
) -> None:
    """A chunk whose size is not a number, with the request's head or after it (the form
    being read): 400, and no traceback."""
    caplog.set_level(logging.DEBUG)
    head = wire("POST", "/login", {**FORM, "Transfer-Encoding": "chunked"})
    first = b"5\r\nusern\r\n"
    parts = (head + first, BROKEN_CHUNK) if apart else (head + first + BROKEN_CHUNK,)
    status, _ = await exchange(relay.url, *parts)
    assert status == 400
    assert_no_failure_logged(caplog)


# ---- long-polling


async def test_a_long_polling_body_said_to_be_compressed_is_refused_and_ends_its_connection_only(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture
) -> None:
    """It was answered 200, and engine.io logged an ERROR with a traceback."""
    caplog.set_level(logging.DEBUG)
    other = socketio.AsyncClient(reconnection=False)
    await other.connect(
        relay.url,
        namespaces=[IDE_NAMESPACE],
        auth={"token": await relay.people.token()},
        transports=["polling"],
    )
    try:
        polling = f"{relay.url}/socket.io/?EIO=4&transport=polling"
        async with aiohttp.ClientSession() as http:
            async with http.get(polling) as opened:
                sid = json.loads((await opened.text())[1:])["sid"]
            headers = {"Content-Type": "text/plain", "Content-Encoding": "gzip"}
            post = wire("POST", f"/socket.io/?EIO=4&transport=polling&sid={sid}", headers, b"40")
            status, _ = await exchange(relay.url, post)
            assert status == 400
            async with http.get(f"{polling}&sid={sid}") as closed:
                assert closed.status == 400  # that connection is over
        answer = await other.call("listSessions", {}, namespace=IDE_NAMESPACE, timeout=5)
        assert answer["ok"] is True and answer["sessions"] == []
    finally:
        await other.eio.disconnect(abort=True)
    assert_no_failure_logged(caplog)


# ---- the relay's other routes


def demo_config(tmp_path: Path) -> RelayConfig:
    """A relay that serves the demo model."""
    database = str(relay_folder(tmp_path) / "hangar.db")
    return RelayConfig(port=0, database=database, drone_token=DRONE_TOKEN, demo_model=True)


async def test_the_demo_model_refuses_a_body_said_to_be_compressed_that_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo model reads a JSON body: it was answered 500, with a traceback."""
    caplog.set_level(logging.DEBUG)
    body = json.dumps({"model": "hangar-demo", "messages": [{"role": "user", "content": "hi"}]})
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with relay_on(demo_config(tmp_path)) as relay:
        completions = wire("POST", "/demo/v1/chat/completions", headers, body.encode())
        status, text = await exchange(relay.url, completions)
        assert status == 400
        assert "could not be read" in text, text[:200]
    assert_no_failure_logged(caplog)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"messages": "hi"}', b'{"messages": [], "stream": true}'],
    ids=["not JSON", "not an object", "messages not a list", "no messages"],
)
async def test_the_demo_model_refuses_a_request_it_cannot_answer_as_openai_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: bytes
) -> None:
    """A body that is no chat completion request was answered 500, with a traceback."""
    caplog.set_level(logging.DEBUG)
    async with relay_on(demo_config(tmp_path)) as relay:
        request = wire(
            "POST", "/demo/v1/chat/completions", {"Content-Type": "application/json"}, body
        )
        status, text = await exchange(relay.url, request)
    assert status == 400
    assert json.loads(text)["error"]["type"] == "invalid_request_error"
    assert_no_failure_logged(caplog)


async def test_a_route_that_reads_no_body_answers_though_its_body_does_not_decode(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp reads what is left of a body once a route has answered: one that does not
    decode was logged as an ERROR, with a traceback."""
    caplog.set_level(logging.DEBUG)
    headers = {"Content-Type": "text/plain", "Content-Encoding": "gzip"}
    status, text = await exchange(relay.url, wire("GET", "/healthz", headers, b"plain"))
    assert status == 200 and json.loads(text)["ok"] is True
    status, _ = await exchange(relay.url, wire("POST", "/logout", headers, b"plain"))
    assert status == 303
    assert_no_failure_logged(caplog)
