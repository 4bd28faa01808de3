"""Logging in, out, and what a page from elsewhere can reach, in real Chromium."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from playwright.async_api import Page, expect

from bench.services import free_port
from hangar.server.access import BAD_LOGIN
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.demo import end_demo
from hangar.shared.protocol import NOT_LOGGED_IN
from tests.browser.conftest import log_in
from tests.browser.test_page import assert_not_red, has_class
from tests.conftest import Browser, RelayHandle, eventually

pytestmark = pytest.mark.browser

PASSWORD = "correct horse battery staple"
WAIT_MS = 10_000


async def test_the_login_page_logs_a_person_in_and_out(page: Page, relay: RelayHandle) -> None:
    await relay.relay.accounts.add_user("ada", PASSWORD)

    await page.goto(relay.url + "/")
    await expect(page).to_have_url(relay.url + "/login")
    await page.fill("#username", "ada")
    await page.fill("#password", "a wrong guess")
    await page.press("#password", "Enter")
    await expect(page.locator(".login-error")).to_have_text(BAD_LOGIN)
    await expect(page.locator("#username")).to_have_value("ada")  # kept: only retype the password
    await expect(page.locator("#password")).to_be_focused()
    await page.fill("#password", PASSWORD)
    await page.click("button[type=submit]")

    await expect(page).to_have_url(relay.url + "/")
    await expect(page.locator("#account-name")).to_have_text("ada")
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    await expect(page.locator("#demo-note")).to_be_hidden()
    await page.click("#log-out")
    await expect(page).to_have_url(relay.url + "/login")
    await page.goto(relay.url + "/")
    await expect(page).to_have_url(relay.url + "/login")


async def test_a_page_logged_out_elsewhere_goes_to_the_login(
    page: Page, relay: RelayHandle
) -> None:
    await log_in(page, relay, "ada")
    await page.goto(relay.url + "/")
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    user = await relay.relay.accounts.user("ada")
    assert user is not None

    await relay.relay.accounts.remove_user("ada")

    await expect(page).to_have_url(relay.url + "/login", timeout=WAIT_MS)


PROBE = """<!doctype html><meta charset="utf-8"><title>elsewhere</title><script>
const seen = [];
const note = (what) => { seen.push(what); window.probe = seen.slice(); };
const relay = "127.0.0.1:%(port)d";
const ws = new WebSocket(`ws://${relay}/socket.io/?EIO=4&transport=websocket`);
ws.onopen = () => note("open");
ws.onmessage = (event) => {
  note("message " + event.data);
  if (event.data.startsWith("0")) ws.send("40/ide,");
  if (event.data.startsWith("40/ide")) ws.send('42/ide,1["listSessions",{}]');
};
ws.onerror = () => note("error");
ws.onclose = () => { note("close"); window.wsDone = true; };
fetch(`http://${relay}/socket.io/?EIO=4&transport=polling`, {credentials: "include"})
  .then((r) => r.text()).then((t) => note("polling " + t))
  .catch(() => note("polling refused")).finally(() => { window.pollDone = true; });
