"""Real Chromium (Debian's, driven by Playwright) against a real relay.

Every test gets its own browser process and a fresh browser context, so each page has its own
identity cookie and nothing leaks between tests. When ``/usr/bin/chromium`` is missing the
browser tests are skipped with a loud reason; under ``CI=true`` (or ``1``) they fail instead.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from typing import Any

import pytest

from hangar.server.access import LOGIN_COOKIE
from hangar.server.accounts import Role
from tests.conftest import ROOT, RelayHandle, ci

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = ROOT / "test-artifacts"
# Bounded waits: generous enough for a loaded machine, short enough to fail fast on a hang.
ACTION_TIMEOUT_MS = 15_000


def _missing_browser() -> str | None:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError as error:  # pragma: no cover - the dev extras install it
        return f"the playwright Python package is not installed ({error})"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} does not exist (install Debian's chromium package)"
    return None


def _require_browser() -> None:
    reason = _missing_browser()
    if reason is None:
        return
    message = f"BROWSER TESTS NOT RUN: {reason}"
    if ci():
        pytest.fail(f"{message}; a missing browser is a failure when CI is set", pytrace=False)
    pytest.skip(message)


_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Remember each phase's report on the item, so fixtures can tell a test failed."""
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    reports = request.node.stash.get(_REPORTS, {})
    return any(report.failed for report in reports.values())


async def log_in(page: Any, relay: RelayHandle, person: str, role: Role = "member") -> None:
    """Give the page's browser a login of ``person`` (made on first use), as /login would."""
    accounts = relay.relay.accounts
    user = await accounts.user(person) or await accounts.add_user(person, None, role)
    token = await accounts.log_in(user)
    await page.context.add_cookies([{"name": LOGIN_COOKIE, "value": token, "url": relay.url}])


@contextlib.asynccontextmanager
async def phone_page(
    page: Any,
    relay: RelayHandle,
    path: str = "/",
    size: tuple[int, int] = (375, 667),
    **context: Any,
) -> AsyncIterator[Any]:
    """A phone's page (a touch screen of ``size``) beside ``page``, logged in as the tester and
    opened at ``path``; ``context`` adds to the browser context (``color_scheme``, ...)."""
    browser = page.context.browser
    assert browser is not None
    phone_context = await browser.new_context(
        viewport={"width": size[0], "height": size[1]}, is_mobile=True, has_touch=True, **context
    )
    try:
        phone = await phone_context.new_page()
        await log_in(phone, relay, "tester")
        await phone.goto(relay.url + path)
        yield phone
    finally:
        await phone_context.close()


async def assert_no_sideways_scroll(page: Any, width: int) -> None:
    """Nothing on the page is wider than ``width`` (the screen): it never scrolls sideways."""
    widths = await page.evaluate(
        "() => [document.documentElement.scrollWidth, document.body.scrollWidth]"
    )
    assert max(widths) <= width, f"horizontal overflow at {width} px: {widths}"


def artifact(name: str) -> Path:
    """A path under ``test-artifacts/`` (created on demand)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


@pytest.fixture(autouse=True)
def _browser_available() -> None:
    """Skip (or, under CI, fail) before any relay or drone is started for nothing."""
    _require_browser()


@pytest.fixture
async def page(relay: RelayHandle, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A blank page in a fresh context of a freshly launched headless Chromium.

    Not navigated yet (a test may install a fake clock first): use ``open_hangar``. Uncaught
    JavaScript errors, and anything the page's Content-Security-Policy refuses, fail the test; a
    failing test leaves a screenshot in ``test-artifacts/``.
    """
    _require_browser()
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 800})
            context.set_default_timeout(ACTION_TIMEOUT_MS)
            opened = await context.new_page()
            errors: list[str] = []
            opened.on("pageerror", lambda error: errors.append(str(error)))
            opened.on(
                "console", lambda line: errors.extend(refused_by_policy(line.type, line.text))
            )
            yield opened
            if _failed(request):
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
                with contextlib.suppress(Exception):  # best effort: the page may be gone
                    await opened.screenshot(path=artifact(f"failed-{name}.png"), full_page=True)
            assert not errors, f"uncaught JavaScript errors in the page: {errors}"
            await context.close()
        finally:
            await browser.close()


def refused_by_policy(kind: str, text: str) -> list[str]:
    """A console line saying the page's own Content-Security-Policy refused something: the
    page would be missing a part of itself (a script, a style, a connection)."""
    return [text] if kind == "error" and "Content Security Policy" in text else []


@pytest.fixture
def relay_ping() -> tuple[float, float] | None:
    """A page's clock may be moved on by seconds (the Esc window); engine.io's own timers in the
    page move with it, so the relay pings pages at engine.io's usual pace here."""
    return (25.0, 20.0)
