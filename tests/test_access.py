"""Who may use a relay (``docs/architecture.md``, "Access"): people who logged in, and scripts
with their API token, from the relay's own origins only; members see their own work, admins
everyone's; drones by their own tokens, bound to their identity."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import socketio

from bench.peers import OpenAIPeer, Reply
from hangar.server.access import (
    BAD_FORM,
    BAD_LOGIN,
    LOGIN_COOKIE,
    TOO_MANY_LOGINS,
    follow_revocations,
)
from hangar.server.accounts import (
    FAILURE_WINDOW,
    MAX_ADDRESS_FAILURES,
    MAX_USER_FAILURES,
    Accounts,
    Revocation,
)
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.drones import INVALID_TOKEN, OWN_TOKEN, TOKEN_REVOKED
from hangar.server.reports import PERSON_REMOVED
from hangar.server.sqlite_store import SqliteTurnStore
from hangar.server.store import TurnRecord
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ALREADY_CONNECTED,
    DRONE_NAMESPACE,
    IDE_NAMESPACE,
    NOT_LOGGED_IN,
    UNKNOWN_TURN,
)
from tests.browser.hand_drone import HandDrone
from tests.conftest import (
    DRONE_TOKEN,
    Browser,
    RelayHandle,
    Upstream,
    drone_hello,
    eventually,
    relay_folder,
    relay_on,
)

SLOW = Reply(chunks=[f"w{i} " for i in range(400)], delay=0.03)
PASSWORD = "correct horse battery staple"


class Login:
    """A person's web session: aiohttp with a cookie jar, as a browser keeps cookies."""

    def __init__(self, url: str, forwarded_for: str | None = None) -> None:
        self.url = url
        self.http = aiohttp.ClientSession(
            # unsafe: keep cookies of an IP address host (127.0.0.1) as a browser does
            cookie_jar=aiohttp.CookieJar(unsafe=True),
            headers={"X-Forwarded-For": forwarded_for} if forwarded_for else None,
        )

    async def post(self, path: str, **form: str) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.http.post(self.url + path, data=form, allow_redirects=False) as response:
            return response.status, await response.text(), response

    async def log_in(self, name: str, password: str) -> tuple[int, str]:
        status, text, _ = await self.post("/login", username=name, password=password)
        return status, text

    @property
    def cookie(self) -> str:
        for cookie in self.http.cookie_jar:
            if cookie.key == LOGIN_COOKIE:
                return cookie.value
        raise AssertionError("not logged in")

    async def close(self) -> None:
        await self.http.close()


@pytest.fixture
async def logins(relay: RelayHandle) -> Any:
    opened: list[Login] = []

    def open_login(url: str | None = None) -> Login:
        login = Login(url or relay.url)
        opened.append(login)
        return login

    yield open_login
    for login in opened:
        await login.close()


async def refusal_of(url: str, namespace: str = IDE_NAMESPACE, **connect: Any) -> Any:
    """What a socket.io client is told when its connection is refused."""
    client = socketio.AsyncClient(reconnection=False)
    errors: list[Any] = []
    client.on("connect_error", errors.append, namespace=namespace)
    with pytest.raises(socketio.exceptions.ConnectionError):
        await client.connect(url, namespaces=[namespace], wait_timeout=5, **connect)
    await client.disconnect()
    return errors[0] if errors else None


# ---- logging in


async def test_a_connection_without_a_login_is_refused_with_a_reason(relay: RelayHandle) -> None:
    connects: tuple[dict[str, Any], ...] = (
        {},
        {"auth": {"token": "hgt_madeup"}},
        {"headers": {"Cookie": f"{LOGIN_COOKIE}=not-a-login"}},
    )
    for connect in connects:
        refused = await refusal_of(relay.url, transports=["websocket"], **connect)
        assert refused == {"message": NOT_LOGGED_IN}, connect

    async with aiohttp.ClientSession() as http, http.get(relay.url, allow_redirects=False) as page:
        assert page.status == 303 and page.headers["Location"] == "/login"


