"""The page for people using assistive technology or other devices, in real Chromium: every text
the page draws meets WCAG AA contrast in both themes, turn endings are announced politely (and
no token is), cards are named by their prompt, and the Esc hint shows only with a keyboard."""

from __future__ import annotations

import json
from typing import Any

import pytest
from playwright.async_api import Page, expect

from hangar.shared.protocol import TOOL_CANCELLED
from tests.browser.conftest import artifact, log_in, phone_page
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import WAIT_MS, has_class, open_hangar, submit
from tests.browser.test_page_render import still
from tests.conftest import RelayHandle

pytestmark = pytest.mark.browser

ANSWER = (
    "## Result\n\nSee [the docs](https://example.com/docs) and `make check`.\n\n"
    "> quoted\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
    '```python\nimport os\n\n@cache\ndef f(x: int = 3) -> str:\n    """Doc."""\n'
    "    # a comment\n    return f\"{x}\" + 'y'\n```\n"
)

# The contrast of every text the page draws (text nodes, generated labels, the placeholder)
# against what is behind it, alpha and opacity composited; and 3:1 for the edges of inputs.
CONTRAST = """() => {
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = 1;
    const ctx = canvas.getContext("2d", { willReadFrequently: true });
    const rgba = (css) => {
        ctx.clearRect(0, 0, 1, 1);
        ctx.fillStyle = "rgba(0, 0, 0, 0)";
        ctx.fillStyle = css;
        ctx.fillRect(0, 0, 1, 1);
        const [r, g, b, a] = ctx.getImageData(0, 0, 1, 1).data;
        return [r, g, b, a / 255];
    };
    const over = ([r, g, b, a], under) => [r, g, b].map((v, i) => v * a + under[i] * (1 - a));
    const opacity = (el) => {
        let o = 1;
        for (let e = el; e; e = e.parentElement) o *= parseFloat(getComputedStyle(e).opacity);
        return o;
    };
    const behind = (el) => {
        const chain = [];
        for (let e = el; e; e = e.parentElement) chain.unshift(e);
        let bg = [255, 255, 255];
        for (const e of chain) {
            const c = rgba(getComputedStyle(e).backgroundColor);
            c[3] *= opacity(e);
            bg = over(c, bg);
        }
        return bg;
    };
    const lum = (rgb) => {
        const [r, g, b] = rgb.map((v) => {
            v /= 255;
            return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
        });
        return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const ratio = (a, b) => {
        const [hi, lo] = [lum(a), lum(b)].sort((x, y) => y - x);
        return (hi + 0.05) / (lo + 0.05);
    };
    const name = (el) => {
        const classes = typeof el.className === "string" ? el.className.trim().split(/\\s+/) : [];
        const id = el.id ? "#" + el.id : "";
        return [el.tagName.toLowerCase() + id, ...classes.filter(Boolean)].join(".");
    };
    const large = (style) => {
        const size = parseFloat(style.fontSize);
        return size >= 24 || (size >= 18.66 && parseInt(style.fontWeight, 10) >= 700);
    };
    const shown = (el) => {
        if (!el.checkVisibility({ visibilityProperty: true })) return false;
        if (el.closest("[aria-hidden=true], .visually-hidden, option, noscript")) return false;
        const rect = el.getBoundingClientRect();
        return rect.width > 1 && rect.height > 1;
    };
    const inactive = (el) =>
        el.closest("button:disabled, textarea:disabled, select:disabled") !== null &&
        el.closest("#cancel") === null;
    const results = [];
    const check = (el, colour, bg, text, min) => {
        const fg = over([...rgba(colour).slice(0, 3), rgba(colour)[3] * opacity(el)], bg);
        results.push({ el: name(el), text: text.slice(0, 40), ratio: ratio(fg, bg), min });
    };
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    const seen = new Set();
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const el = node.parentElement;
        if (!node.data.trim() || seen.has(el) || !shown(el) || inactive(el)) continue;
        seen.add(el);
        const style = getComputedStyle(el);
        check(el, style.color, behind(el), node.data.trim(), large(style) ? 3 : 4.5);
    }
    for (const el of document.body.querySelectorAll("*")) {
        if (!shown(el) || inactive(el)) continue;
        for (const pseudo of ["::before", "::after"]) {
            const style = getComputedStyle(el, pseudo);
            const content = style.content;
            if (!content || ["none", "normal"].includes(content) || !/["']/.test(content)) continue;
            const text = content.replace(/attr\\(([^)]+)\\)/g, (_, a) => el.getAttribute(a) ?? "");
            if (!text.replace(/["'\\s]/g, "")) continue;
            const bg = over(rgba(style.backgroundColor), behind(el));
            check(el, style.color, bg, pseudo + " " + text, /[A-Za-z]/.test(text) ? 4.5 : 3);
        }
    }
    for (const el of document.querySelectorAll("textarea, select")) {
        if (!shown(el) || el.disabled) continue;
        const style = getComputedStyle(el);
        const bg = behind(el);
        check(el, style.color, bg, "(typed text)", 4.5);
        if (el.tagName === "TEXTAREA") {
            check(el, getComputedStyle(el, "::placeholder").color, bg, "(placeholder)", 4.5);
        }
        check(el, style.borderTopColor, behind(el.parentElement), "(edge of the input)", 3);
    }
    return results;
}"""


