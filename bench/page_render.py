"""The page drawing a long streamed answer: does it keep up?

One relay and one drone (subprocesses, SQLite), a local OpenAI-SSE peer in this process that
streams a Markdown answer of ``--tokens`` tokens (prose, lists, tables and Python code blocks, a
token being about four characters) at ``--interval`` seconds per token, and the real page in
headless Chromium (Playwright) with the answer's session open. For each pace it reports:

- **last delta → drawn**: from the page receiving the answer's last ``workOrderProgress`` to the
  answer's last word being in the page's DOM (a MutationObserver's stamp, both ``performance.now()``
  in the page);
- **main thread busy**: the share of wall time the renderer's main thread ran tasks while the
  answer streamed (Chromium's ``TaskDuration`` metric, over the DevTools protocol);
- **long tasks**: tasks over 50 ms (PerformanceObserver ``longtask``), and the longest;
- **one whole render**: what drawing the final answer at once costs, i.e. what re-rendering the
  whole turn on every chunk would cost per chunk at the end of the answer.

    .venv/bin/python -m bench.page_render [--tokens 20000] [--intervals 0.005,0.001,0]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers import OpenAIPeer, Reply

from .common import RELAY_DATABASES, Stack, run_main, table, wait_drones, wait_quiet

CHROMIUM = "/usr/bin/chromium"
END_WORD = "ENDOFANSWER"

CODE = '''```python
def retry(call, attempts: int = 3, delay: float = 0.5):
    """Call ``call`` until it succeeds, at most ``attempts`` times."""
    for attempt in range(attempts):
        try:
            return call()
        except OSError as error:  # transient: try again
            if attempt + 1 == attempts:
                raise
            time.sleep(delay * 2**attempt)
```
'''
SECTION = f"""## Step {{n}}: what changes

The relay keeps **one writer** per turn, so progress is stored in the order it was sent; a
drone that reconnects sends its text again and only what is missing is kept. See `lanes.py`.

- a queued turn ends at once when aborted
- a running one is aborted at the drone, which answers first
- the relay ends it itself after `--abort-grace`

| case | before | after |
|------|-------:|------:|
| idle ack | 3.1 ms | 2.7 ms |
| 200 streams | 19.6 ms | 15.2 ms |

{CODE}
> Keep what is valid: every tool call has a result.

