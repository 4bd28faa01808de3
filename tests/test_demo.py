"""``hangar demo``: one command brings up a relay, a drone and the offline demo model."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import aiohttp

from hangar.server.access import LOGIN_COOKIE
from tests.conftest import HANGAR, ROOT, Browser


async def test_demo_serves_the_page_and_its_drone_completes_a_work_order(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OLLAMA_HOST")}
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "demo", "--port", "0",
        "--database", str(tmp_path / "demo.db"),
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
