"""``hangar demo``: one command brings up a relay, a drone and the offline demo model."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hangar.server.access import LOGIN_COOKIE
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from tests.conftest import HANGAR, ROOT, Browser, eventually, relay_folder


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
async def test_demo_serves_the_page_and_its_drone_completes_a_work_order(
    tmp_path: Path, host: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OLLAMA_HOST")}
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--host", host, "--port", "0",
        "--database", str(relay_folder(tmp_path) / "demo.db"),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    browser: Browser | None = None
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        found = re.search(r"open (http://\S+/) in your browser", line)
        assert found, line
        url = found.group(1)
        assert url.startswith(f"http://{host}:")  # an IPv6 address in its brackets
        async with aiohttp.ClientSession() as http, http.get(url) as page:
            assert page.status == 200
            login = page.cookies[LOGIN_COOKIE].value  # a visitor on this machine is let in

        browser = await Browser(url.rstrip("/"), login=login).connect()
        drones = await browser.call("listDrones", {})
        assert [d["model"] for d in drones["drones"]] == ["hangar-demo"]
        ack = await browser.submit("Show me the demo")
        _, success, message = await browser.completion(ack["turnId"], timeout=60)

        assert success is True
        assert message.startswith("[demo model]")
        assert "Show me the demo" in browser.text(ack["turnId"])
    finally:
        if browser is not None:
            await browser.close()
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0


async def test_the_demo_model_calls_tools_that_ask_first_and_a_sub_agent(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OLLAMA_HOST")}
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text("hi")
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--port", "0", "--workdir", str(work),
        "--database", str(relay_folder(tmp_path) / "demo.db"),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    browser: Browser | None = None
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        found = re.search(r"open (http://\S+/) in your browser", line)
        assert found, line
        url = found.group(1)
        async with aiohttp.ClientSession() as http, http.get(url) as page:
            login = page.cookies[LOGIN_COOKIE].value
        browser = await Browser(url.rstrip("/"), login=login).connect()

        # A command waits for the person, then runs; an abort lands in the middle of it.
        ack = await browser.submit("Run a command, please")
        waiting = await _tool(browser, ack["turnId"], "waiting")
        assert waiting["name"] == "run_shell"
        payload = {"turnId": ack["turnId"], "callId": waiting["callId"], "approve": True}
        assert await browser.call("approveToolCall", payload) == {"ok": True}
        await _tool(browser, ack["turnId"], "start")
        assert await browser.abort(ack["turnId"]) == (True, "Abort signaled")
        assert (await browser.completion(ack["turnId"], timeout=30))[1:] == (True, "aborted")
        assert (await _tool(browser, ack["turnId"], "cancelled"))["name"] == "run_shell"

        # A sub-agent lists the files (reading needs no approval) and its parent reports.
        ack = await browser.submit("Delegate this to a sub-agent", sessionId=ack["sessionId"])
        _, success, message = await browser.completion(ack["turnId"], timeout=60)
        assert success is True and message.startswith("[demo model] The tool spawn_subagent")
        # The sub-agent's answer has a code block of its own: the parent's fence is longer.
        assert "\n````\n[demo model] The tool list_directory answered:\n\n```\n" in message
        listed = [
            p
            for p in browser.progress(ack["turnId"], "tool")
            if p["name"] == "list_directory" and p["state"] == "end"
        ]
        assert listed and listed[0]["depth"] == 1 and "hello.txt" in listed[0]["result"]
    finally:
        if browser is not None:
            await browser.close()
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0


async def _tool(browser: Browser, turn_id: str, state: str) -> dict[str, Any]:
    found = await eventually(
        lambda: [p for p in browser.progress(turn_id, "tool") if p["state"] == state],
        30,
        f"a tool call {state}",
    )
    call: dict[str, Any] = found[0]
    return call


async def test_the_demos_logins_end_with_it_and_a_person_named_demo_is_not_taken(
    tmp_path: Path,
) -> None:
    """Run once on a team's database, the demo left its visitors' admin logins (14 days)
    working on the team's relay; and a person of the team named ``demo`` was the user every
    visitor on the machine was logged in as."""
    database = str(relay_folder(tmp_path) / "team.db")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OLLAMA_HOST")}
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--port", "0", "--database", database,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        found = re.search(r"open (http://\S+/) in your browser", line)
        assert found, line
        async with aiohttp.ClientSession() as http, http.get(found.group(1)) as page:
            login = page.cookies[LOGIN_COOKIE].value
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 30) == 0

    runner, port = await start_relay(RelayConfig(port=0, database=database))
    try:
        async with (
            aiohttp.ClientSession(cookies={LOGIN_COOKIE: login}) as http,
            http.get(f"http://127.0.0.1:{port}/", allow_redirects=False) as page,
        ):
            assert (page.status, page.headers.get("Location")) == (303, "/login")
        await runner.app[RELAY].accounts.remove_user("demo")
        await runner.app[RELAY].accounts.add_user("Demo", "a person's password")
    finally:
        await runner.cleanup()

    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--port", "0", "--database", database,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2, out
    assert err.decode() == (
        "hangar demo: this database has a person named Demo, whom the demo would log every "
        "visitor in as; run the demo on a database of its own (--database).\n"
    )
