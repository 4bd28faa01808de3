"""Right-to-left text in real Chromium: each block of a person's or a model's text (a prompt, an
answer's paragraphs, lists, quotes and tables, a tool's result, an approval's free text, a
session's title, the prompt being typed) takes its direction from its own words, so a Hebrew
question ends with its "?" on the left and its list's bullets are on the right; code stays left
to right, and so does the page's own chrome."""

from __future__ import annotations

import json

import pytest
from playwright.async_api import Locator, Page, expect

from tests.browser.conftest import artifact, assert_no_sideways_scroll, phone_page
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, has_class, open_hangar, submit
from tests.browser.test_page_render import SCHEMES, still
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser

PROMPT = "ענה בעברית בבקשה?"
ENGLISH = "This paragraph is in English, for comparison."
CODE = "def double(x: int) -> int:\n    return x * 2"
ANSWER = f"""הנה התשובה שלך:

- פריט ראשון ברשימה.
- פריט שני, עם שאלה?

1. שלב אחד.
2. שלב שני.

> ציטוט קצר בעברית.

| שם | ערך |
|----|-----|
| אחד | 1 |

`npm install` מתקין את כל החבילות.

{ENGLISH}

```python
{CODE}
```

זה הכול.
"""
NOTE = "שלום עולם.\nזו שורה שנייה בקובץ."
WHY = "כדי לקרוא את התיעוד של הספרייה."


async def direction(locator: Locator) -> str:
    found: str = await locator.evaluate("(el) => getComputedStyle(el).direction")
    return found


async def directions(locator: Locator) -> list[str]:
    found: list[str] = await locator.evaluate_all(
        "(els) => els.map((el) => getComputedStyle(el).direction)"
    )
    return found


# Where a block's words are drawn in it: how far (px) its text's box is from its left and its
# right edge (its content box); right-to-left text hugs the right.
GAPS = """(el) => {
    const range = document.createRange();
    range.selectNodeContents(el);
    const text = range.getBoundingClientRect();
    const box = el.getBoundingClientRect();
    const style = getComputedStyle(el);
    return {
        left: text.left - box.left - parseFloat(style.paddingLeft),
        right: box.right - parseFloat(style.paddingRight) - text.right,
    };
}"""

# Whether the prompt's last character ("?") is drawn to the left of all its other words.
QUESTION_MARK_LEFT = """(el) => {
    const node = el.firstChild;
    const mark = document.createRange();
    mark.setStart(node, node.length - 1);
    mark.setEnd(node, node.length);
    const words = document.createRange();
    words.setStart(node, 0);
    words.setEnd(node, node.length - 1);
    return mark.getBoundingClientRect().right <= words.getBoundingClientRect().left + 1;
}"""


async def hebrew_turn(page: Page, drone: HandDrone) -> tuple[Locator, str]:
    """A Hebrew prompt whose turn read a Hebrew file and has a call waiting for approval (its
    card shown): the turn and its id."""
    turn = await submit(page, PROMPT)
    turn_id = await drone.next_order()
    await drone.tool(turn_id, "c1", "start", arguments=json.dumps({"path": "note.txt"}))
    await drone.tool(turn_id, "c1", "end", result=NOTE)
    why = json.dumps({"url": "https://example.com/docs", "why": WHY})
    await drone.tool(turn_id, "c2", "waiting", name="fetch_url", arguments=why)
    await expect(turn.locator(".approval")).to_be_visible(timeout=WAIT_MS)
    return turn, turn_id


