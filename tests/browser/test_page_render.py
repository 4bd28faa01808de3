"""How answers look and what a person can do with them, in real Chromium: Markdown rendered
(headings, emphasis, tables, highlighted code) while it streams, untrusted model and tool text
kept inert, copy buttons that fill the clipboard, retry, edit-and-resend, ArrowUp recall, and
tool badges that tell each state apart."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
from playwright.async_api import Page, expect

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from hangar.shared.protocol import TOOL_CANCELLED
from tests.browser.conftest import artifact, assert_no_sideways_scroll, phone_page
from tests.browser.hand_drone import HandDrone
from tests.browser.test_page import (
    WAIT_MS,
    has_class,
    open_hangar,
    stored,
    submit,
    turn_id_of,
)
from tests.conftest import RelayHandle, Upstream

pytestmark = pytest.mark.browser

ANSWER = """# Plan

Some **bold** words, *emphasis* and `inline code`.

| file | lines |
|------|------:|
| app.py | 120 |

```python
def double(x: int) -> int:
    return x * 2
```

1. first
2. second

> a quote
"""

HOSTILE = (
    'Look: <img src=x onerror="window.__pwned = (window.__pwned || 0) + 1">\n\n'
    "[click me](javascript:window.__pwned=1) and "
    '<a href="javascript:window.__pwned=1">raw link</a>\n\n'
    "<script>window.__pwned = 1</script>\n\n"
    '![pic](javascript:window.__pwned=1) <svg onload="window.__pwned=1"></svg>\n\n'
    "[ok](https://example.com/docs)\n"
)

SCHEMES: tuple[Literal["light", "dark"], ...] = ("light", "dark")


def split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def still(page: Page) -> None:
    """Wait until no fade or transition is under way (a theme change starts some)."""
    await page.wait_for_function(
        """() => document.getAnimations().every(
            (a) => a.playState !== "running" || a.effect?.getTiming().iterations === Infinity
        )"""
    )


async def grant_clipboard(page: Page, relay: RelayHandle) -> None:
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=relay.url)


async def clipboard(page: Page) -> str:
    text: str = await page.evaluate("() => navigator.clipboard.readText()")
    return text


async def test_an_answer_streams_in_as_markdown_with_highlighted_code(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(Reply(chunks=split(ANSWER, 7), delay=0.02))
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    turn = await submit(page, "Show me markdown")
    output = turn.locator(".turn-output")

    await expect(output.locator("h1")).to_have_text("Plan", timeout=WAIT_MS)
    await expect(output.locator("table")).to_have_count(1, timeout=WAIT_MS)
    heading = await output.locator("h1").element_handle()
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    # Rendered block by block: the heading, once blocks follow it, is never drawn again.
    assert await page.evaluate("(h) => h.isConnected", heading)
    await expect(output.locator("strong")).to_have_text("bold")
    await expect(output.locator("em")).to_have_text("emphasis")
    await expect(output.locator("p code")).to_have_text("inline code")
    await expect(output.locator("table th")).to_have_text(["file", "lines"])
    await expect(output.locator("table td")).to_have_text(["app.py", "120"])
    await expect(output.locator("ol li")).to_have_text(["first", "second"])
    await expect(output.locator("blockquote")).to_have_text("a quote")
    code = output.locator("pre code")
    await expect(code).to_have_text("def double(x: int) -> int:\n    return x * 2")
    await expect(code.locator(".hljs-keyword").first).to_have_text("def")
    await expect(output.locator(".code-block")).to_have_attribute("data-lang", "python")
    assert "**" not in (await output.text_content() or "")
    assert "```" not in (await output.text_content() or "")
    font = await output.locator("p").first.evaluate("(p) => getComputedStyle(p).fontFamily")
    assert "mono" not in font.lower(), f"prose is not monospace: {font}"
    await page.screenshot(path=artifact("render-markdown.png"), full_page=True)


PROSE_IN_CODE = (
    "```\nThe sub-agent listed the work directory: nothing in it.\nIt then wrote a note, as asked,"
    " and read it back to check it.\n(empty directory)\n```\n\n"
    "[js](javascript:alert(1)) [data](data:text/html,hi) [ok](https://example.com/)\n"
)


async def test_an_unlabelled_block_of_prose_is_not_coloured_and_a_dropped_link_reads_as_text(
    page: Page, relay: RelayHandle
) -> None:
    """Only a confident guess colours an unlabelled code block (prose is not "vbnet"), and a
    link whose address was dropped as unsafe is shown as the plain text it is, not as a link
    that does nothing."""
    await open_hangar(page, relay)
    found: dict[str, Any] = await page.evaluate(
        """async (text) => {
            const { MarkdownView } = await import("/static/markdown-view.js");
            const out = document.createElement("div");
            const view = new MarkdownView(out);
            view.append(text);
            view.finish();
            const block = out.querySelector(".code-block");
            return {
                lang: block.dataset.lang,
                coloured: block.querySelectorAll("code span").length,
                links: [...out.querySelectorAll("a")].map((a) => [a.textContent, a.href]),
                text: out.querySelector("p").textContent,
            };
        }""",
        PROSE_IN_CODE,
    )

    assert (found["lang"], found["coloured"]) == ("", 0)
    assert found["links"] == [["ok", "https://example.com/"]]
    assert found["text"] == "js data ok"


async def test_streamed_markdown_renders_as_the_whole_answer_would(
    page: Page, relay: RelayHandle
) -> None:
    await open_hangar(page, relay)
    tricky = (
        ANSWER
        + "\n1. one\n\n2. two\n\nSetext\n======\n\n[ref]: https://example.com/ref\n"
        + "See [ref].\n\n- a\n  - nested\n\n```\nno language\n```\n\nEnd."
    )
    for size in (1, 3, 17):
        same: bool = await page.evaluate(
            """async ([text, size]) => {
                const { MarkdownView } = await import("/static/markdown-view.js");
                const whole = document.createElement("div");
                const streamed = document.createElement("div");
                const a = new MarkdownView(whole);
                a.append(text);
                a.finish();
                const b = new MarkdownView(streamed);
                for (let i = 0; i < text.length; i += size) {
                    b.append(text.slice(i, i + size));
                    b.render();
                }
                b.finish();
                return whole.innerHTML === streamed.innerHTML;
            }""",
            [tricky, size],
        )
        assert same, f"chunks of {size} render differently from the whole answer"


async def test_model_and_tool_text_cannot_run_script_or_links(
    page: Page,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    tmp_path: Path,
) -> None:
    planted = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
    (tmp_path / "evil.html").write_text(planted)
    hostile_call = ScriptedToolCall("read_file", {"path": "evil.html", "why": "<svg onload=x>"})
    openai_peer.script(
        Reply(chunks=[], tool_calls=[hostile_call]),
        Reply(chunks=split(HOSTILE, 11)),
    )
    await start_drone(Upstream("openai", openai_peer), workdir=str(tmp_path))
    await open_hangar(page, relay)
    turn = await submit(page, "Be hostile")
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    output = turn.locator(".turn-output")

    await expect(output.locator("img, script, svg, iframe")).to_have_count(0)
    for link in await output.locator("a").all():
        href = await link.get_attribute("href") or ""
        assert not href.lower().startswith("javascript:"), href
        await expect(link).to_have_attribute("rel", "noopener noreferrer nofollow")
    await expect(output.locator('a[href="https://example.com/docs"]')).to_have_text("ok")
    await expect(output).to_contain_text('<img src=x onerror="window.__pwned')  # shown as text
    await output.get_by_text("click me").click()
    await output.get_by_text("raw link").click()
    # The tool's arguments and its result (the planted file) are shown as the text they are.
    tool = turn.locator(".tool")
    await expect(tool.locator(".tool-args")).to_contain_text("<svg onload=x>")
    await tool.locator("summary").click()
    await expect(tool.locator(".tool-result-body")).to_have_text(planted)
    assert await page.evaluate("() => window.__pwned") is None


async def test_copy_buttons_put_the_code_and_the_answer_on_the_clipboard(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(Reply(chunks=split(ANSWER, 40)))
    await start_drone(Upstream("openai", openai_peer))
    await grant_clipboard(page, relay)
    await open_hangar(page, relay)
    turn = await submit(page, "Code please")
    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)

    copy_code = turn.get_by_role("button", name="Copy code")
    await copy_code.click()
    assert await clipboard(page) == "def double(x: int) -> int:\n    return x * 2"
    await expect(copy_code).to_have_attribute("data-copied", "true")

    copy_answer = turn.get_by_role("button", name="Copy answer")
    await copy_answer.click()
    assert await clipboard(page) == ANSWER
    record = await stored(relay, await turn_id_of(turn), "finished")
    assert record.text == ANSWER


async def test_the_arrows_move_the_caret_in_a_recalled_prompt_of_several_lines(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    """A recalled prompt of several lines can be edited: ArrowUp and ArrowDown move the caret
    between its lines, and walk the earlier prompts only from its first or last line."""
    openai_peer.script(Reply(chunks=["One."]), Reply(chunks=["Three."]))
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    prompt = page.locator("#prompt")
    await expect(await submit(page, "first")).to_have_class(has_class("finished"), timeout=WAIT_MS)
    lines = "alpha\nbeta\ngamma"
    await expect(await submit(page, lines)).to_have_class(has_class("finished"), timeout=WAIT_MS)

    async def caret_line() -> int:
        before: str = await prompt.evaluate("p => p.value.slice(0, p.selectionStart)")
        return before.count("\n")

    await prompt.focus()
    await page.keyboard.press("ArrowUp")
    await expect(prompt).to_have_value(lines)
    assert await caret_line() == 2
    await page.keyboard.press("ArrowUp")
    await expect(prompt).to_have_value(lines)
    assert await caret_line() == 1
    await page.keyboard.press("ArrowDown")
    await expect(prompt).to_have_value(lines)
    assert await caret_line() == 2
    await page.keyboard.press("ArrowUp")
    await page.keyboard.press("ArrowUp")
    assert await caret_line() == 0
    await page.keyboard.press("ArrowUp")  # from its first line: the prompt before it
    await expect(prompt).to_have_value("first")
    await page.keyboard.press("ArrowDown")
    await expect(prompt).to_have_value(lines)
    await page.keyboard.press("ArrowDown")  # from its last line: back to an empty composer
    await expect(prompt).to_have_value("")


async def test_retry_edit_and_recall_send_earlier_prompts_again(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(
        Reply(chunks=["First answer."]),
        Reply(chunks=[], status=400, error_message="upstream broke"),
        Reply(chunks=["Retried answer."]),
        Reply(chunks=["Edited answer."]),
        Reply(chunks=["Recalled answer."]),
    )
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    prompt = page.locator("#prompt")
    turns = page.locator("#turns article.turn")
    first = await submit(page, "What is two plus two?")
    await expect(first).to_have_class(has_class("finished"), timeout=WAIT_MS)
    failed = await submit(page, "Name a prime")
    await expect(failed).to_have_class(has_class("error"), timeout=2 * WAIT_MS)

    # Retry after an error: a new turn with the same prompt.
    await failed.get_by_role("button", name="Retry").click()
    await expect(turns).to_have_count(3, timeout=WAIT_MS)
    retried = turns.nth(2)
    await expect(retried.locator(".turn-prompt")).to_have_text("Name a prime")
    await expect(retried).to_have_class(has_class("finished"), timeout=WAIT_MS)
    await expect(retried.locator(".turn-output")).to_have_text("Retried answer.")
    await expect(prompt).to_have_value("")

    # Edit: only the last prompt offers it; it fills the composer, Enter sends a new turn.
    await expect(first.get_by_role("button", name="Edit")).to_have_count(0)
    await retried.get_by_role("button", name="Edit").click()
    await expect(prompt).to_have_value("Name a prime")
    await expect(prompt).to_be_focused()
    await page.keyboard.press("End")
    await page.keyboard.type(" above ten")
    await page.keyboard.press("Enter")
    await expect(turns).to_have_count(4, timeout=WAIT_MS)
    await expect(turns.nth(3).locator(".turn-prompt")).to_have_text("Name a prime above ten")
    await expect(turns.nth(3)).to_have_class(has_class("finished"), timeout=WAIT_MS)

    # ArrowUp in the empty composer walks back through the session's prompts; ArrowDown returns.
    await prompt.focus()
    await page.keyboard.press("ArrowUp")
    await expect(prompt).to_have_value("Name a prime above ten")
    await page.keyboard.press("ArrowUp")
    await expect(prompt).to_have_value("Name a prime")
    await page.keyboard.press("ArrowUp")
    await expect(prompt).to_have_value("What is two plus two?")
    await page.keyboard.press("ArrowDown")
    await expect(prompt).to_have_value("Name a prime")
    await page.keyboard.press("ArrowDown")
    await page.keyboard.press("ArrowDown")
    await expect(prompt).to_have_value("")
    await page.keyboard.press("ArrowUp")
    await page.keyboard.press("ArrowUp")
    await page.keyboard.press("Enter")
    await expect(turns).to_have_count(5, timeout=WAIT_MS)
    await expect(turns.nth(4).locator(".turn-prompt")).to_have_text("Name a prime")
    await expect(turns.nth(4).locator(".turn-output")).to_have_text(
        "Recalled answer.", timeout=WAIT_MS
    )
    # A composer with text of its own keeps ArrowUp for moving the caret.
    await prompt.fill("draft")
    await page.keyboard.press("ArrowUp")
    await expect(prompt).to_have_value("draft")
    assert [r.messages[-1]["content"] for r in openai_peer.requests] == [
        "What is two plus two?",
        "Name a prime",
        "Name a prime",
        "Name a prime above ten",
        "Name a prime",
    ]


REPLACE_DRAFT = "Replace your draft?"


async def test_edit_pressed_again_at_once_after_keep_my_draft_still_replaces_when_told(
    page: Page, relay: RelayHandle
) -> None:
    """A dialog's close event is queued, not sent at once: Edit pressed again right after "Keep
    my draft" took that late event for its own answer (keep), and "Replace draft" then
    replaced nothing. (Seen once as a failure of the test below, in a full run.)"""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Name a prime")
        turn_id = await drone.next_order()
        await drone.complete(turn_id, True, "Seven.")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        prompt = page.locator("#prompt")
        await prompt.fill("My own draft")
        dialog = page.get_by_role("dialog", name=REPLACE_DRAFT)
        await turn.get_by_role("button", name="Edit").click()
        await expect(dialog).to_be_visible()

        await page.evaluate(
            """() => {
                document.querySelector("dialog[open] button[value=keep]").click();
                document.querySelector('#turns article.turn [data-action="edit"]').click();
            }"""
        )
        await expect(dialog).to_be_visible()
        await dialog.get_by_role("button", name="Replace draft").click()

        await expect(dialog).to_be_hidden()
        await expect(prompt).to_have_value("Name a prime")


async def test_edit_asks_before_replacing_an_unsent_draft(page: Page, relay: RelayHandle) -> None:
    """A person half way through typing a follow-up who presses Edit on the last prompt does not
    lose what they typed without saying so; an empty composer, or one holding that very prompt,
    is filled at once as before."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Name a prime")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Seven.")
        await drone.complete(turn_id, True, "Done.")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        prompt = page.locator("#prompt")
        draft = "And now one above a hundred, with\na proof that it is prime"
        await prompt.fill(draft)
        edit = turn.get_by_role("button", name="Edit")
        dialog = page.get_by_role("dialog", name=REPLACE_DRAFT)
        keep = dialog.get_by_role("button", name="Keep my draft")

        await edit.click()

        await expect(dialog).to_be_visible()
        await expect(dialog).to_have_accessible_description(
            "What you typed and have not sent, “And now one above a hundred, with a proof that it"
            " is prime”, would be replaced by the earlier prompt."
        )
        # The turn's foot is drawn again meanwhile (its drone went): its Edit button is new.
        await drone.client.disconnect()
        await expect(page.locator("#drone-summary")).to_have_text(
            "No drones online.", timeout=WAIT_MS
        )
    await expect(keep).to_be_focused()  # the safe answer is the default one
    await expect(prompt).to_have_value(draft)
    await page.keyboard.press("Escape")  # Esc keeps the draft
    await expect(dialog).to_be_hidden()
    await expect(prompt).to_have_value(draft)
    await expect(edit).to_be_focused()  # back where the person was

    await edit.click()
    await keep.click()
    await expect(dialog).to_be_hidden()
    await expect(prompt).to_have_value(draft)

    await edit.press("Enter")
    await dialog.get_by_role("button", name="Replace draft").click()
    await expect(dialog).to_be_hidden()
    await expect(prompt).to_have_value("Name a prime")
    await expect(prompt).to_be_focused()

    # Nothing of the person's own to lose: no question.
    await edit.click()
    await expect(prompt).to_have_value("Name a prime")
    await prompt.fill("  ")
    await edit.click()
    await expect(prompt).to_have_value("Name a prime")
    await expect(prompt).to_be_focused()
    await expect(dialog).to_be_hidden()


