"""Short screens in real Chromium: a phone held sideways, a desktop window at 200% zoom, a
phone in portrait with the demo's note, and the 320×256 of WCAG's reflow. The conversation
keeps most of the height while a turn runs, the focused Approve of an approval card is on
screen, and every button of the prompt form can be seen and pressed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
from playwright.async_api import Locator, Page, expect

from hangar.server.app import RelayConfig
from hangar.server.store import SessionRecord
from tests.browser.conftest import artifact, assert_no_sideways_scroll, log_in
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, submit, turn_id_of
from tests.browser.test_page_approvals import waiting
from tests.conftest import DRONE_TOKEN, RelayHandle, relay_folder, relay_on

pytestmark = pytest.mark.browser

DEMO_USER = "demo"
ANSWER = "Here is the plan, step by step. " * 40

# Where an element is, and whether a person sees it there: inside the window, and what is
# drawn at its centre is the element itself (not a header over it, nor a scroller's edge).
# Measured once the page has drawn two more frames (a view that follows the answer has moved).
ON_SCREEN = """async (el) => {
    for (let i = 0; i < 2; i++) await new Promise(requestAnimationFrame);
    const r = el.getBoundingClientRect();
    const inside = r.width > 0 && r.height > 0 && r.left >= 0 && r.top >= 0
        && r.right <= innerWidth && r.bottom <= innerHeight;
    const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    return inside && hit !== null && el.contains(hit);
}"""

# The share of the window's height that shows the conversation.
CONVERSATION_SHARE = """() => {
    const r = document.getElementById("conversation").getBoundingClientRect();
    return Math.max(0, Math.min(r.bottom, innerHeight) - Math.max(r.top, 0)) / innerHeight;
}"""


@pytest.fixture
async def relay(
    tmp_path: Path, relay_ping: tuple[float, float] | None
) -> AsyncIterator[RelayHandle]:
    """A demo relay (its demo user's page carries the demo's note: the tallest header)."""
    config = RelayConfig(
        port=0,
        database=str(relay_folder(tmp_path) / "hangar.db"),
        drone_token=DRONE_TOKEN,
        demo_user=DEMO_USER,
        ping=relay_ping,
    )
    async with relay_on(config) as relay:
        yield relay


@contextlib.asynccontextmanager
async def demo_page(
    page: Page, relay: RelayHandle, size: tuple[int, int], touch: bool
) -> AsyncIterator[Page]:
    """The demo user's page in a window of ``size`` (a phone's touch screen when ``touch``)."""
    browser = page.context.browser
    assert browser is not None
    context = await browser.new_context(
        viewport={"width": size[0], "height": size[1]}, is_mobile=touch, has_touch=touch
    )
    try:
        opened = await context.new_page()
        await log_in(opened, relay, DEMO_USER, "admin")
        await opened.goto(relay.url + "/")
        await expect(opened.locator("#connection")).to_have_attribute(
            "data-state", "connected", timeout=WAIT_MS
        )
        await expect(opened.locator("#demo-note")).to_be_visible()
        yield opened
    finally:
        await context.close()


async def on_screen(target: Locator) -> bool:
    seen: bool = await target.evaluate(ON_SCREEN)
    return seen


async def conversation_share(page: Page) -> float:
    share: float = await page.evaluate(CONVERSATION_SHARE)
    return share


async def running_turn(page: Page, drone: HandDrone) -> tuple[Locator, str]:
    """A turn that runs, its answer streaming in."""
    turn = await submit(page, "Plan the release")
    turn_id = await drone.next_order()
    assert turn_id == await turn_id_of(turn)
    await drone.text(turn_id, ANSWER)
    await expect(turn.locator(".turn-output")).to_contain_text("step by step", timeout=WAIT_MS)
    await expect(page.locator("#interrupt")).to_be_visible()
    return turn, turn_id


async def form_buttons_on_screen(page: Page) -> None:
    buttons = page.locator("#prompt-form button:visible")
    assert await buttons.count() >= 3  # Cancel, Interrupt and send, Queue at least
    for button in await buttons.all():
        name = " ".join((await button.inner_text()).split())
        assert await on_screen(button), f"the prompt form's {name!r} is off screen"


@pytest.mark.parametrize(
    ("size", "touch", "name"),
    [((667, 375), True, "phone-landscape"), ((640, 400), False, "desktop-zoom-200")],
)
async def test_a_short_screen_keeps_the_answer_and_the_approval_card_in_view(
    page: Page, relay: RelayHandle, size: tuple[int, int], touch: bool, name: str
) -> None:
    async with HandDrone(relay.url) as drone, demo_page(page, relay, size, touch) as short:
        turn, turn_id = await running_turn(short, drone)
        await form_buttons_on_screen(short)
        share = await conversation_share(short)
        await short.screenshot(path=artifact(f"short-{name}-running.png"))
        assert share >= 0.4, f"the conversation has {share:.0%} of the height"

        await waiting(drone, turn_id, "c1", "run_shell", command="make test")
        approve = turn.locator(".approval").get_by_role("button", name="Approve")
        # The prompt was empty: the card takes the keyboard (Enter approves), its buttons in sight.
        await expect(turn.locator(".approval")).to_be_focused()
        await short.screenshot(path=artifact(f"short-{name}-approval.png"))
        assert await on_screen(approve), "the focused card's Approve button is out of sight"
        await form_buttons_on_screen(short)
        assert await conversation_share(short) >= 0.4
        await assert_no_sideways_scroll(short, size[0])


async def test_a_phone_in_portrait_gives_the_demo_most_of_its_height_to_the_conversation(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone, demo_page(page, relay, (375, 667), True) as phone:
        header = await phone.locator(".sidebar").bounding_box()
        assert header is not None and header["height"] <= 0.25 * 667, header
        await expect(phone.locator("#demo-note")).to_contain_text("Demo")
        await expect(phone.get_by_role("button", name="New session", exact=True)).to_be_visible()
        await expect(phone.locator("#sessions-toggle")).to_be_visible()
        await expect(phone.locator("#drone")).to_be_visible()

        await running_turn(phone, drone)
        await form_buttons_on_screen(phone)
        await phone.screenshot(path=artifact("short-phone-portrait-running.png"))
        share = await conversation_share(phone)
        assert share >= 0.5, f"the conversation has {share:.0%} of the height"
        await assert_no_sideways_scroll(phone, 375)


async def test_at_320_by_256_every_button_can_be_reached_and_the_answer_read(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone, demo_page(page, relay, (320, 256), False) as tiny:
        turn, turn_id = await running_turn(tiny, drone)
        new_session = tiny.get_by_role("button", name="New session", exact=True)
        for button in [*await tiny.locator("#prompt-form button:visible").all(), new_session]:
            await button.scroll_into_view_if_needed()
            name = " ".join((await button.inner_text()).split())
            assert await on_screen(button), f"{name!r} cannot be reached"
        await tiny.locator("#submit").scroll_into_view_if_needed()
        share = await conversation_share(tiny)
        await tiny.screenshot(path=artifact("short-reflow-320x256-running.png"))
        assert share >= 0.4, f"the conversation has {share:.0%} of the height"

        await tiny.locator("#prompt").focus()
        await waiting(drone, turn_id, "c1", "run_shell", command="make test")
        approve = turn.locator(".approval").get_by_role("button", name="Approve")
        await expect(turn.locator(".approval")).to_be_focused()
        assert await on_screen(approve), "the focused card's Approve button is out of sight"
        await assert_no_sideways_scroll(tiny, 320)


@pytest.mark.parametrize(
    ("size", "scheme"),
    [((667, 375), "light"), ((844, 390), "dark"), ((932, 430), "light")],
    ids=["667x375", "844x390", "932x430"],
)
async def test_a_phone_held_sideways_has_the_one_row_header_and_its_sessions_in_a_drawer(
    page: Page, relay: RelayHandle, size: tuple[int, int], scheme: Literal["light", "dark"]
) -> None:
    """Most phones held sideways are wider than 720 px: they got the desktop's sidebar, where the
    list of sessions was a box 109 px tall inside a sidebar that had to be scrolled to it, one
    session in sight at a time."""
    user = await relay.relay.accounts.user(DEMO_USER) or await relay.relay.accounts.add_user(
        DEMO_USER, None, "admin"
    )
    now = time.time()
    for n in range(6):
        session = SessionRecord(f"s_{n:04d}", user.user_id, f"Session {n}", now - 60 * n)
        await relay.relay.store.create_session(session)
    async with HandDrone(relay.url) as drone, demo_page(page, relay, size, True) as phone:
        await phone.emulate_media(color_scheme=scheme)
        header = await phone.locator(".sidebar").bounding_box()
        assert header is not None and header["height"] <= 0.25 * size[1], header
        toggle = phone.locator("#sessions-toggle")
        await expect(toggle).to_be_visible()
        await running_turn(phone, drone)
        await form_buttons_on_screen(phone)
        share = await conversation_share(phone)
        await phone.screenshot(path=artifact(f"short-phone-sideways-{size[0]}-running.png"))
        assert share >= 0.5, f"the conversation has {share:.0%} of the height"

        await toggle.click()

        await expect(phone.locator("#sessions .session").first).to_be_focused()
        titles = phone.locator("#sessions .session-title")
        for n in range(4):  # the running turn's session and three more, whole
            await expect(titles.nth(n)).to_be_in_viewport(ratio=1)
        await phone.screenshot(path=artifact(f"short-phone-sideways-{size[0]}-sessions.png"))
        await assert_no_sideways_scroll(phone, size[0])