"""


def answer_tokens(count: int) -> list[str]:
    """A Markdown answer cut into ``count`` tokens of about four characters, ending in END_WORD."""
    text = ""
    n = 0
    while len(text) < count * 4:
        n += 1
        text += SECTION.replace("{n}", str(n))
    pieces = [text[i : i + 4] for i in range(0, (count - 1) * 4, 4)]
    return [*pieces, f" {END_WORD}\n"]


async def login_cookie(relay: str) -> str:
    """A login (the page's cookie value) of a new person of the relay at ``relay``."""
    from hangar.server.accounts import Accounts
    from hangar.server.app import open_store

    store = open_store(RELAY_DATABASES[relay])
    await store.open()
    try:
        accounts = Accounts(store)
        user = await accounts.add_user(f"bench-{time.monotonic_ns()}", None)
        return await accounts.log_in(user)
    finally:
        await store.close()


WATCH = """(endWord) => {
    window.__bench = { lastDelta: 0, drawn: 0, longTasks: [] };
    window.hangar.socket.on("workOrderProgress", (ev) => {
        if (ev.kind === "text") window.__bench.lastDelta = performance.now();
    });
    new PerformanceObserver((list) => {
        for (const entry of list.getEntries()) window.__bench.longTasks.push(entry.duration);
    }).observe({ type: "longtask" });
    const turns = document.getElementById("turns");
    // Only what changed is read (the whole answer's text per change would be the cost measured).
    const has = (node) => (node.nodeType === Node.TEXT_NODE ? node.data : node.textContent ?? "")
        .includes(endWord);
    const seen = new MutationObserver((records) => {
        const done = records.some((r) => r.type === "characterData"
            ? has(r.target) : [...r.addedNodes].some(has));
        if (done && !window.__bench.drawn) {
            window.__bench.drawn = performance.now();
            seen.disconnect();
        }
    });
    seen.observe(turns, { childList: true, subtree: true, characterData: true });
}"""

WHOLE_RENDER = """async () => {
    const { markdown, renderTokens } = await import("/static/markdown.js");
    const turnId = document.querySelector("#turns article.turn:last-child").dataset.turnId;
    const source = window.hangar.answerText(turnId);
    const start = performance.now();
    const box = document.createElement("div");
    box.append(renderTokens(markdown.lexer(source), { settled: true }));
    return performance.now() - start;
}"""


async def one_answer(
    page: Any, cdp: Any, peer: OpenAIPeer, tokens: list[str], interval: float
) -> list[object]:
    peer.script(Reply(chunks=tokens, delay=interval))
    await page.click("#new-session")
    await page.evaluate(WATCH, END_WORD)
    await cdp.send("Performance.enable")
    before = {m["name"]: m["value"] for m in (await cdp.send("Performance.getMetrics"))["metrics"]}
    started = time.monotonic()
    await page.fill("#prompt", f"Write {len(tokens)} tokens")
    await page.press("#prompt", "Enter")
    await page.wait_for_function("() => window.__bench.drawn > 0", timeout=600_000, polling=200)
    wall = time.monotonic() - started
    after = {m["name"]: m["value"] for m in (await cdp.send("Performance.getMetrics"))["metrics"]}
    found: dict[str, Any] = await page.evaluate("() => window.__bench")
    await page.wait_for_function("() => window.hangar.processingTurnId() === null", timeout=60_000)
    whole_ms: float = await page.evaluate(WHOLE_RENDER)
    busy = (after["TaskDuration"] - before["TaskDuration"]) / wall
    script = (after["ScriptDuration"] - before["ScriptDuration"]) / wall
    layout = sum(after[k] - before[k] for k in ("LayoutDuration", "RecalcStyleDuration")) / wall
    long_tasks = found["longTasks"]
    pace = f"{interval * 1000:g} ms/token" if interval else "as fast as it comes"
    return [
        pace,
        f"{wall:.1f} s",
        f"{found['drawn'] - found['lastDelta']:.1f} ms",
        f"{busy:.0%} ({script:.0%} script, {layout:.0%} style and layout)",
        f"{len(long_tasks)}, longest {max(long_tasks, default=0):.0f} ms",
        f"{whole_ms:.0f} ms",
    ]


async def main_async(args: argparse.Namespace) -> None:
    from playwright.async_api import async_playwright

    from hangar.server.access import LOGIN_COOKIE

    tokens = answer_tokens(args.tokens)
    workdir = Path(args.logs or tempfile.mkdtemp(prefix="hangar-page-render-"))
    stack = Stack(workdir)
    rows: list[list[object]] = []
    try:
        async with OpenAIPeer() as peer:
            relay, _ = await stack.relay("relay")
            stack.drone(relay, "openai", peer.base_url, concurrency=1, name="drone")
            await wait_drones(relay, 1)
            cookie = await login_cookie(relay)
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(
                    executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
                )
                context = await browser.new_context(viewport={"width": 1280, "height": 800})
                await context.add_cookies([{"name": LOGIN_COOKIE, "value": cookie, "url": relay}])
                page = await context.new_page()
                await page.goto(relay + "/")
                await page.wait_for_function(
                    "() => document.getElementById('connection').dataset.state === 'connected'"
                )
                cdp = await context.new_cdp_session(page)
                quiet = await wait_quiet()
                for interval in args.intervals:
                    rows.append(await one_answer(page, cdp, peer, tokens, interval))
                await browser.close()
    finally:
        stack.stop()
    chars = sum(len(t) for t in tokens)
    print(f"\n{args.tokens:,} tokens ({chars:,} characters) of Markdown; {quiet}\n")
    print(
        table(
            [
                "pace",
                "stream",
                "last delta → drawn",
                "main thread busy",
                "long tasks",
                "one whole render",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument(
        "--intervals",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.005, 0.001, 0.0],
        help="seconds between tokens, one run each (0: as fast as the peer can send)",
    )
    parser.add_argument("--logs", help="keep the processes' logs in this folder")
    run_main(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