async def test_retry_after_an_abort_sends_the_prompt_again(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    openai_peer.script(Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03), Reply())
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    turn = await submit(page, "Try this again")
    await expect(turn.locator(".turn-output")).to_contain_text("w0 w1 ", timeout=WAIT_MS)
    await page.click("#cancel")
    await expect(turn).to_have_class(has_class("aborted"), timeout=WAIT_MS)

    await turn.get_by_role("button", name="Retry").click()

    again = page.locator("#turns article.turn").nth(1)
    await expect(again.locator(".turn-prompt")).to_have_text("Try this again", timeout=WAIT_MS)
    await expect(again.locator(".turn-output")).to_have_text("Hello world", timeout=WAIT_MS)


async def test_tool_badges_tell_running_done_failed_and_cancelled_apart(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Use some tools")
        turn_id = await drone.next_order()
        args = json.dumps({"path": "notes.txt"})
        await drone.tool(turn_id, "c1", "start", arguments=args)
        await drone.tool(turn_id, "c1", "end", result="the notes")
        await drone.tool(turn_id, "c2", "start", arguments=args)
        await drone.tool(turn_id, "c2", "end", result="Error: There is no file 'gone.txt'.")
        await drone.tool(turn_id, "c3", "start", name="run_shell")
        await drone.tool(turn_id, "c3", "error", name="run_shell", result="Error: it broke")
        await drone.tool(turn_id, "c4", "cancelled", name="run_shell", result=TOOL_CANCELLED)
        await drone.tool(turn_id, "c5", "start", name="fetch_url")

        badge = turn.locator(".tool .tool-badge")
        await expect(badge).to_have_text(["done", "failed", "failed", "cancelled", "running"])
        states = turn.locator(".tool")
        await expect(states).to_have_count(5)
        for index, state in enumerate(["end", "error", "error", "cancelled", "start"]):
            await expect(states.nth(index)).to_have_attribute("data-badge", state)
        colours = [
            await b.evaluate("(el) => getComputedStyle(el).color") for b in await badge.all()
        ]
        assert colours[0] != colours[1], "done and failed look alike"
        assert colours[1] == colours[2] and colours[3] not in (colours[0], colours[1])

        # "waiting for approval" and "declined" are drawn too (the wire will carry them).
        names: list[str] = await page.evaluate(
            """async () => {
                const { ToolLine } = await import("/static/tool-line.js");
                return ["waiting", "declined"].map((state) => {
                    const line = new ToolLine(`x-${state}`, 0);
                    line.update({ name: "run_shell", state });
                    return `${line.el.dataset.badge}:${line.badgeEl.textContent}`;
                });
            }"""
        )
        assert names == ["waiting:waiting for approval", "declined:declined"]
        await drone.complete(turn_id, True, "done")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        # The call still running when the turn finished is not left "running".
        await expect(badge).to_have_text(["done", "failed", "failed", "cancelled", "done"])


SHOWCASE = """Two changes make the login check safe to retry:

1. **Hash once** per attempt, off the event loop.
2. Count failures *per address* as well as per user name.

```python
async def check_login(store: Store, name: str, password: str) -> bool:
    \"\"\"True when the password matches; failures are counted.\"\"\"
    user = await store.user(name)
    if user is None:
        return False  # same answer as a wrong password
    return await asyncio.to_thread(verify, user.hash, password)
```

Run `make check` before you push.
"""


async def build_showcase(page: Page, relay: RelayHandle, drone: HandDrone) -> None:
    """One session with a finished answer (Markdown, code, tools), an aborted turn and a
    running one: every look a turn has."""
    await open_hangar(page, relay)
    finished = await submit(page, "Make the login check safe to retry")
    turn_id = await drone.next_order()
    args = json.dumps({"path": "server/access.py"})
    await drone.tool(turn_id, "c1", "start", arguments=args)
    await drone.tool(turn_id, "c1", "end", result="async def check_login(...)")
    await drone.tool(turn_id, "c2", "start", name="run_shell", arguments='{"command": "pytest -q"}')
    await drone.tool(turn_id, "c2", "error", name="run_shell", result="Error: 2 failed")
    await drone.text(turn_id, SHOWCASE)
    await drone.complete(turn_id, True, "done")
    await expect(finished).to_have_class(has_class("finished"), timeout=WAIT_MS)

    aborted = await submit(page, "Now rewrite the whole accounts module")
    turn_id = await drone.next_order()
    await drone.text(turn_id, "Starting with `accounts.py`: the first thing to go is")
    await expect(aborted.locator(".turn-output")).to_contain_text("the first thing")
    await page.click("#cancel")
    await drone.abort_asked.wait()
    await drone.complete(turn_id, True, "aborted")
    await expect(aborted).to_have_class(has_class("aborted"), timeout=WAIT_MS)


async def test_the_page_fits_desktop_and_phone_in_both_themes(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url, "laptop-1", model="gpt-4.1") as drone:
        await build_showcase(page, relay, drone)
        session = await page.evaluate("() => window.hangar.currentSessionId()")
        for scheme in SCHEMES:
            await page.emulate_media(color_scheme=scheme)
            await page.locator("#prompt").focus()
            await still(page)
            await page.screenshot(path=artifact(f"page-{scheme}-desktop.png"))
        await page.emulate_media(color_scheme="light")
        running = await submit(page, "Add a test for the unknown user case")
        turn_id = await drone.next_order()
        await drone.tool(
            turn_id, "c3", "start", name="write_file", arguments='{"path": "tests/test_login.py"}'
        )
        await drone.text(turn_id, "Writing the test now; it checks that")
        await expect(running.locator(".turn-output")).to_contain_text("it checks that")

        for scheme in SCHEMES:
            async with phone_page(
                page,
                relay,
                f"/#s={session}",
                (390, 844),
                color_scheme=scheme,
                device_scale_factor=2,
            ) as phone:
                await expect(phone.locator("#cancel")).to_be_visible(timeout=WAIT_MS)
                await assert_no_sideways_scroll(phone, 390)
                await still(phone)
                await phone.screenshot(path=artifact(f"page-{scheme}-phone.png"))
        for scheme in SCHEMES:
            await page.emulate_media(color_scheme=scheme)
            await still(page)
            await page.screenshot(path=artifact(f"page-{scheme}-desktop-running.png"))
        drone.answer_aborts.set()


async def test_raw_html_keeps_its_lines_and_a_wide_table_scrolls_on_a_phone(
    page: Page, relay: RelayHandle
) -> None:
    html = "<table>\n  <tr>\n    <td>Name</td>\n  </tr>\n</table>"
    header = "| " + " | ".join(f"column {n}" for n in range(12)) + " |"
    rule = "|" + "---|" * 12
    row = "| " + " | ".join(f"value{n}" for n in range(12)) + " |"
    answer = f"{html}\n\nAnd a paragraph.\n\n{header}\n{rule}\n{row}\n"
    await page.set_viewport_size({"width": 390, "height": 844})
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Show some HTML and a wide table")
        turn_id = await drone.next_order()
        await drone.text(turn_id, answer)
        await drone.complete(turn_id, True, answer)
        output = turn.locator(".turn-output")
        await expect(output.locator("table")).to_have_count(1, timeout=WAIT_MS)

        # The HTML is shown as the text it is, line by line, apart from the next paragraph.
        await expect(output.locator("pre").filter(has_text="<table>")).to_have_text(html)
        await expect(output.locator("p").filter(has_text="And a paragraph.")).to_have_count(1)
        # Each cell keeps its words whole; the table scrolls instead of squeezing them.
        narrowest = await output.locator("td, th").evaluate_all(
            "(cells) => Math.min(...cells.map((c) => c.getBoundingClientRect().width))"
        )
        scrolls = await output.locator("table").evaluate("(t) => t.scrollWidth > t.clientWidth")
        assert narrowest >= 50 and scrolls, (narrowest, scrolls)
        await page.screenshot(path=artifact("phone-html-and-wide-table.png"))


RAW_HTML_LINE = (
    "<section>This raw HTML block has a long line that a phone cannot show whole: word word "
    + "<b>"
    + "x" * 120
    + "</b> and on the desktop "
    + "y" * 260
    + " too: SECRET-END</section>"
)
WIDE_CODE_LINE = "wide = [" + ", ".join(f"'item-{n}'" for n in range(40)) + "]"
RAW_HTML_ANSWER = (
    f"Some **bold** words first.\n\n{RAW_HTML_LINE}\n\n"
    f"```python\n{WIDE_CODE_LINE}\n```\n\nThe end.\n"
)
#: Where a word of a ``pre`` in the answer lies, and the answer's own box.
WORD_BOX_JS = """(output, word) => {
    const pre = [...output.querySelectorAll("pre")].find((p) => p.textContent.includes(word));
    const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
    let node = walker.nextNode();
    while (!node.data.includes(word)) node = walker.nextNode();
    const range = document.createRange();
    range.setStart(node, node.data.indexOf(word));
    range.setEnd(node, node.data.indexOf(word) + word.length);
    const box = range.getBoundingClientRect();
    const card = output.getBoundingClientRect();
    return { left: box.left, right: box.right, cardLeft: card.left, cardRight: card.right };
}"""


async def test_a_long_line_of_raw_html_wraps_inside_the_card_on_a_phone_and_a_desktop(
    page: Page, relay: RelayHandle
) -> None:
    """Raw HTML is shown as the text it is, in a ``pre`` that never wrapped: past the card's right
    edge its words were cut off (the card hides what overflows it) and could not be scrolled to,
    on a phone (390 px) and, for a longer line, on a desktop. A code block still keeps its lines
    whole and scrolls."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Show a long line of raw HTML")
        turn_id = await drone.next_order()
        await drone.text(turn_id, RAW_HTML_ANSWER)
        await drone.complete(turn_id, True, "done")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        session = await page.evaluate("() => window.hangar.currentSessionId()")

        async def check(shown: Page, width: int, name: str) -> None:
            output = shown.locator(".turn .turn-output").last
            raw = output.locator("pre").filter(has_text="SECRET-END")
            await expect(raw).to_have_text(RAW_HTML_LINE)  # all of it, as text
            for word in ("SECRET-END", "y" * 20, "x" * 20):
                box = await output.evaluate(WORD_BOX_JS, word)
                inside = box["cardLeft"] <= box["left"] and box["right"] <= box["cardRight"]
                assert inside, f"{name}: {word[:12]} lies outside the card: {box}"
            await assert_no_sideways_scroll(shown, width)
            code = output.locator(".code-block pre")
            await expect(code).to_have_text(WIDE_CODE_LINE)
            lines = await code.evaluate(
                "(pre) => [pre.scrollWidth > pre.clientWidth, getComputedStyle(pre).whiteSpace]"
            )
            assert lines == [True, "pre"], f"{name}: the code's line should scroll: {lines}"
            await still(shown)
            await shown.screenshot(path=artifact(f"render-raw-html-{name}.png"))

        for scheme in SCHEMES:
            await page.emulate_media(color_scheme=scheme)
            await check(page, 1280, f"desktop-{scheme}")
            async with phone_page(
                page, relay, f"/#s={session}", (390, 844), color_scheme=scheme
            ) as phone:
                await expect(phone.locator(".turn .turn-output pre").first).to_be_visible(
                    timeout=WAIT_MS
                )
                await check(phone, 390, f"phone-{scheme}")


async def test_a_reference_link_defined_at_the_end_of_an_answer_is_a_link(
    page: Page, relay: RelayHandle
) -> None:
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Cite the docs")
        turn_id = await drone.next_order()
        output = turn.locator(".turn-output")
        await drone.text(turn_id, "According to [the Python docs][py], it is so.\n\n")
        await drone.text(turn_id, "More.\n\n")
        await drone.text(turn_id, "And more.\n\n")
        await expect(output.locator("p")).to_have_count(3)
        await drone.text(turn_id, "[py]: https://docs.python.org/3/\n")

        await drone.complete(turn_id, True, "More.")

        link = output.locator('a[href="https://docs.python.org/3/"]')
        await expect(link).to_have_text("the Python docs", timeout=WAIT_MS)
        await expect(output).not_to_contain_text("[py]")


FOOTNOTED = (
    "Footnote[^1] and a [relative link](note), [a page](https://example.com/page) and "
    "[mail](mailto:someone@example.com).\n\n"
    "[^1]: note\n"
)


async def test_a_footnote_keeps_its_note_and_a_relative_link_reads_as_text(
    page: Page, relay: RelayHandle
) -> None:
    """A link in model text goes to an absolute http(s) or mailto address, or is not a link:
    one relative to the page would open the relay's own pages (a 404). A GFM footnote is shown
    as the text it is, its note included, not as a link to "note"."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Cite with a footnote")
        turn_id = await drone.next_order()
        for part in split(FOOTNOTED, 9):
            await drone.text(turn_id, part)
        await drone.complete(turn_id, True, "done")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)

        output = turn.locator(".turn-output")
        links = output.locator("a")
        await expect(links).to_have_text(["a page", "mail"])
        hrefs = await links.evaluate_all("(els) => els.map((a) => a.getAttribute('href'))")
        assert hrefs == ["https://example.com/page", "mailto:someone@example.com"]
        await expect(output.locator("p")).to_have_text(
            [
                "Footnote[^1] and a relative link, a page and mail.",
                "[^1]: note",
            ]
        )