async def test_a_token_or_cookie_that_is_no_text_is_refused_as_any_wrong_one(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture
) -> None:
    """A token holding half a surrogate pair failed to encode before it was checked: a page was
    told the relay's database or Redis did not answer (to try again, for ever) and a drone the
    same; a login cookie of bytes that are not UTF-8 made ``GET /`` answer 500 with a
    traceback."""
    caplog.set_level(logging.INFO)
    laptop = await relay.relay.accounts.create_drone_token("laptop")
    refused = await refusal_of(relay.url, transports=["websocket"], auth={"token": "hgt_\ud800a"})
    assert refused == {"message": NOT_LOGGED_IN}
    for token in ("\ud800" * 20, laptop[:-3] + "\ud800"):
        hello = {**drone_hello("laptop"), "token": token}
        refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=hello, transports=["websocket"])
        assert refused == {"message": INVALID_TOKEN}, token

    host, port = relay.url.removeprefix("http://").split(":")
    for request in (b"GET / HTTP/1.1", b"GET /login HTTP/1.1", b"POST /logout HTTP/1.1"):
        reader, writer = await asyncio.open_connection(host, int(port))
        cookie = LOGIN_COOKIE.encode() + b"=\xff\xfe\xfd"
        writer.write(request + b"\r\nHost: x\r\nCookie: " + cookie + b"\r\n")
        writer.write(b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        status = (await asyncio.wait_for(reader.readline(), 5)).split()[1]
        writer.close()
        assert status in (b"200", b"303"), (request, status)
    assert "Traceback" not in caplog.text and "does not answer" not in caplog.text


async def test_static_serves_the_pages_files_and_nothing_else_of_its_folder(
    relay: RelayHandle,
) -> None:
    """What ``/static/`` serves is what the installed package ships (the page's modules, styles
    and vendored libraries), also from a checkout whose ``web/`` holds npm's tree and more."""
    served = ("/static/app.js", "/static/style.css", "/static/vendor/marked.esm.js")
    hidden = (
        "/static/package.json",
        "/static/package-lock.json",
        "/static/vendor.txt",
        "/static/__init__.py",
        "/static/node_modules/marked/package.json",
        "/static/node_modules/.package-lock.json",
        "/static/vendor/.copied",
        "/static/%2e%2e/pyproject.toml",
        "/static/node_modules%2Fmarked%2Flib%2Fmarked.esm.js",
        "/static/vendor/..%2F..%2Fweb%2Fapp.js",
        "/static/",
    )
    async with aiohttp.ClientSession() as http:
        for path in served:
            async with http.get(relay.url + path) as response:
                assert response.status == 200, path
                assert response.headers["X-Content-Type-Options"] == "nosniff"
        for path in hidden:
            async with http.get(relay.url + path) as response:
                assert response.status == 404, path


async def test_only_the_ide_and_drone_namespaces_accept_connections(relay: RelayHandle) -> None:
    token = await relay.people.token()
    for namespace in ("/", "/admin"):
        client = socketio.AsyncClient(reconnection=False)
        with pytest.raises(socketio.exceptions.ConnectionError):
            await client.connect(
                relay.url,
                namespaces=[namespace],
                auth={"token": token},
                transports=["websocket"],
                wait_timeout=5,
            )
        assert not client.connected
        await client.disconnect()


async def test_a_login_sets_an_http_only_cookie_that_opens_the_page_and_the_socket(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    login = logins()

    status, _, response = await login.post("/login", username="ada", password=PASSWORD)

    assert status == 303 and response.headers["Location"] == "/"
    cookie = response.cookies[LOGIN_COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Lax" and cookie["path"] == "/"
    assert int(cookie["max-age"]) == 14 * 24 * 3600 and not cookie["secure"]
    async with login.http.get(relay.url + "/") as page:
        assert page.status == 200 and "<title>Hangar</title>" in await page.text()
    browser = await Browser(relay.url, login=login.cookie).connect()
    try:
        hello = await eventually(
            lambda: next((args for e, args in browser.events if e == "hello"), None),
            what="the hello",
        )
        assert hello == {"user": {"name": "ada", "role": "member"}, "demo": False}
    finally:
        await browser.close()


async def test_the_cookie_is_secure_behind_an_https_proxy(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            relay.url + "/login",
            data={"username": "ada", "password": PASSWORD},
            headers={"X-Forwarded-Proto": "https"},
            allow_redirects=False,
        ) as response,
    ):
        assert response.status == 303
        assert response.cookies[LOGIN_COOKIE]["secure"]


async def test_a_wrong_password_and_an_unknown_name_get_the_same_answer(
    relay: RelayHandle, logins: Callable[..., Login], caplog: pytest.LogCaptureFixture
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    caplog.set_level(logging.DEBUG)

    wrong = await logins().log_in("ada", "not her password")
    unknown = await logins().log_in("nobody", "not her password")

    # The same page but for the name given, which is kept in the form.
    assert wrong[0] == unknown[0] == 401
    assert wrong[1].replace('value="ada"', 'value="nobody"') == unknown[1]
    assert BAD_LOGIN in wrong[1]
    assert "not her password" not in caplog.text


async def test_repeated_failures_lock_the_name_but_not_other_people(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    await relay.relay.accounts.add_user("bob", PASSWORD)
    login = logins()
    for _ in range(MAX_USER_FAILURES):
        assert (await login.log_in("ada", "guess"))[0] == 401

    locked = await login.log_in("ada", PASSWORD)

    assert locked[0] == 429 and TOO_MANY_LOGINS in locked[1]
    assert (await logins().log_in("bob", PASSWORD))[0] == 303


async def test_a_new_password_lifts_the_lock_on_the_name(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    """Anyone's five guesses locked a person out, again and again, and no command lifted it,
    not even ``hangar user passwd``: the operator now sets a new password to let them in."""
    await relay.relay.accounts.add_user("ada", PASSWORD)
    login = logins()
    for _ in range(MAX_USER_FAILURES):
        assert (await login.log_in("ada", "guess"))[0] == 401
    assert (await login.log_in("ada", PASSWORD))[0] == 429

    await relay.relay.accounts.set_password("ada", "a new password")

    assert (await logins().log_in("ada", "a new password"))[0] == 303


@pytest.mark.parametrize("correct", [False, True], ids=["guesses", "guesses and the password"])
async def test_guesses_sent_at_once_are_counted_before_any_is_checked(
    relay: RelayHandle, logins: Callable[..., Login], correct: bool
) -> None:
    """A burst of guesses does not get past the lock by all arriving before the first failure
    is counted: no more than the limit are checked, the password among them or not."""
    await relay.relay.accounts.add_user("ada", PASSWORD)
    guesses = [f"guess-{index}" for index in range(3 * MAX_USER_FAILURES)]
    if correct:
        guesses.append(PASSWORD)

    answers = await asyncio.gather(*(logins().log_in("ada", guess) for guess in guesses))

    statuses = [status for status, _ in answers]
    assert set(statuses) <= {401, 429, 303}
    assert statuses.count(401) + statuses.count(303) <= MAX_USER_FAILURES, statuses
    assert statuses.count(429) >= len(guesses) - MAX_USER_FAILURES
    assert (await logins().log_in("ada", PASSWORD))[0] == 429


async def test_failures_for_a_name_do_not_lock_a_person_whose_name_differs_in_case(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    """Names are told apart by case at login ("ALICE" and "alice" may be two people in a
    database made before a new name was refused for differing only in case), and so is the
    lock."""
    accounts = relay.relay.accounts
    await accounts.add_user("ALICE", PASSWORD)
    await accounts.add_user("alice-then", "alice's own password")
    await accounts.db.execute("UPDATE users SET name = 'alice' WHERE name = 'alice-then'")
    for _ in range(MAX_USER_FAILURES):
        assert (await logins().log_in("ALICE", "guess"))[0] == 401

    assert (await logins().log_in("ALICE", PASSWORD))[0] == 429
    assert (await logins().log_in("alice", "alice's own password"))[0] == 303


async def test_repeated_failures_from_one_address_lock_it(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    login = logins()
    for index in range(MAX_ADDRESS_FAILURES):
        assert (await login.log_in(f"guess-{index}", "guess"))[0] == 401

    assert (await login.log_in("ada", PASSWORD))[0] == 429


async def test_failed_logins_are_kept_within_a_bound_whatever_names_are_sent(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    """Each failed name was kept for ever, 500 kB of it at a time, and still while its address
    was locked out: anyone who reaches the login page could fill the relay's disk."""
    db = relay.relay.store
    await db.execute(  # a failure from long ago
        "INSERT INTO login_failures (failure_key, failures, since) VALUES (?, 1, ?)",
        "user:someone",
        time.time() - FAILURE_WINDOW - 1,
    )
    login = logins()
    for index in range(MAX_ADDRESS_FAILURES):
        assert (await login.log_in(f"{index}-" + "x" * 500_000, "guess"))[0] == 401
    for index in range(5):  # names a person could have, once the address is locked out
        assert (await login.log_in(f"guess-{index}", "guess"))[0] == 429

    kept = await db.fetch("SELECT failure_key, failures FROM login_failures")
    assert [(row["failure_key"], row["failures"]) for row in kept] == [
        ("address:127.0.0.1", MAX_ADDRESS_FAILURES + 5)
    ]


@contextlib.asynccontextmanager
async def relay_trusting(tmp_path: Path, proxies: list[str]) -> AsyncIterator[str]:
    """A relay (its URL) that trusts ``proxies``' X-Forwarded-For, with the person ada."""
    config = RelayConfig(port=0, database=str(tmp_path / "hangar.db"), trusted_proxies=proxies)
    runner, port = await start_relay(config)
    try:
        await runner.app[RELAY].accounts.add_user("ada", PASSWORD)
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_behind_a_proxy_failures_lock_the_visitor_who_made_them_not_everyone(
    tmp_path: Path,
) -> None:
    """A proxy on the relay's machine, trusted, says who each visitor is (with or without the
    port it saw): one visitor's failures lock that visitor, and the others behind the proxy
    still log in."""
    async with relay_trusting(tmp_path, ["127.0.0.1"]) as url:
        guesser = Login(url, forwarded_for="198.51.100.9, 203.0.113.5:40123")
        other = Login(url, forwarded_for="198.51.100.7")
        try:
            for index in range(MAX_ADDRESS_FAILURES):
                assert (await guesser.log_in(f"guess-{index}", "guess"))[0] == 401

            assert (await guesser.log_in("ada", PASSWORD))[0] == 429
            assert (await other.log_in("ada", PASSWORD))[0] == 303
        finally:
            for login in (guesser, other):
                await login.close()


async def test_a_flood_of_wrong_logins_holds_a_persons_login_back_by_little(
    tmp_path: Path,
) -> None:
    """Each password check is an argon2 hash, ~0.1 s of a core: 200 wrong logins from 10
    addresses, each within its allowance, held a person's right one back 22.8 s, behind the
    whole flood. An address now has one check waiting at most, and a person's login waits for
    one check per address that floods (``login_checks``), not for the flood."""
    async with relay_trusting(tmp_path, ["127.0.0.1"]) as url:
        flooders = [Login(url, forwarded_for=f"198.51.100.{n}") for n in range(4)]
        person = Login(url, forwarded_for="203.0.113.7")
        done: list[str] = []

        async def log_in(login: Login, name: str, password: str, who: str) -> int:
            status = (await login.log_in(name, password))[0]
            done.append(who)
            return status

        try:
            flood = [
                asyncio.ensure_future(log_in(login, f"guess-{n}", "wrong guess", "flood"))
                for login in flooders
                for n in range(8)
            ]
            await eventually(lambda: len(done) >= 1, what="the flood's first answer")
            assert await log_in(person, "ada", PASSWORD, "person") == 303
            assert set(await asyncio.gather(*flood)) == {401}
        finally:
            for login in (*flooders, person):
                await login.close()
    # Its check waited for those already running and one of each flooding address at most.
    assert done.index("person") <= 1 + 2 + len(flooders), done


async def test_failures_from_one_ipv6_block_count_together(tmp_path: Path) -> None:
    """One machine is usually given a /64 of IPv6 addresses: each counted apart, it had 2**64
    allowances of wrong guesses. They count as one address now; another block is not locked."""
    async with relay_trusting(tmp_path, ["127.0.0.1"]) as url:
        guessers = [Login(url, forwarded_for=f"2001:db8:0:1::{n:x}") for n in range(1, 5)]
        other = Login(url, forwarded_for="2001:db8:0:2::1")
        try:
            for index in range(MAX_ADDRESS_FAILURES):
                guesser = guessers[index % len(guessers)]
                assert (await guesser.log_in(f"guess-{index}", "guess"))[0] == 401

            fresh = Login(url, forwarded_for="2001:db8:0:1::99")
            guessers.append(fresh)
            assert (await fresh.log_in("ada", PASSWORD))[0] == 429
            assert (await other.log_in("ada", PASSWORD))[0] == 303
        finally:
            for login in (*guessers, other):
                await login.close()


@pytest.mark.parametrize("trusted", [[], ["10.9.9.9"]], ids=["by default", "another proxy"])
async def test_an_untrusted_peer_cannot_shed_its_lock_by_naming_other_addresses(
    tmp_path: Path, trusted: list[str]
) -> None:
    """X-Forwarded-For counts only from a trusted proxy (none by default): anyone else naming a
    new address each time is still one address, and is locked out as one."""
    async with relay_trusting(tmp_path, trusted) as url:
        opened: list[Login] = []
        try:
            for index in range(MAX_ADDRESS_FAILURES):
                opened.append(Login(url, forwarded_for=f"203.0.113.{index}"))
                assert (await opened[-1].log_in(f"guess-{index}", "guess"))[0] == 401

            opened.append(Login(url, forwarded_for="198.51.100.7"))
            assert (await opened[-1].log_in("ada", PASSWORD))[0] == 429
        finally:
            for login in opened:
                await login.close()


async def test_logging_out_ends_the_login_and_drops_its_connections(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    login = logins()
    await login.log_in("ada", PASSWORD)
    cookie = login.cookie
    browser = await Browser(relay.url, login=cookie).connect()
    try:
        status, _, _ = await login.post("/logout")
        assert status == 303

        await eventually(lambda: not browser.sio.connected, what="the connection to drop")
        assert ("loggedOut", {"reason": NOT_LOGGED_IN}) in browser.events
        refused = await refusal_of(
            relay.url, headers={"Cookie": f"{LOGIN_COOKIE}={cookie}"}, transports=["websocket"]
        )
        assert refused == {"message": NOT_LOGGED_IN}
    finally:
        await browser.close()


async def test_a_login_past_its_fourteen_days_no_longer_opens_the_page_or_a_connection(
    relay: RelayHandle, logins: Callable[..., Login]
) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    login = logins()
    await login.log_in("ada", PASSWORD)
    headers = {"Cookie": f"{LOGIN_COOKIE}={login.cookie}"}
    async with login.http.get(relay.url + "/", allow_redirects=False) as page:
        assert page.status == 200

    await relay.relay.accounts.db.execute("UPDATE logins SET expires_at = ?", time.time() - 1)

    async with login.http.get(relay.url + "/", allow_redirects=False) as page:
        assert page.status == 303 and page.headers["Location"] == "/login"
    refused = await refusal_of(relay.url, headers=headers, transports=["websocket"])
    assert refused == {"message": NOT_LOGGED_IN}


async def test_a_connection_open_when_its_login_expires_is_logged_out(relay: RelayHandle) -> None:
    """As at a logout: the page is told, and the connection dropped."""
    user = await relay.relay.accounts.add_user("ada", PASSWORD)
    expiring = await relay.relay.accounts.log_in(user, seconds=1.0)
    browser = await Browser(relay.url, login=expiring).connect()
    try:
        await eventually(lambda: not browser.sio.connected, what="the connection to drop")
        assert ("loggedOut", {"reason": NOT_LOGGED_IN}) in browser.events
    finally:
        await browser.close()


async def test_a_removed_person_is_disconnected(relay: RelayHandle, browsers: Any) -> None:
    browser: Browser = await browsers("leaving")

    assert await relay.relay.accounts.remove_user("leaving")

    await eventually(lambda: not browser.sio.connected, what="the connection to drop")


async def test_a_removed_persons_running_and_queued_turns_end_and_never_run_after(
    relay: RelayHandle,
    browsers: Any,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
) -> None:
    openai_peer.script(Reply(chunks=[f"w{i} " for i in range(200)], delay=0.05))
    await start_drone(Upstream("openai", openai_peer))  # one turn at a time
    leaving: Browser = await browsers("leaving")
    running = await leaving.submit("Runs when the person is removed")
    await leaving.wait_text(running["turnId"], pieces=2)
    queued = await leaving.submit("Waits behind it", sessionId=running["sessionId"])

    assert await relay.relay.accounts.remove_user("leaving")

    store = relay.relay.store
    for turn_id in (running["turnId"], queued["turnId"]):
        turn = await eventually(partial(_ended, store, turn_id), what="the person's turns to end")
        assert (turn.status, turn.reason) == ("aborted", "removed")
    await eventually(
        lambda: openai_peer.requests[0].disconnected_at is not None, what="the stream closed"
    )
    openai_peer.script(Reply(chunks=["Next person's answer."]))
    other: Browser = await browsers("staying")
    ack = await other.submit("Mine")
    assert (await other.completion(ack["turnId"], timeout=10))[1:] == (
        True,
        "Next person's answer.",
    )
    assert [r.messages[-1]["content"] for r in openai_peer.requests] == [
        "Runs when the person is removed",
        "Mine",
    ]


async def _ended(store: Any, turn_id: str) -> Any:
    turn = await store.get_turn(turn_id, messages=False)
    return turn if turn is not None and turn.status not in ("queued", "processing") else None


async def test_the_demo_logs_in_a_visitor_by_a_loopback_name_only(tmp_path: Path) -> None:
    config = RelayConfig(port=0, database=str(tmp_path / "demo.db"), demo_user="demo")
    runner, port = await start_relay(config)
    try:
        async with aiohttp.ClientSession() as http:
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]"):
                async with http.get(
                    f"http://127.0.0.1:{port}/", headers={"Host": host}, allow_redirects=False
                ) as page:
                    assert page.status == 200 and LOGIN_COOKIE in page.cookies, host
            # A foreign name pointed at 127.0.0.1 (DNS rebinding) is not a visitor of this machine.
            async with http.get(
                f"http://127.0.0.1:{port}/",
                headers={"Host": f"rebound.example:{port}"},
                allow_redirects=False,
            ) as page:
                assert page.status == 303 and page.headers["Location"] == "/login"
                assert LOGIN_COOKIE not in page.cookies
    finally:
        await runner.cleanup()


async def test_the_demo_behind_a_proxy_logs_in_no_visitor_the_proxy_forwards(
    tmp_path: Path,
) -> None:
    """A proxy on this machine keeps the relay's own Host and names its visitor: that visitor
    is not on this machine, so the demo does not make them its admin."""
    config = RelayConfig(
        port=0, database=str(tmp_path / "demo.db"), demo_user="demo", trusted_proxies=["127.0.0.1"]
    )
    runner, port = await start_relay(config)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(
                f"http://127.0.0.1:{port}/",
                headers={"X-Forwarded-For": "203.0.113.5"},
                allow_redirects=False,
            ) as page:
                assert page.status == 303 and page.headers["Location"] == "/login"
                assert LOGIN_COOKIE not in page.cookies
            async with http.get(  # the proxy's own machine is still this one
                f"http://127.0.0.1:{port}/",
                headers={"X-Forwarded-For": "127.0.0.1"},
                allow_redirects=False,
            ) as page:
                assert page.status == 200 and LOGIN_COOKIE in page.cookies
    finally:
        await runner.cleanup()


# ---- origins


@pytest.mark.parametrize("transport", ["websocket", "polling"])
async def test_a_foreign_origin_is_refused(
    relay: RelayHandle, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    token = await relay.people.token()
    client = socketio.AsyncClient(reconnection=False)
    with pytest.raises(socketio.exceptions.ConnectionError):
        await client.connect(
            relay.url,
            namespaces=[IDE_NAMESPACE],
            auth={"token": token},
            headers={"Origin": "http://evil.example"},
            transports=[transport],
            wait_timeout=5,
        )
    await client.disconnect()
    refusals = [r for r in caplog.records if "evil.example" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # one line per request
    assert refusals[0].levelname == "INFO"  # a client's doing

    own = socketio.AsyncClient(reconnection=False)
    await own.connect(
        relay.url,
        namespaces=[IDE_NAMESPACE],
        auth={"token": token},
        headers={"Origin": relay.url},
        transports=[transport],
        wait_timeout=5,
    )
    assert own.connected
    # At once: a polling client's disconnect would otherwise wait out the pending long-poll.
    await own.eio.disconnect(abort=True)


async def test_a_request_for_an_unknown_or_closed_session_is_refused_without_an_error_line(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture
) -> None:
    """A page that slept past its session, or a made-up one, or a client of another protocol
    version: engine.io answers 400, and logs no ERROR line (a client's doing, not the relay's
    failure)."""
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession() as http:
        for query in ("EIO=4&sid=made-up", "EIO=4&sid=made-up&transport=bogus", "EIO=3", ""):
            url = f"{relay.url}/socket.io/?transport=polling&{query}"
            async with http.get(url) as answer:
                assert answer.status == 400
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_login_form_posted_from_another_site_is_refused(relay: RelayHandle) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            relay.url + "/login",
            data={"username": "ada", "password": PASSWORD},
            headers={"Origin": "http://evil.example"},
            allow_redirects=False,
        ) as response,
    ):
        assert response.status == 403
        assert LOGIN_COOKIE not in response.cookies


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"username=ada&password=\xff\xfe"),
        ("application/x-www-form-urlencoded; charset=no-such-charset", b"username=a&password=b"),
        ("multipart/form-data; boundary=", b"x"),
    ],
    ids=["not UTF-8", "an unknown charset", "a multipart form without a boundary"],
)
async def test_a_login_form_that_cannot_be_read_is_refused_without_a_traceback(
    relay: RelayHandle, caplog: pytest.LogCaptureFixture, content_type: str, body: bytes
) -> None:
    """It was answered 500, with a traceback in the relay's log."""
    caplog.set_level(logging.DEBUG)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            relay.url + "/login",
            data=body,
            headers={"Content-Type": content_type},
            allow_redirects=False,
        ) as response,
    ):
        assert response.status == 400
        assert BAD_FORM in await response.text()
    assert "Traceback" not in caplog.text


# ---- members and admins


async def test_members_cannot_list_read_or_abort_each_others_turns_but_admins_can(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browsers: Any,
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer))
    await relay.people.token("root", role="admin")
    alice: Browser = await browsers("alice")
    bob: Browser = await browsers("bob")
    admin: Browser = await browsers("root")
    ack = await alice.submit("Mine alone")
    await alice.wait_text(ack["turnId"], pieces=1)

    assert (await bob.call("listSessions", {"everyone": True}))["sessions"] == []
    assert await bob.call("openSession", {"sessionId": ack["sessionId"]}) == {
        "ok": False,
        "error": "Unknown session.",
    }
    assert await bob.abort(ack["turnId"]) == (False, UNKNOWN_TURN)
    assert await bob.abort() == (False, "No active work order to abort")

    everyone = (await admin.call("listSessions", {"everyone": True}))["sessions"]
    assert [(s["sessionId"], s["ownerName"]) for s in everyone] == [(ack["sessionId"], "alice")]
    assert (await admin.call("listSessions", {}))["sessions"] == []
    opened = await admin.call("openSession", {"sessionId": ack["sessionId"]})
    assert opened["session"]["ownerName"] == "alice"
    assert [t["turnId"] for t in opened["turns"]] == [ack["turnId"]]
    assert await admin.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    assert await alice.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
    assert not bob.progress(ack["turnId"])


async def test_the_same_person_on_two_browsers_sees_the_same_work_and_aborts_it(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    logins: Callable[..., Login],
) -> None:
    openai_peer.script(SLOW)
    await start_drone(Upstream("openai", openai_peer))
    await relay.relay.accounts.add_user("ada", PASSWORD)
    laptop, phone = logins(), logins()
    await laptop.log_in("ada", PASSWORD)
    await phone.log_in("ada", PASSWORD)
    assert laptop.cookie != phone.cookie
    first = await Browser(relay.url, login=laptop.cookie).connect()
    second = await Browser(relay.url, login=phone.cookie).connect()
    try:
        ack = await first.submit("Started on the laptop")
        await first.wait_text(ack["turnId"], pieces=1)

        listed = (await second.call("listSessions", {}))["sessions"]
        assert [(s["sessionId"], s["processingTurnId"]) for s in listed] == [
            (ack["sessionId"], ack["turnId"])
        ]
        await second.call("openSession", {"sessionId": ack["sessionId"]})
        assert await second.abort(ack["turnId"]) == (True, ABORT_SIGNALED)

        assert await first.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
        assert await second.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
    finally:
        await first.close()
        await second.close()


# ---- drones


async def test_a_revoked_drone_token_disconnects_its_drone_and_ends_its_turns(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    openai_peer.script(SLOW)
    token = await relay.relay.accounts.create_drone_token("laptop")
    drone = await start_drone(Upstream("openai", openai_peer), token=token, name="laptop")
    assert drone.drone_id == "laptop" and "laptop" in relay.relay.directory.local
    ack = await browser.submit("Working on the laptop")
    await browser.wait_text(ack["turnId"], pieces=1)

    assert await relay.relay.accounts.revoke_drone_token("laptop")

    assert await browser.completion(ack["turnId"]) == (ack["turnId"], False, TOKEN_REVOKED)
    assert await asyncio.wait_for(drone.task, 10) == 2
    assert "laptop" not in relay.relay.directory.local
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None and (turn.status, turn.result) == ("error", TOKEN_REVOKED)


async def test_a_turn_waiting_for_a_drone_whose_token_is_revoked_ends_with_a_reason(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """A turn sent to a drone by name waits for that drone, even while it is away: once its
    token was revoked, it waited for ever, its person not told why."""
    openai_peer.script(SLOW)
    token = await relay.relay.accounts.create_drone_token("laptop")
    await start_drone(Upstream("openai", openai_peer), token=token, name="laptop")
    running = await browser.submit("Working on the laptop")
    await browser.wait_text(running["turnId"], pieces=1)
    waiting = await browser.submit("Then this, on the laptop", droneId="laptop")
    turn = await relay.relay.store.get_turn(waiting["turnId"], messages=False)
    assert turn is not None and turn.status == "queued"  # the laptop runs one at a time

    assert await relay.relay.accounts.revoke_drone_token("laptop")

    assert await browser.completion(waiting["turnId"]) == (
        waiting["turnId"],
        False,
        TOKEN_REVOKED,
    )
    turn = await relay.relay.store.get_turn(waiting["turnId"])
    assert turn is not None and (turn.status, turn.reason) == ("error", "drone_failed")
    assert [m.role for m in turn.messages] == ["user"]


async def test_turns_waiting_for_a_revoked_drone_end_though_its_slots_free_up_first(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    """Ending the revoked drone's running turns freed its slots, and the turns waiting for it
    were sent to it as it was being dismissed: not queued any more when the relay looked for
    them, they came back in line after it left and waited for ever (one run in three with a
    relay, a drone and the revoking command in processes of their own; in one process, as
    here, the race is rarely met)."""
    openai_peer.script(*[SLOW] * 4)
    token = await relay.relay.accounts.create_drone_token("laptop")
    await start_drone(Upstream("openai", openai_peer), token=token, name="laptop", concurrency=4)
    acks = [await browser.submit(f"Turn {n}", droneId="laptop") for n in range(6)]
    for ack in acks[:4]:
        await browser.wait_text(ack["turnId"], pieces=1)

    assert await relay.relay.accounts.revoke_drone_token("laptop")

    for ack in acks:
        assert await browser.completion(ack["turnId"], timeout=10) == (
            ack["turnId"],
            False,
            TOKEN_REVOKED,
        )


async def test_a_turn_for_a_drone_whose_token_was_revoked_before_is_refused_at_once(
    relay: RelayHandle, browser: Browser
) -> None:
    """Sent after the revocation, it was queued for that drone and waited for ever (sent
    before it, it ends in error, above)."""
    await relay.relay.accounts.create_drone_token("laptop")
    assert await relay.relay.accounts.revoke_drone_token("laptop")

    answer = await browser.call("submitWorkOrder", {"prompt": "On the laptop", "droneId": "laptop"})

    assert answer == {"ok": False, "error": TOKEN_REVOKED}
    assert await relay.relay.store.list_sessions(None) == []  # nothing stored
    # A drone that has its token again takes turns again.
    await relay.relay.accounts.create_drone_token("laptop")
    again = await browser.call("submitWorkOrder", {"prompt": "On the laptop", "droneId": "laptop"})
    assert again["ok"] is True
    turn = await relay.relay.store.get_turn(again["turnId"], messages=False)
    assert turn is not None and turn.status == "queued"


async def test_revocations_made_while_no_relay_ran_end_their_turns_once_one_starts(
    tmp_path: Path,
) -> None:
    """A drone's token revoked, and a person removed, while no relay ran (the commands work on
    the database alone): the turn waiting for that drone waited for ever, and the person's
    queued turns ran once a drone came, though they ended at once with the relay running."""
    database = relay_folder(tmp_path) / "hangar.db"
    config = RelayConfig(port=0, database=str(database), drone_token=DRONE_TOKEN)
    async with relay_on(config) as first:
        await first.relay.accounts.create_drone_token("laptop")
        alice = await Browser(first.url, await first.people.token("alice")).connect()
        bob = await Browser(first.url, await first.people.token("bob")).connect()
        laptops = (await alice.submit("On the laptop", droneId="laptop"))["turnId"]
        bobs = (await bob.submit("On any drone"))["turnId"]  # none is there: it waits
        await alice.close()
        await bob.close()
    store = SqliteTurnStore(str(database))
    await store.open()
    try:
        assert await Accounts(store).revoke_drone_token("laptop")
        assert await Accounts(store).remove_user("bob")
    finally:
        await store.close()

    async with relay_on(config) as again:
        ended = {laptops: ("error", TOKEN_REVOKED), bobs: ("aborted", PERSON_REMOVED.result)}
        for turn_id, (status, result) in ended.items():

            async def stored(turn_id: str = turn_id) -> TurnRecord | None:
                turn = await again.relay.store.get_turn(turn_id, messages=False)
                return turn if turn is not None and turn.status != "queued" else None

            turn = await eventually(stored, timeout=5, what=f"{turn_id} ended")
            assert (turn.status, turn.result) == (status, result)


async def test_a_revocation_a_relay_failed_to_act_on_is_acted_on_at_the_next_look(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database failed while a relay ended the turns of a drone whose token was revoked: the
    relay logged a traceback and went on past the revocation, and those turns waited for ever."""
    store = SqliteTurnStore(str(tmp_path / "hangar.db"))
    await store.open()
    accounts = Accounts(store)
    await accounts.create_drone_token("laptop")
    heard: list[str] = []

    async def flaky(revocation: Revocation) -> None:
        heard.append(f"{revocation.kind} {revocation.revoked}")
        if len(heard) == 1:
            raise OSError("the database does not answer")

    following = asyncio.ensure_future(follow_revocations(accounts, [flaky]))
    try:
        await accounts.revoke_drone_token("laptop")
        await eventually(lambda: len(heard) == 2, what="the revocation told again")
    finally:
        following.cancel()
        await store.close()
    assert heard == ["drone laptop", "drone laptop"]
    assert "Traceback" not in caplog.text


async def test_a_drone_token_only_opens_its_own_drone(relay: RelayHandle) -> None:
    token = await relay.relay.accounts.create_drone_token("laptop")
    hello = {**drone_hello("desk"), "token": token}

    refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=hello, transports=["websocket"])

    assert refused == {"message": "This token is the drone laptop's; connect as laptop."}
    forged = {**drone_hello("laptop"), "token": token[:-4] + "AAAA"}
    refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=forged, transports=["websocket"])
    assert refused == {"message": INVALID_TOKEN}


async def test_the_shared_token_cannot_open_a_drone_that_has_a_token_of_its_own(
    relay: RelayHandle,
) -> None:
    await relay.relay.accounts.create_drone_token("laptop")
    shared = drone_hello("laptop")  # the relay's shared drone token, while laptop is offline

    refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=shared, transports=["websocket"])

    assert refused == {"message": OWN_TOKEN.format("laptop")}
    assert await relay.relay.accounts.revoke_drone_token("laptop")
    refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=shared, transports=["websocket"])
    assert refused == {"message": OWN_TOKEN.format("laptop")}  # revoked stays revoked
    # Nor under its name with an id of its own, as `hangar drone --name laptop` connects.
    named = {**drone_hello("laptop-b11f37"), "name": "laptop"}
    refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=named, transports=["websocket"])
    assert refused == {"message": OWN_TOKEN.format("laptop")}
    # Nor under a name that differs only in case, which people would take for it.
    for claimed in ("Laptop", "LAPTOP"):
        alike = {**drone_hello("laptop-b11f37"), "name": claimed}
        refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=alike, transports=["websocket"])
        assert refused == {"message": OWN_TOKEN.format(claimed)}
    desk = socketio.AsyncClient(reconnection=False)  # no token of its own: the shared one opens
    await desk.connect(
        relay.url, namespaces=[DRONE_NAMESPACE], auth=drone_hello("desk"), wait_timeout=5
    )
    await desk.disconnect()


@pytest.mark.parametrize(
    "claimed",
    ["laptop ", " laptop", "lap top", "laptop\u200b", "l\u0430ptop", "laptop\n", ""],
    ids=[
        "space after",
        "space before",
        "space inside",
        "zero-width space",
        "cyrillic a",
        "newline",
        "empty",
    ],
)
async def test_a_drone_is_shown_only_under_a_name_no_one_takes_for_another(
    relay: RelayHandle, claimed: str
) -> None:
    """The shared secret let a drone in as "laptop " or "l\u0430ptop" (a Cyrillic a) beside the
    drone laptop that has a token of its own: people picking a drone by name could send their
    work to it. A drone's name is the letters, digits, '.', '_' and '-' that ``--name`` takes."""
    await relay.relay.accounts.create_drone_token("laptop")
    alike = {**drone_hello("desk-b11f37"), "name": claimed}

    refused = await refusal_of(relay.url, DRONE_NAMESPACE, auth=alike, transports=["websocket"])

    assert refused is not None and refused["message"].startswith("Invalid payload (name:")
    assert "desk-b11f37" not in relay.relay.directory.local


async def test_a_drone_with_a_token_of_its_own_is_not_shown_under_another_drones_name(
    relay: RelayHandle,
) -> None:
    """The drone evil, with its own token, was let in under the name "laptop", the name of
    another drone with its own token."""
    await relay.relay.accounts.create_drone_token("laptop")
    token = await relay.relay.accounts.create_drone_token("evil")
    for claimed in ("laptop", "LAPTOP"):
        posing = {**drone_hello("evil"), "token": token, "name": claimed}
        refused = await refusal_of(
            relay.url, DRONE_NAMESPACE, auth=posing, transports=["websocket"]
        )
        assert refused == {"message": OWN_TOKEN.format(claimed)}
    # Under a name of its own choosing, or its own in another case, it is let in.
    for shown in ("evil-gpu", "Evil"):
        own = socketio.AsyncClient(reconnection=False)
        hello = {**drone_hello("evil"), "token": token, "name": shown}
        await own.connect(relay.url, namespaces=[DRONE_NAMESPACE], auth=hello, wait_timeout=5)
        assert relay.relay.directory.local["evil"].name == shown
        await own.disconnect()
        await eventually(lambda: "evil" not in relay.relay.directory.local, what="it is gone")


async def test_of_drones_connecting_at_once_under_one_id_only_one_is_let_in(
    relay: RelayHandle,
) -> None:
    """Each was checked before any was registered, and all were let in: a connection that did
    not hold the drone's route could then send text into its turns and end them."""
    token = await relay.relay.accounts.create_drone_token("laptop")
    clients = [socketio.AsyncClient(reconnection=False) for _ in range(4)]
    refusals: list[Any] = []
    for client in clients:
        client.on("connect_error", refusals.append, namespace=DRONE_NAMESPACE)

    async def connect(client: socketio.AsyncClient, index: int) -> bool:
        hello = {**drone_hello("laptop"), "token": token, "instance": f"instance-secret-{index:08}"}
        try:
            await client.connect(
                relay.url,
                namespaces=[DRONE_NAMESPACE],
                auth=hello,
                transports=["websocket"],
                wait_timeout=5,
            )
        except socketio.exceptions.ConnectionError:
            return False
        return True

    try:
        let_in = await asyncio.gather(*(connect(c, i) for i, c in enumerate(clients)))
    finally:
        for client in clients:
            await client.disconnect()

    assert let_in.count(True) == 1, (let_in, refusals)
    assert refusals == [{"message": ALREADY_CONNECTED}] * 3


async def test_a_drone_listing_another_drones_turn_as_its_own_does_not_keep_it_processing(
    relay: RelayHandle, browser: Browser
) -> None:
    """A drone names the turns it runs when it connects; the relay forgot its watchdogs for
    every one named, its own or not: another drone's aborted turn, its drone silent, stayed
    processing for ever instead of ending within the abort's grace."""
    async with HandDrone(relay.url, "hand-1") as drone:
        ack = await browser.submit("Abort me")
        turn_id = await drone.next_order()
        assert await browser.abort(turn_id) == (True, ABORT_SIGNALED)  # and it never ends it
        rogue = socketio.AsyncClient(reconnection=False)
        await rogue.connect(
            relay.url,
            namespaces=[DRONE_NAMESPACE],
            auth={**drone_hello("rogue-1"), "running": [turn_id]},
            transports=["websocket"],
        )
        try:
            assert await browser.completion(ack["turnId"], timeout=10) == (
                turn_id,
                True,
                "aborted",
            )
        finally:
            await rogue.disconnect()
    assert (await browser.ending(turn_id))["reason"] == "unanswered"


async def test_no_connection_takes_over_a_connected_drone(
    relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    openai_peer.script(SLOW, Reply(chunks=["Next ", "one."]))
    drone = await start_drone(Upstream("openai", openai_peer))
    ack = await browser.submit("Keep me")
    await browser.wait_text(ack["turnId"], pieces=1)
    impostor_orders: list[Any] = []
    impostor = socketio.AsyncClient(reconnection=False)
    impostor.on("workOrder", impostor_orders.append, namespace=DRONE_NAMESPACE)

    refused = await refusal_of(
        relay.url,
        DRONE_NAMESPACE,
        auth={**drone_hello(drone.drone_id), "instance": "someone-else-entirely"},
        transports=["websocket"],
    )

    assert refused == {"message": ALREADY_CONNECTED}
    assert relay.relay.directory.local[drone.drone_id].sid  # the real drone is still routed
    assert await browser.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, "aborted")
    second = await browser.submit("Then this", sessionId=ack["sessionId"])
    assert (await browser.completion(second["turnId"]))[1:] == (True, "Next one.")
    assert impostor_orders == []


@pytest.mark.parametrize(
    "before",
    ['prefs={"theme":"dark"}; ', "a=b c; ", 'x="unclosed; ', f"{LOGIN_COOKIE}=an-old-login; "],
    ids=["json", "space", "quote", "an-earlier-one-of-the-name"],
)
async def test_the_login_cookie_opens_the_socket_beside_anothers_unreadable_cookie(
    relay: RelayHandle, logins: Callable[..., Login], before: str
) -> None:
    """Another program on the same host can set a cookie Python's ``SimpleCookie`` cannot
    read, and it then dropped every cookie after it: the page opened (aiohttp reads the
    header whole) but its socket was refused "Log in to continue.", so the page went to
    /login, which sent it back to the page, 52 loads in 6 s, for ever. Of two cookies of the
    login's name, the socket reads the one the page's routes read (the last)."""
    await relay.relay.accounts.add_user("ada", PASSWORD)
    login = logins()
    assert (await login.post("/login", username="ada", password=PASSWORD))[0] == 303
    header = f"{before}{LOGIN_COOKIE}={login.cookie}; theme=dark"

    # As a browser sends it: python-socketio's client reads the header with SimpleCookie too,
    # and a session with a cookie jar adds its own.
    url = relay.url + "/socket.io/?EIO=4&transport=websocket"
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(url, headers={"Cookie": header}) as socket,
    ):
        assert (await socket.receive_str(timeout=5)).startswith("0{")  # engine.io's open
        await socket.send_str(f"40{IDE_NAMESPACE},")
        said = [await socket.receive_str(timeout=5)]
        while not said[-1].startswith(("40", "44")):  # the hello may come before the connect
            said.append(await socket.receive_str(timeout=5))
    assert said[-1].startswith(f"40{IDE_NAMESPACE},{{"), said  # connected, not "44…" refused