async def contrast_failures(page: Page) -> list[dict[str, Any]]:
    await still(page)  # judge the colours at rest, not halfway through a theme's transition
    results: list[dict[str, Any]] = await page.evaluate(CONTRAST)
    assert len(results) > 20, f"too few texts found to judge: {results}"
    return [r for r in results if r["ratio"] < r["min"]]


async def test_every_text_on_the_page_meets_wcag_aa_contrast_in_both_themes(
    page: Page, relay: RelayHandle
) -> None:
    failures: dict[str, list[dict[str, Any]]] = {}

    async def scan(scene: str) -> None:
        for scheme in ("light", "dark"):
            await page.emulate_media(color_scheme=scheme)
            for failure in await contrast_failures(page):
                failures.setdefault(f"{scene}, {scheme}", []).append(failure)
            await page.screenshot(path=artifact(f"a11y-{scene.replace(' ', '-')}-{scheme}.png"))

    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        await scan("empty page")

        finished = await submit(page, "Explain with code")
        turn_id = await drone.next_order()
        await drone.text(turn_id, ANSWER)
        args = json.dumps({"path": "notes.txt"})
        await drone.tool(turn_id, "c1", "start", arguments=args)
        await drone.tool(turn_id, "c1", "end", result="the notes")
        await drone.tool(turn_id, "c2", "start", arguments=args)
        await drone.tool(turn_id, "c2", "end", result="Error: There is no file.")
        await drone.tool(turn_id, "c3", "cancelled", result=TOOL_CANCELLED)
        await drone.text(turn_id, "Sub-agent words", depth=1)
        await drone.complete(turn_id, True, "done")
        await expect(finished).to_have_class(has_class("finished"), timeout=WAIT_MS)
        await finished.locator(".tool summary").first.click()
        await page.evaluate(
            """async () => {
                const { ToolLine } = await import("/static/tool-line.js");
                const output = document.querySelector("#turns article.turn .turn-output");
                for (const state of ["waiting", "declined"]) {
                    const line = new ToolLine(`x-${state}`, 0);
                    line.update({ name: "run_shell", state });
                    output.append(line.el);
                }
            }"""
        )

        aborted = await submit(page, "Start, then stop")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Partial answer")
        await drone.tool(turn_id, "a1", "start", arguments=args)
        await drone.tool(turn_id, "a1", "end", result="the notes")
        await expect(aborted.locator(".tool-badge")).to_have_text("done")
        await page.click("#cancel")
        await drone.abort_asked.wait()
        await drone.complete(turn_id, True, "aborted")
        await expect(aborted).to_have_class(has_class("aborted"), timeout=WAIT_MS)

        failed = await submit(page, "Fail, please")
        turn_id = await drone.next_order()
        await drone.complete(turn_id, False, "The model service failed.")
        await expect(failed).to_have_class(has_class("error"), timeout=WAIT_MS)

        running = await submit(page, "Keep running")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Working on it")
        await drone.tool(turn_id, "c9", "start", name="run_shell")
        await expect(running.locator(".tool-badge")).to_have_text("running")
        queued = await submit(page, "A follow-up")
        await expect(queued).to_have_class(has_class("queued"))
        await page.keyboard.press("Escape")
        await page.evaluate(
            """async () => {
                const { toast } = await import("/static/ui.js");
                toast("Something went wrong.", { error: true, duration: 0 });
                document.getElementById("jump-latest").hidden = false;
            }"""
        )
        await scan("turns of every kind")

        drone.answer_aborts.clear()
        await page.click("#cancel")
        await expect(page.locator("#cancel")).to_have_text("Aborting…")
        await scan("aborting")
        drone.answer_aborts.set()
        await page.emulate_media(color_scheme="light")
        await still(page)
        await page.screenshot(path=artifact("a11y-light.png"))

    assert not failures, "contrast below WCAG AA:\n" + "\n".join(
        f"{scene}: {f['el']} {f['text']!r} {f['ratio']:.2f}:1 < {f['min']}:1"
        for scene, found in failures.items()
        for f in found
    )


async def record_announcements(page: Page) -> None:
    await page.evaluate(
        """() => {
            const region = document.getElementById("announcer");
            window.__said = [];
            new MutationObserver(() => {
                const text = region.textContent.trim();
                if (text) window.__said.push(text);
            }).observe(region, { childList: true, subtree: true, characterData: true });
        }"""
    )


async def said(page: Page) -> list[str]:
    found: list[str] = await page.evaluate("() => window.__said.slice()")
    return found