DEEP = "before\n\n" + ">" * 5000 + " deep\n\nafter the deep quote\n"
"""Quotes nested deeper than marked can follow: it runs out of stack (from about 3,000)."""


async def test_markdown_nested_too_deep_to_draw_shows_as_plain_text_and_the_session_opens(
    page: Page, relay: RelayHandle, openai_peer: OpenAIPeer, start_drone: Callable[..., Any]
) -> None:
    """The card stopped at the error ("Maximum call stack size exceeded"): the rest of the
    answer never showed, Cancel stayed, and the session then opened with no turns at all."""
    openai_peer.script(Reply(chunks=split(DEEP, 1000), delay=0.02), Reply(chunks=["Next."]))
    await start_drone(Upstream("openai", openai_peer))
    await open_hangar(page, relay)
    turn = await submit(page, "Quote deeply")

    await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
    output = turn.locator(".turn-output")
    await expect(output).to_contain_text("after the deep quote")
    await expect(output.locator("p").first).to_have_text("before")  # the rest is still Markdown
    await expect(page.locator("#cancel")).to_be_hidden()
    await page.screenshot(path=artifact("render-deep-quote.png"))
    turn_id = await turn_id_of(turn)
    await page.reload()
    again = page.locator(f'#turns article.turn[data-turn-id="{turn_id}"]')
    await expect(again.locator(".turn-output")).to_contain_text(
        "after the deep quote", timeout=WAIT_MS
    )
    await expect(again).to_have_class(has_class("finished"))
    assert (await submit(page, "And now?")) is not None
    await expect(page.locator("#turns article.turn").last).to_contain_text("Next.", timeout=WAIT_MS)


