"""A page whose connection drops while the relay's database is down, in real Chromium: the relay
refuses its login check not for good, and the page connects again by itself once the database
answers (docs/protocol.md, "Access")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Page, expect

from bench.services import OwnPostgres
from hangar.server.app import RelayConfig
from tests.browser.test_page import WAIT_MS, open_hangar
from tests.conftest import RelayHandle, eventually, relay_on

pytestmark = pytest.mark.browser


@pytest.fixture
async def relay(own_postgres: OwnPostgres) -> AsyncIterator[RelayHandle]:
    """The browser fixtures' relay, on a PostgreSQL of the test's own."""
    async with relay_on(RelayConfig(port=0, database=own_postgres.url)) as relay:
        yield relay


async def test_a_page_cut_off_during_a_database_outage_comes_back_by_itself(
    page: Page, relay: RelayHandle, own_postgres: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hangar.relay")
    await open_hangar(page, relay)
    badge = page.locator("#connection")

    await asyncio.to_thread(own_postgres.kill)
    await relay.relay.sio.eio.disconnect()  # every connection dropped: the page reconnects
    # Its login cannot be checked: refused, not for good.
    await eventually(
        lambda: any("login not checked" in r.getMessage() for r in caplog.records),
        timeout=10,
        what="the page's connection refused",
    )
    await expect(badge).to_have_attribute("data-state", "reconnecting")
    await expect(page.locator("#reconnect")).to_be_hidden()

    await asyncio.to_thread(own_postgres.start)
    await expect(badge).to_have_attribute("data-state", "connected", timeout=WAIT_MS)
    await expect(page.locator("#reconnect")).to_be_hidden()