async def test_hebrew_text_reads_right_to_left_and_code_and_chrome_left_to_right(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url, "laptop-1", model="gpt-4.1") as drone:
        await open_hangar(page, relay)
        english = await submit(page, "What is two plus two?")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Four.")
        await drone.complete(turn_id, True, "done")
        await expect(english).to_have_class(has_class("finished"), timeout=WAIT_MS)
        assert await direction(english.locator(".turn-prompt")) == "ltr"
        assert await direction(english.locator(".turn-output p")) == "ltr"
        await page.click("#new-session")
        turn, turn_id = await hebrew_turn(page, drone)

        # What the approval card quotes of the model's words is the model's direction; the
        # card's question and the argument names are the page's.
        card = turn.locator(".approval")
        await card.scroll_into_view_if_needed()
        await page.screenshot(path=artifact("rtl-light-desktop-approval.png"))
        assert await direction(card.locator(".approval-fields dd").last) == "rtl"
        assert await direction(card.locator(".approval-fields dt").last) == "ltr"
        assert await direction(card.locator(".approval-title")) == "ltr"
        await drone.tool(turn_id, "c2", "declined", name="fetch_url")
        await drone.text(turn_id, ANSWER)
        await drone.complete(turn_id, True, "done")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)

        prompt = turn.locator(".turn-prompt")
        assert await direction(prompt) == "rtl"
        assert await prompt.evaluate(QUESTION_MARK_LEFT), "the question's ? is not on its left"

        output = turn.locator(".turn-output")
        hebrew = output.locator("p", has_text="הנה התשובה")
        assert await direction(hebrew) == "rtl"
        gaps = await hebrew.evaluate(GAPS)
        assert gaps["right"] < 2 < gaps["left"], f"Hebrew is not drawn from the right: {gaps}"
        for block in ("ul", "ol", "li", "blockquote", "table", "td"):
            assert set(await directions(output.locator(block))) == {"rtl"}, block
        # A list's bullets and numbers go on the right, in the room made for them there.
        pads = await output.locator("ul").evaluate(
            "(ul) => [getComputedStyle(ul).paddingLeft, getComputedStyle(ul).paddingRight]"
        )
        assert pads[0] == "0px" and pads[1] != "0px", pads
        # A Hebrew sentence that starts with inline code is still Hebrew; the code stays LTR.
        starts_with_code = output.locator("p", has_text="מתקין")
        assert await direction(starts_with_code) == "rtl"
        assert await direction(starts_with_code.locator("code")) == "ltr"

        paragraph = output.locator("p", has_text=ENGLISH)
        assert await direction(paragraph) == "ltr"
        gaps = await paragraph.evaluate(GAPS)
        assert gaps["left"] < 2 < gaps["right"], f"English is not drawn from the left: {gaps}"
        for part in (".code-block", ".code-block pre", ".code-block code"):
            assert await direction(output.locator(part)) == "ltr", part
        await expect(output.locator(".code-block code")).to_have_text(CODE)

        # A tool's result is free text; the tool's line is the page's.
        tool = turn.locator(".tool").first
        await tool.locator("summary").click()
        assert await direction(tool.locator(".tool-result-body")) == "rtl"
        assert await direction(tool.locator(".tool-result-preview span")) == "rtl"
        assert await direction(tool.locator(".tool-head")) == "ltr"

        # Session titles: the list's and the heading.
        titles = page.locator("#sessions .session-title")
        await expect(titles).to_have_text([PROMPT, "What is two plus two?"])
        assert await directions(titles) == ["rtl", "ltr"]
        assert await direction(page.locator("#session-title")) == "rtl"

        # The page's own chrome stays left to right.
        for chrome in ("#submit", ".turn-foot", ".turn-head", "#prompt-form", "#sessions-heading"):
            assert await direction(page.locator(chrome).first) == "ltr", chrome
        assert await direction(turn.locator(".turn-foot")) == "ltr"

        # The prompt being typed takes the direction of what is typed in it.
        composer = page.locator("#prompt")
        assert await direction(composer) == "ltr"
        await composer.fill("שאלה נוספת?")
        assert await direction(composer) == "rtl"
        await composer.fill("Another question?")
        assert await direction(composer) == "ltr"
        await composer.fill("שאלה נוספת?")  # shown in the screenshots

        await screenshots(page, relay, turn)


async def screenshots(page: Page, relay: RelayHandle, turn: Locator) -> None:
    """The Hebrew turn on a desktop and a phone, light and dark, for a person to look at."""
    await turn.evaluate("(el) => el.scrollIntoView({ block: 'start' })")
    for scheme in SCHEMES:
        await page.emulate_media(color_scheme=scheme)
        await still(page)
        await page.screenshot(path=artifact(f"rtl-{scheme}-desktop.png"))
    session = await page.evaluate("() => window.hangar.currentSessionId()")
    for scheme in SCHEMES:
        async with phone_page(
            page, relay, f"/#s={session}", color_scheme=scheme, device_scale_factor=2
        ) as phone:
            shown = phone.locator("#turns article.turn")
            await expect(shown.locator(".code-block")).to_have_count(1, timeout=WAIT_MS)
            assert await direction(phone.locator("#sessions-toggle-title")) == "rtl"
            await assert_no_sideways_scroll(phone, 375)
            await shown.first.evaluate("(el) => el.scrollIntoView({ block: 'start' })")
            await still(phone)
            await phone.screenshot(path=artifact(f"rtl-{scheme}-phone.png"))
            code = shown.locator(".code-block")
            await code.evaluate("(el) => el.scrollIntoView({ block: 'end' })")
            await still(phone)
            await phone.screenshot(path=artifact(f"rtl-{scheme}-phone-end.png"))
            if scheme == "light":
                await phone.click("#sessions-toggle")
                drawer = phone.locator("#sessions-panel")
                await expect(drawer).to_have_attribute("data-open", "true")
                await still(phone)
                await phone.screenshot(path=artifact("rtl-light-phone-sessions.png"))