def nested_list(depth: int, text: str) -> str:
    return "".join(f"{'  ' * level}- level {level}\n" for level in range(depth)) + (
        f"{'  ' * depth}- {text}\n"
    )


@pytest.mark.parametrize(
    ("nesting", "size"),
    [
        ("quotes", (390, 844)),
        ("quotes", (1280, 800)),
        ("lists", (390, 844)),
        ("quotes in lists", (390, 844)),
    ],
    ids=["quotes phone", "quotes desktop", "lists phone", "quotes in lists phone"],
)
async def test_text_nested_deep_in_quotes_or_lists_stays_on_the_screen(
    page: Page, relay: RelayHandle, nesting: str, size: tuple[int, int]
) -> None:
    """Each level drew 15 px further in: 25 quotes deep on a phone, the words started beyond its
    edge, out of reach, after a ladder of bars; 150 on a desktop, 2,900 px of ladder. Nesting
    past six levels now indents no further."""
    depth = 150 if size[0] > 1000 else 25
    words = "the important conclusion"
    answer = {
        "quotes": ">" * depth + f" {words}\n",
        "lists": nested_list(depth, words),
        "quotes in lists": "".join(
            f"{'  ' * (2 * level)}- level {level}\n{'  ' * (2 * level + 1)}> "
            + (words if level == depth - 1 else "quoted")
            + "\n"
            for level in range(depth)
        ),
    }[nesting]
    await page.set_viewport_size({"width": size[0], "height": size[1]})
    await page.emulate_media(color_scheme="dark" if nesting == "lists" else "light")
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Nest it deeply")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "Before.\n\n" + answer)
        await drone.complete(turn_id, True, "done")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        output = turn.locator(".turn-output")
        conclusion = output.get_by_text(words, exact=True)
        await expect(conclusion).to_be_visible()

        box = await conclusion.bounding_box()
        card = await output.bounding_box()
        assert box is not None and card is not None
        # The words lie inside the answer's box, most of its width left to them, and the
        # nesting does not stretch the answer far down.
        assert card["x"] <= box["x"] and box["x"] + box["width"] <= card["x"] + card["width"], box
        assert box["x"] - card["x"] < min(card["width"] / 2, 200), (box, card)
        lines = len(answer.splitlines())
        assert card["height"] < 200 + lines * 30, card
        await assert_no_sideways_scroll(page, size[0])
        await page.screenshot(
            path=artifact(f"render-nested-{nesting}-{size[0]}.png".replace(" ", "-"))
        )