async def test_turn_endings_are_announced_and_tokens_are_not(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        region = page.locator("#announcer")
        await expect(region).to_have_attribute("aria-live", "polite")
        await record_announcements(page)

        turn = await submit(page, "Fix the login bug\nand add a test for it")
        await expect(page.get_by_role("article", name="Fix the login bug")).to_have_count(1)
        turn_id = await drone.next_order()
        for word in ["Looking ", "at ", "the ", "login ", "code."]:
            await drone.text(turn_id, word)
        await expect(turn.locator(".turn-output")).to_have_text("Looking at the login code.")
        live = await turn.locator(".turn-output").evaluate("(el) => el.closest('[aria-live]')")
        assert live is None, "streamed output is not a live region"
        assert await said(page) == []
        await drone.complete(turn_id, True, "done")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        await page.wait_for_function("() => window.__said.length >= 1")
        assert await said(page) == ["Answer finished."]

        second = await submit(page, "Another try")
        await expect(page.get_by_role("article", name="Another try")).to_have_count(1)
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Partial")
        await expect(second.locator(".turn-output")).to_have_text("Partial")
        await page.click("#cancel")
        await drone.abort_asked.wait()
        await drone.complete(turn_id, True, "aborted")
        await expect(second).to_have_class(has_class("aborted"), timeout=WAIT_MS)
        await page.wait_for_function("() => window.__said.length >= 2")

        third = await submit(page, "And fail")
        turn_id = await drone.next_order()
        await drone.complete(turn_id, False, "The model service failed.")
        await expect(third).to_have_class(has_class("error"), timeout=WAIT_MS)
        await page.wait_for_function("() => window.__said.length >= 3")
        assert await said(page) == [
            "Answer finished.",
            "Turn aborted.",
            "Turn failed: The model service failed.",
        ]


async def test_the_esc_hint_shows_with_a_keyboard_and_not_on_a_phone(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        await submit(page, "Run on the desktop")
        await drone.next_order()
        await expect(page.locator("#cancel")).to_be_visible()
        await expect(page.locator("#esc-hint")).to_be_visible()

        session = await page.evaluate("() => window.hangar.currentSessionId()")
        async with phone_page(page, relay, f"/#s={session}", (390, 844)) as phone:
            await expect(phone.locator("#cancel")).to_be_visible(timeout=WAIT_MS)
            await expect(phone.locator("#esc-hint")).to_be_hidden()
            await expect(phone.locator(".keyboard-only").first).to_be_hidden()
            await phone.screenshot(path=artifact("a11y-phone.png"))


# Whether the focused element's ring (its outline) is drawn whole: inside every box around it
# that clips what overflows it.
RING_WHOLE = """() => {
    const el = document.activeElement;
    const style = getComputedStyle(el);
    const out = parseFloat(style.outlineOffset) + parseFloat(style.outlineWidth);
    const r = el.getBoundingClientRect();
    const ring = {
        left: r.left - out, top: r.top - out, right: r.right + out, bottom: r.bottom + out,
    };
    for (let box = el.parentElement; box; box = box.parentElement) {
        const s = getComputedStyle(box);
        if (s.overflowX === "visible" && s.overflowY === "visible") continue;
        const b = box.getBoundingClientRect();
        const inner = {
            left: b.left + box.clientLeft, top: b.top + box.clientTop,
            right: b.left + box.clientLeft + box.clientWidth,
            bottom: b.top + box.clientTop + box.clientHeight,
        };
        if (ring.left < inner.left - 0.5 || ring.top < inner.top - 0.5
            || ring.right > inner.right + 0.5 || ring.bottom > inner.bottom + 0.5) {
            return `${el.textContent.trim()} cut by ${box.id || box.className}`;
        }
    }
    return style.outlineStyle === "none" ? `${el.textContent.trim()} has no ring` : "";
}"""


async def test_the_focus_ring_of_every_sidebar_control_is_drawn_whole(
    page: Page, relay: RelayHandle
) -> None:
    """The "Mine" / "Everyone" switch clipped its buttons' rings to a sliver, and the list of
    sessions the top of its first one's: a keyboard user could barely tell where focus was."""
    await log_in(page, relay, "root", "admin")  # an admin: the switch shows
    await page.goto(relay.url + "/")
    for prompt in ("First", "Second"):
        await submit(page, prompt)
        await page.click("#new-session")
    await expect(page.locator("#sessions .session")).to_have_count(2, timeout=WAIT_MS)

    await page.focus("#sessions-search")
    seen = []
    for step, key in enumerate(("Shift+Tab", "Shift+Tab", "Tab", "Tab", "Tab", "Tab")):
        await page.keyboard.press(key)
        seen.append(await page.evaluate(RING_WHOLE))
        if step in (1, 4):
            shot = artifact(f"a11y-sidebar-focus-{step}.png")
            await page.screenshot(path=shot, clip={"x": 0, "y": 0, "width": 300, "height": 420})
    assert seen == [""] * len(seen)
