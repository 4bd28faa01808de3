"""What a running turn's sub-agents streamed, kept for snapshots (``TurnView.sub_agents``).

Sub-agent output exists only as progress events (depth > 0): the drone stores none of it in the
conversation. The drone's relay keeps those events of each running turn in its live state, with
each call of the turn's own agent that may start a sub-agent (a depth-0 tool call starting), so
a page that opens the session mid-turn shows what came before it. ``runs`` builds the snapshot's
shape, which is the page's own (``web/sub-agents.js``): after each depth-0 call, in order, the
text and the tool calls of its sub-agents.
"""

from __future__ import annotations

from typing import Any

MAX_KEPT_CHARS = 500_000
"""Characters of a turn's sub-agent events kept at most (6 MB of JSON at worst, every one an
escaped emoji: a snapshot holds what fits its page, ``snapshots.fitted``); later ones reach only
the pages open at the time."""


def kept_event(payload: dict[str, Any]) -> dict[str, Any] | None:
    """What to keep of a text or tool progress event (as browsers get it) for snapshots, or
    None: nothing (the turn's own text, its own calls but their start)."""
    if payload.get("depth", 0) > 0:
        return {k: v for k, v in payload.items() if k not in ("turnId", "sessionId")}
    if payload["kind"] == "tool" and payload["state"] == "start":
        return {"kind": "tool", "callId": payload["callId"], "depth": 0}
    return None


def runs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{after: callId, parts: [{text, depth} | {tool: {callId, depth, name, arguments, state,
    result}}]}]`` from kept events: consecutive text of one depth in one part, each tool call
    once, as it stands now."""
    built: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] | None = None
    calls: dict[str, dict[str, Any]] = {}
    for event in events:
        depth = event.get("depth", 0)
        if depth == 0:
            parts, calls = [], {}  # a call id names one call within its run
            built.append({"after": event["callId"], "parts": parts})
        elif parts is None:
            continue  # after no call of the turn's own agent (its start was kept elsewhere)
        elif event["kind"] == "text":
            last = parts[-1] if parts else None
            if last is not None and "text" in last and last["depth"] == depth:
                last["text"] += event["text"]
            else:
                parts.append({"text": event["text"], "depth": depth})
        else:
            call = calls.get(event["callId"])
            if call is None:
                call = calls[event["callId"]] = {"callId": event["callId"], "depth": depth}
                parts.append({"tool": call})
            for key in ("name", "arguments", "state", "result"):
                if event.get(key) is not None:
                    call[key] = event[key]
    return [run for run in built if run["parts"]]