async def test_a_tool_calls_whole_arguments_open_from_the_keyboard_or_a_tap(
    page: Page, relay: RelayHandle
) -> None:
    """A long command showed cut ("…") on its line, whole only in a tooltip, which neither a
    keyboard nor a finger can open."""
    command = "grep -rn 'needle' src/ | sort | uniq -c | " + "x" * 150 + " | tail -n 5"
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Run something long")
        turn_id = await drone.next_order()
        await drone.tool(
            turn_id, "c1", "start", name="run_shell", arguments=json.dumps({"command": command})
        )
        await drone.tool(turn_id, "c2", "start", arguments=json.dumps({"path": "a.txt"}))
        args = turn.locator(".tool-args")
        await expect(args.first).to_contain_text("…")
        await expect(args.nth(1)).not_to_have_attribute("role", "button")  # short: whole already

        await args.first.focus()
        await page.keyboard.press("Enter")
        await expect(args.first).to_have_attribute("aria-expanded", "true")
        await expect(args.first).to_contain_text(command)
        await page.screenshot(path=artifact("render-tool-arguments-open.png"))
        await page.keyboard.press("Enter")
        await expect(args.first).to_have_attribute("aria-expanded", "false")
        await expect(args.first).not_to_contain_text(command)
        await args.first.click()  # a tap, on a phone
        await expect(args.first).to_contain_text(command)
        await drone.complete(turn_id, True, "done")


