"""The page's protocol module (web/protocol.js), run in Node, against shared/protocol.py: the same
constants, and the same session titles and completion statuses for tricky inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any, get_args

import pytest

from hangar.server.rooms import session_title
from hangar.shared import protocol
from hangar.shared.protocol import (
    EndReason,
    TextDelta,
    ToolActivity,
    TurnStatus,
    completion_status,
)
from hangar.shared.wire import shows
from tests.conftest import ROOT, ci

PROTOCOL_JS = ROOT / "web" / "protocol.js"
NODE_TIMEOUT = 30

# Constants the page exports under the same name as shared/protocol.py.
SAME_NAME = [
    "IDE_NAMESPACE",
    "SUBMIT_WORK_ORDER",
    "ABORT_WORK_ORDER",
    "APPROVE_TOOL_CALL",
    "LIST_SESSIONS",
    "OPEN_SESSION",
    "RENAME_SESSION",
    "DELETE_SESSION",
    "LIST_DRONES",
    "HELLO",
    "LOGGED_OUT",
    "TURN_QUEUED",
    "TURN_ENDED",
    "TURN_STARTED",
    "TURN_STOPPING",
    "WORK_ORDER_PROGRESS",
    "WORK_ORDER_COMPLETE",
    "DRONES",
    "SESSION_CHANGED",
    "SESSION_REMOVED",
    "RESYNC",
    "ABORTED",
    "ABORT_SIGNALED",
    "STOP_AFTER_STEP",
    "TOOL_CANCELLED",
    "TOOL_NOT_RUN",
    "NO_SUCH_CALL",
    "MAX_PROMPT_CHARS",
    "NOT_LOGGED_IN",
    "UNKNOWN_SESSION",
    "ID_PATTERN",
]

# What Python's str.strip() removes and str.splitlines() splits on (whitespace too), plus
# JavaScript's own whitespace (U+FEFF: trimmed by String.prototype.trim, no whitespace to Python).
PY_SPACES = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
PY_LINE_BREAKS = [c for c in PY_SPACES if len(f"a{c}b".splitlines()) > 1]
JS_ONLY_SPACES = ["\ufeff"]

FAMILY = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # five code points, one glyph
TITLE_CASES = [
    "",
    " ",
    "   \t\n  ",
    "\n\n",
    "\r\n\r\n",
    "Hello",
    "\x00abc",
    "\x1b[31mred\x1b[0m",
    "\x00\nSecond line",
    "tab\tand\x7fdel\x85next",
    "\x9f" + "a" * 60,
    "  Hello, drone  ",
    "Hello\nworld",
    "\n\n  \nHello\nworld",
    "Line one\r\nLine two",
    "Line one\rLine two",
    "Line one  \r\n  Line two",
    "a" * 59,
    "a" * 60,
    "a" * 61,
    "a" * 200,
    "a" * 60 + "\nmore",
    "a" * 61 + "\r\nmore",
    "   " + "a" * 60 + "   ",
    "😀" * 59,
    "😀" * 60,
    "😀" * 61,
    "a" * 59 + "😀",
    "a" * 59 + "😀b",
    "a" * 60 + "😀",
    "a" * 58 + "😀😀😀",
    "😀" * 59 + "ab",
    "𝒳𝒴𝒵" * 20,
    "𝒳𝒴𝒵" * 21,
    "a" * 57 + FAMILY,
    "e\u0301" * 31,
    "\ud800 a lone surrogate",
    "a" * 59 + "\udc00b",
    "Hello\x1fworld",
    "\x00\x7f\nNUL first",
    "Tab\there",
    "\u200b\u200e\n  \nPlan the release  \nlater",
    "\ufeff\u2060\u3164\u2800",
    "\u200bx",
    "\u115f\r\n\u1160\r\n a\u200b ",
    *(f"{c}x{c}y{c}" for c in PY_SPACES + JS_ONLY_SPACES),
    *(c * 3 for c in PY_SPACES + JS_ONLY_SPACES),
    *(f"first{c}second" for c in PY_LINE_BREAKS),
    *(f"{c}{c}first{c}second{c}" for c in PY_LINE_BREAKS),
]

COMPLETION_CASES: list[tuple[bool, str]] = [
    (True, protocol.ABORTED),
    (True, "Aborted"),
    (True, "aborted "),
    (True, ""),
    (True, "Finished"),
    (True, protocol.ABORT_SIGNALED),
    (False, protocol.ABORTED),
    (False, ""),
    (False, "The drone disconnected."),
]

SHOW_CASES = [
    "",
    " ",
    "x",
    " \t\n",
    "\u200b\u200b",
    "\u200e \ufeff\u2060\u200d",
    "\u3164\u2800\uffa0",
    "\u115f\u1160",
    "\x1c\x1d\x1e\x1f",
    "\x00",
    "\x00\x01\x7f\x85\x9f",
    "a\x00",
    "\u00ad",
    "\u200bx",
    "\u05d0",
    "\u3000",
    "😀",
    "\ud800",
    "\u061c",
    "\u180e",
]
"""Texts the relay refuses as prompts (``shows``) or takes; the page must say the same."""


SCRIPT = """
import * as protocol from %s;
let input = "";
for await (const chunk of process.stdin) input += chunk;
const cases = JSON.parse(input);
const constants = {};
const functions = [];
for (const [name, value] of Object.entries(protocol)) {
  if (typeof value === "function") functions.push(name);
  else constants[name] = value;
}
process.stdout.write(JSON.stringify({
  constants,
  functions,
  titles: cases.titles.map((prompt) => protocol.sessionTitle(prompt)),
  statuses: cases.completions.map(([ok, message]) => protocol.completionStatus(ok, message)),
  shown: cases.shows.map((text) => protocol.shows(text)),
}));
"""


def node() -> str:
    path = shutil.which("node")
    if path is not None:
        return path
    message = "NODE NOT FOUND: web/protocol.js is not checked against shared/protocol.py"
    if ci():
        pytest.fail(f"{message}; a missing node is a failure when CI is set", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def page_protocol() -> dict[str, Any]:
    """What web/protocol.js exports, and what its rules answer for the cases above."""
    script = SCRIPT % json.dumps(PROTOCOL_JS.as_uri())
    cases = {"titles": TITLE_CASES, "completions": COMPLETION_CASES, "shows": SHOW_CASES}
    done = subprocess.run(
        [node(), "--input-type=module", "-e", script],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=NODE_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, f"node failed ({done.returncode}): {done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_page_uses_the_protocol_constants(page_protocol: dict[str, Any]) -> None:
    expected: dict[str, Any] = {name: getattr(protocol, name) for name in SAME_NAME}
    expected["TURN_STATUSES"] = list(get_args(TurnStatus))
    expected["END_REASONS"] = list(get_args(EndReason))
    expected["TEXT_DELTA"] = TextDelta.model_fields["kind"].default
    expected["TOOL_ACTIVITY"] = ToolActivity.model_fields["kind"].default
    # Equal as a whole: a constant the page adds must have its Python counterpart here too.
    assert page_protocol["constants"] == expected


def test_the_page_has_the_two_protocol_rules(page_protocol: dict[str, Any]) -> None:
    assert sorted(page_protocol["functions"]) == ["completionStatus", "sessionTitle", "shows"]


def test_session_title_matches_the_relay(page_protocol: dict[str, Any]) -> None:
    assert len(page_protocol["titles"]) == len(TITLE_CASES)
    mismatches = [
        (prompt, title, session_title(prompt))
        for prompt, title in zip(TITLE_CASES, page_protocol["titles"], strict=True)
        if title != session_title(prompt)
    ]
    assert not mismatches, "(prompt, page's title, relay's title): " + ascii(mismatches)


def test_what_shows_matches_the_relay(page_protocol: dict[str, Any]) -> None:
    page = dict(zip(SHOW_CASES, page_protocol["shown"], strict=True))
    assert page == {text: shows(text) for text in SHOW_CASES}


def test_completion_status_matches_the_relay(page_protocol: dict[str, Any]) -> None:
    expected = [completion_status(success, message) for success, message in COMPLETION_CASES]
    assert page_protocol["statuses"] == expected