</script>"""


@pytest.fixture
async def elsewhere(relay: RelayHandle) -> AsyncIterator[str]:
    """A page on another port of the same host, trying the relay's socket.io endpoint."""
    port = int(relay.url.rsplit(":", 1)[1])

    async def probe(request: web.Request) -> web.Response:
        return web.Response(text=PROBE % {"port": port}, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", probe)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/"
    await runner.cleanup()


async def test_a_page_from_another_origin_gets_nothing_from_the_relay(
    page: Page, relay: RelayHandle, elsewhere: str, browsers: object
) -> None:
    await log_in(page, relay, "victim")
    victim = await Browser(relay.url, await relay.people.token("victim")).connect()
    try:
        ack = await victim.submit("The victim's secret plan")
        await victim.abort(ack["turnId"])  # no drone: it would wait in line
        await victim.completion(ack["turnId"])
    finally:
        await victim.close()
    # The browser holds the victim's login cookie for 127.0.0.1, as after a visit to the relay.

    await page.goto(elsewhere)
    await page.wait_for_function("window.wsDone && window.pollDone", timeout=WAIT_MS)

    seen: list[str] = await page.evaluate("window.probe")
    assert "open" not in seen and "close" in seen, seen
    assert "polling refused" in seen, seen
    assert not [item for item in seen if "secret" in item or "sessions" in item], seen


async def test_no_other_page_can_frame_the_relays(page: Page, relay: RelayHandle) -> None:
    """Another page framing the relay's (to trick a click on Cancel, or on the login form)
    gets an empty frame: the relay says it is never framed."""
    await log_in(page, relay, "victim")
    framer = await page.context.new_page()  # its refusals are the point, not the page's errors
    said: list[str] = []
    framer.on("console", lambda line: said.append(line.text))

    await framer.set_content(  # returns once the frames have loaded, or failed to
        f'<iframe src="{relay.url}/"></iframe><iframe src="{relay.url}/login"></iframe>'
    )

    framed = framer.frames[1:]
    assert len(framed) == 2
    for frame in framed:
        assert await frame.locator("#prompt, #password").count() == 0, frame.url
    await eventually(
        lambda: len([line for line in said if "frame-ancestors 'none'" in line]) == 2,
        what="both frames refused",
    )
    await framer.close()


async def test_the_demo_on_this_machine_logs_the_visitor_in_and_says_so(
    page: Page, tmp_path: Path
) -> None:
    config = RelayConfig(port=0, database=str(tmp_path / "demo.db"), demo_user="demo")
    runner, port = await start_relay(config)
    try:
        url = f"http://127.0.0.1:{port}/"
        await page.goto(url)

        await expect(page).to_have_url(url)
        await expect(page.locator("#account-name")).to_have_text("demo")
        await expect(page.locator("#demo-note")).to_be_visible()
        prompts = page.locator("#demo-prompts")  # the empty conversation names what to try
        await expect(prompts).to_be_visible()
        for prompt in (
            "list the files",
            "run a command",
            "write a note",
            "delegate to a sub-agent",
        ):
            await expect(prompts).to_contain_text(prompt)
        assert await runner.app[RELAY].accounts.user("demo") is not None
    finally:
        await page.goto("about:blank")  # closes the page's connection before the relay stops
        await runner.cleanup()


@pytest.mark.parametrize("stop", ["stops", "stops and comes back"])
async def test_a_demo_page_whose_demo_stops_keeps_its_draft_and_works_when_the_demo_is_back(
    page: Page, tmp_path: Path, stop: str
) -> None:
    """A demo's logins end as it stops. Its open pages went to the login form, which the demo's
    person, who has no password, cannot use; and what they had typed was gone. A demo's page
    now waits for its relay, is logged in again by a demo started again, and keeps the draft."""
    config = RelayConfig(port=free_port(), database=str(tmp_path / "demo.db"), demo_user="demo")
    runner, _ = await start_relay(config)
    url = f"http://127.0.0.1:{config.port}/"
    try:
        await page.goto(url)
        await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
        await page.locator("#prompt").fill("half a thought")

        await end_demo(runner.app)
        await runner.cleanup()

        await expect(page.locator("#connection")).to_have_attribute(
            "data-state", "reconnecting", timeout=WAIT_MS
        )
        if stop == "stops":
            await expect(page.locator("#prompt")).to_have_value("half a thought")
            assert page.url == url  # no dead end to go back from
            return
        runner, _ = await start_relay(config)
        await expect(page.locator("#connection")).to_have_attribute(
            "data-state", "connected", timeout=WAIT_MS
        )
        assert page.url == url
        await expect(page.locator("#account-name")).to_have_text("demo")
        await expect(page.locator("#prompt")).to_have_value("half a thought")
    finally:
        await page.goto("about:blank")
        await runner.cleanup()


async def test_a_draft_outlasts_a_reload_for_its_person_only(
    page: Page, relay: RelayHandle
) -> None:
    """A reload lost what was typed and not sent; it is kept in the tab now, but not for the
    next person to log in there."""
    await log_in(page, relay, "ada")
    await page.goto(relay.url + "/")
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    await page.locator("#prompt").fill("half a thought")

    await page.reload()

    await expect(page.locator("#account-name")).to_have_text("ada")
    await expect(page.locator("#prompt")).to_have_value("half a thought")
    await page.locator("#log-out").click()
    await expect(page).to_have_url(relay.url + "/login")
    await relay.relay.accounts.add_user("bob", PASSWORD)
    await page.locator("#username").fill("bob")
    await page.locator("#password").fill(PASSWORD)
    await page.locator("#password").press("Enter")
    await expect(page.locator("#account-name")).to_have_text("bob")
    await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
    await expect(page.locator("#prompt")).to_have_value("")


async def test_an_admin_can_list_everyones_sessions_and_sees_whose_they_are(
    page: Page, relay: RelayHandle
) -> None:
    alice = await Browser(relay.url, await relay.people.token("alice")).connect()
    try:
        ack = await alice.submit("Alice's question")
        await alice.abort(ack["turnId"])  # no drone: it would wait in line
        await alice.completion(ack["turnId"])
    finally:
        await alice.close()
    await log_in(page, relay, "root", role="admin")
    await page.goto(relay.url + "/")
    await expect(page.locator("#account-role")).to_have_text("admin")
    await expect(page.locator("#demo-prompts")).to_be_hidden()  # no demo model here
    await expect(page.locator("#sessions .session")).to_have_count(0)

    await page.click('#sessions-scope [data-scope="everyone"]')

    session = page.locator("#sessions .session")
    await expect(session).to_have_count(1)
    await expect(session.locator(".session-owner-tag")).to_have_text("alice")
    await session.click()
    await expect(page.locator("#session-owner")).to_have_text("alice's session")
    await expect(page.locator("#turns article.turn")).to_have_count(1)
    await expect(page.locator("#prompt")).to_be_disabled()  # watch and abort, not write in it


async def test_an_admin_sees_why_a_removed_persons_turn_ended(
    page: Page, relay: RelayHandle
) -> None:
    alice = await Browser(relay.url, await relay.people.token("alice")).connect()
    try:
        ack = await alice.submit("Alice's question")  # no drone: it waits in line
        assert await relay.relay.accounts.remove_user("alice")
        await eventually(lambda: ("loggedOut", {"reason": NOT_LOGGED_IN}) in alice.events)
    finally:
        await alice.close()
    await log_in(page, relay, "root", role="admin")
    await page.goto(relay.url + "/")
    await page.click('#sessions-scope [data-scope="everyone"]')
    await page.locator("#sessions .session").click()

    turn = page.locator(f'#turns article.turn[data-turn-id="{ack["turnId"]}"]')
    await expect(turn).to_have_class(has_class("aborted"))
    await expect(turn.locator(".turn-status")).to_have_text(
        "Aborted: its person's account was removed."
    )
    await assert_not_red(turn)