LINKS_JS = """(el) => [...el.querySelectorAll("a")].map((a) => [a.textContent, a.href])"""

REFERENCED = [
    "See the guide [1] and the reference [2].\n\n",
    "[1]: https://example.com/guide\n",
    "[2]: https://example.co",
    "m/reference\n",
]


async def test_reference_definitions_streamed_at_the_end_link_as_after_a_reload(
    page: Page, relay: RelayHandle
) -> None:
    """A definition cut mid-address ("https://example.co" | "m/reference") left [2] linking to
    another domain, or left it as text, until the page was reloaded."""
    expected = [["1", "https://example.com/guide"], ["2", "https://example.com/reference"]]
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Cite")
        turn_id = await drone.next_order()
        output = turn.locator(".turn-output")
        for delta in REFERENCED[:3]:
            await drone.text(turn_id, delta)
        await expect(output.locator('a[href="https://example.co"]')).to_have_text("2")
        await drone.text(turn_id, REFERENCED[3])
        # The definition is whole now: so is the link, before the answer ends too.
        await expect(output.locator("a").nth(1)).to_have_attribute("href", expected[1][1])
        await drone.complete(turn_id, True, "".join(REFERENCED))
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        streamed = await output.evaluate(LINKS_JS)

        await page.reload()
        reloaded = page.locator(".turn .turn-output").last
        await expect(reloaded.locator("a")).to_have_count(2, timeout=WAIT_MS)
        assert streamed == await reloaded.evaluate(LINKS_JS) == expected


async def test_a_block_followed_by_a_growing_definition_is_drawn_again(
    page: Page, relay: RelayHandle
) -> None:
    """Streamed in chunks, each drawn: once the text is whole its links are the whole text's,
    before the end too, and after it."""
    await open_hangar(page, relay)
    # (the text, whether its links are whole before it ends: a definition that came after blocks
    # drawn for good makes links of them only once the answer ends)
    texts = [
        ("".join(REFERENCED), True),
        ("See [x][y].\n\n[y]: https://example.com/why 'The title'\n", True),
        (
            "Intro.\n\nSee [a], [b].\n\nMore.\n\n[a]: https://example.com/a\n[b]: https://e.org/b\n",
            False,
        ),
    ]
    for text, whole_before_the_end in texts:
        for size in (1, 4, 9, 23):
            result = await page.evaluate(
                """async ([text, size]) => {
                    const { MarkdownView } = await import("/static/markdown-view.js");
                    const links = (el) => JSON.stringify(
                        [...el.querySelectorAll("a")].map((a) => [a.textContent, a.href, a.title]),
                    );
                    const whole = document.createElement("div");
                    const a = new MarkdownView(whole);
                    a.append(text);
                    a.finish();
                    const streamed = document.createElement("div");
                    const b = new MarkdownView(streamed);
                    for (let i = 0; i < text.length; i += size) {
                        b.append(text.slice(i, i + size));
                        b.render();
                    }
                    const beforeEnd = links(streamed);
                    b.finish();
                    const same = whole.innerHTML === streamed.innerHTML;
                    return [links(whole), beforeEnd, links(streamed), same];
                }""",
                [text, size],
            )
            want, before_end, after, same = result
            if whole_before_the_end:
                assert before_end == want, f"chunks of {size}: {before_end} != {want}"
            assert after == want and same, f"chunks of {size}: finished differs from the whole"


async def test_copy_works_while_its_code_block_streams(page: Page, relay: RelayHandle) -> None:
    """The open blocks were drawn anew each frame: the button pressed was gone when the mouse
    came up (about 90 ms later), and nothing was copied."""
    await grant_clipboard(page, relay)
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Stream code")
        turn_id = await drone.next_order()
        await drone.text(turn_id, "```python\nprint(1)\nvalue = ")
        button = turn.get_by_role("button", name="Copy code")
        await expect(button).to_be_visible()

        async def click_while(deltas: list[str]) -> None:
            box = await button.bounding_box()
            assert box is not None
            await page.evaluate("() => navigator.clipboard.writeText('')")
            sending = asyncio.ensure_future(send_all(deltas))
            try:
                await page.mouse.click(
                    box["x"] + box["width"] / 2, box["y"] + box["height"] / 2, delay=90
                )
            finally:
                await sending
            await expect(button).to_have_attribute("data-copied", "true")
            assert (await clipboard(page)).startswith("print(1)\n")

        async def send_all(deltas: list[str]) -> None:
            for delta in deltas:
                await drone.text(turn_id, delta)

        # The block itself still streams, then the paragraph after it.
        await click_while([f"{i} + " for i in range(60)])  # on one line: nothing moves
        await drone.text(turn_id, "0\n```\n\nAfter the code")
        await click_while([f" w{i}" for i in range(40)])
        await drone.complete(turn_id, True, "done")


async def test_a_long_tool_name_keeps_the_state_badge_in_the_card(
    page: Page, relay: RelayHandle
) -> None:
    """A name without spaces (95 characters on a phone, 128 on a desktop) pushed the badge out."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Use long tools")
        turn_id = await drone.next_order()
        names = ["n" * 95, "m" * 128]
        for i, name in enumerate(names):
            await drone.tool(
                turn_id, f"c{i}", "error", name=name, arguments='{"a": 1}', result="Error: no"
            )
        for width, height in ((390, 844), (1280, 800)):
            await page.set_viewport_size({"width": width, "height": height})
            for i, name in enumerate(names):
                line = turn.locator(".tool").nth(i)
                await expect(line.locator(".tool-badge")).to_have_text("failed")
                card = await line.bounding_box()
                badge = await line.locator(".tool-badge").bounding_box()
                assert card is not None and badge is not None
                assert badge["x"] + badge["width"] <= card["x"] + card["width"], (width, i)
                await expect(line.locator(".tool-name")).to_have_attribute("title", name)
            await assert_no_sideways_scroll(page, width)
        await drone.complete(turn_id, True, "done")


LONE_SURROGATE = r"[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]"


async def test_a_cut_preview_never_halves_an_emoji(page: Page, relay: RelayHandle) -> None:
    """Previews were cut by UTF-16 units: an emoji across the cut showed as "�"."""
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        turn = await submit(page, "Smile")
        turn_id = await drone.next_order()
        arguments = json.dumps({"q": "a" * 1991 + "😀" * 10}, ensure_ascii=False)
        await drone.tool(turn_id, "c1", "end", arguments=arguments, result="r" * 98 + "😀" * 10)
        line = turn.locator(".tool")
        await expect(line.locator(".tool-result-preview")).to_contain_text("…")
        shown = await line.evaluate(
            """(el, pattern) => [
                el.querySelector(".tool-result-preview").textContent,
                el.querySelector(".tool-args").title,
            ].filter((text) => new RegExp(pattern).test(text))""",
            LONE_SURROGATE,
        )
        assert shown == [], "a preview ends in half an emoji"
        await expect(line.locator(".tool-result-preview")).to_have_text("r" * 98 + "…")
        await drone.complete(turn_id, True, "done")


async def test_a_fence_named_language_x_is_language_x(page: Page, relay: RelayHandle) -> None:
    await open_hangar(page, relay)
    found = await page.evaluate(
        """async () => {
            const { MarkdownView } = await import("/static/markdown-view.js");
            const el = document.createElement("div");
            const view = new MarkdownView(el);
            view.append("```language-python\\nx = 1\\n```\\n");
            view.finish();
            return [el.querySelector("code").classList.contains("language-python"),
                    el.querySelector(".code-block").dataset.lang];
        }"""
    )
    assert found == [True, "python"]


TABLE_ROWS = 2000
#: The longest task while the table streams, at most, as a share of drawing the whole answer
#: once (about 0.2-0.6 measured; the page that drew it whole each frame: 1 or more). A share, not
#: milliseconds: on a busy machine both grow alike.
WHOLE_SHARE = 0.75
DRAW_WHOLE = """async (answer) => {
    const { MarkdownView } = await import("/static/markdown-view.js");
    const el = document.createElement("div");
    el.className = "md";
    document.getElementById("turns").append(el);
    const start = performance.now();
    const view = new MarkdownView(el);
    view.append(answer);
    view.render(true);
    void el.offsetHeight; // laid out, as the page's own drawing is
    const took = performance.now() - start;
    el.remove();
    return took;
}"""


async def test_a_table_of_two_thousand_rows_streams_without_freezing_the_page(
    page: Page, relay: RelayHandle
) -> None:
    """The open end of an answer was drawn again each frame: a table still streaming is one block,
    so each frame parsed, sanitised and drew every row so far, and the page froze."""
    header = "Here are the runs.\n\n| # | name | status | seconds |\n|---:|---|---|---:|\n"
    rows = "".join(f"| {i} | run-{i} | ok | {i * 7 % 97}.5 |\n" for i in range(TABLE_ROWS))
    answer = header + rows + "\nAll done.\n"
    async with HandDrone(relay.url) as drone:
        await open_hangar(page, relay)
        await page.evaluate(
            """() => {
                window.__longest = 0;
                new PerformanceObserver((list) => {
                    for (const entry of list.getEntries()) {
                        window.__longest = Math.max(window.__longest, entry.duration);
                    }
                }).observe({ type: "longtask" });
            }"""
        )
        turn = await submit(page, "Show the runs")
        turn_id = await drone.next_order()
        # About 30 tokens a message, 3,000 tokens a second: faster than a model writes.
        for chunk in split(answer, 120):
            await asyncio.gather(drone.text(turn_id, chunk), asyncio.sleep(0.01))
        await drone.complete(turn_id, True, "done")
        output = turn.locator(".turn-output")
        await expect(turn).to_have_class(has_class("finished"), timeout=WAIT_MS)
        await expect(output.locator("p").last).to_have_text("All done.")
        table = output.locator("table")
        await expect(table).to_have_count(1)
        await expect(table.locator("th")).to_have_text(["#", "name", "status", "seconds"])
        await expect(table.locator("tbody tr")).to_have_count(TABLE_ROWS)
        cells = await table.evaluate(
            """(t) => [...t.tBodies[0].rows].map((row) =>
                [...row.cells].map((cell) => cell.textContent).join(" "))"""
        )
        assert cells == [f"{i} run-{i} ok {i * 7 % 97}.5" for i in range(TABLE_ROWS)]
        # A long task is reported once it has ended: two frames on, any task before has.
        longest: float = await page.evaluate(
            """() => new Promise((done) => requestAnimationFrame(() =>
                requestAnimationFrame(() => setTimeout(() => done(window.__longest)))))"""
        )
        # What drawing the whole answer at once takes on this machine now (the median of 3):
        # the old page took that every frame, so its longest task was never shorter.
        whole = statistics.median([await page.evaluate(DRAW_WHOLE, answer) for _ in range(3)])
        assert longest < WHOLE_SHARE * whole, (
            f"the main thread was busy {longest:.0f} ms at once; drawing the whole answer once"
            f" takes {whole:.0f} ms"
        )
