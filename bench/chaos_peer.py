"""The chaos benchmark's model service: an OpenAI SSE peer (``bench.peers``) whose answer is
derived from a marker in the prompt, so the benchmark knows every turn's full reply, and which
counts the requests of each turn and round.

A prompt starts ``[<marker> <kind>]``; the reply to the turn's first model call (round 0) and,
for ``tool``, to the call after the tool result (round 1) is fixed by the marker alone. Kinds:
``text`` (0.5-2 s of text), ``long`` (5-8 s), ``tool`` (a little text and a ``run_shell`` call
that sleeps 1-3 s, then an answer), ``check`` (a short answer: the follow-ups at the end). Each
chunk names its marker, so text of one turn in another's would show.

``GET /chaos/requests`` lists the chat requests seen: marker, round, wall-clock start, chunks
sent, whether the client hung up, and the 400 refusal of an invalid history, if any.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import random
import re
import time
from typing import Any

from aiohttp import web

from bench.peers import OpenAIPeer, RecordedRequest, Reply, ScriptedToolCall
from hangar.shared import runtime

PROMPT = re.compile(r"^\[(\w+) (text|long|tool|check)\]")
FIRST_TOKEN = 0.25
"""Seconds before the first chunk, as a hosted model's time to first token."""

_request: contextvars.ContextVar[RecordedRequest] = contextvars.ContextVar("request")


def prompt(marker: str, kind: str) -> str:
    return f"[{marker} {kind}] Tell me about {marker}."


def _pieces(marker: str, start: int, count: int) -> list[str]:
    return [f"{marker}.{i} " for i in range(start, start + count)]


def rounds(marker: str, kind: str) -> list[tuple[list[str], float | None]]:
    """Each model call's chunks, and the seconds of the ``run_shell`` sleep it asks for."""
    pick = random.Random(marker)
    if kind == "check":
        return [(_pieces(marker, 0, 5), None)]
    if kind == "long":
        return [(_pieces(marker, 0, pick.randint(170, 260)), None)]
    if kind == "tool":
        before = _pieces(marker, 0, pick.randint(3, 8))
        return [(before, pick.choice((1.0, 2.0, 3.0))), (_pieces(marker, 100, 30), None)]
    return [(_pieces(marker, 0, pick.randint(15, 60)), None)]


def full_text(marker: str, kind: str) -> str:
    """What a turn's stored text is when it finished: its assistant text over all rounds."""
    return "".join("".join(chunks) for chunks, _ in rounds(marker, kind))


def identify(messages: list[dict[str, Any]]) -> tuple[str, str, int] | None:
    """(marker, kind, round) of a chat request: the marker of its last user message, and how
    many assistant messages follow that message."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return None
    found = PROMPT.match(str(messages[last].get("content", "")))
    if found is None:
        return None
    later = sum(1 for m in messages[last + 1 :] if m.get("role") == "assistant")
    return found.group(1), found.group(2), later


class ChaosPeer(OpenAIPeer):
    def __init__(self, pace: float) -> None:
        super().__init__()
        self.pace = pace
        self.wall_offset = time.time() - time.monotonic()

    async def _chat(self, request: web.Request, rec: RecordedRequest) -> web.StreamResponse:
        _request.set(rec)  # read by next_reply, called by the parent without an await between
        return await super()._chat(request, rec)

    def next_reply(self) -> Reply:
        found = identify(_request.get().messages)
        if found is None:
            return Reply(chunks=["unknown "], delay=self.pace)
        marker, kind, index = found
        chunks, sleep = rounds(marker, kind)[min(index, len(rounds(marker, kind)) - 1)]
        calls = [ScriptedToolCall("run_shell", {"command": f"sleep {sleep:g}"})] if sleep else []
        return Reply(chunks=chunks, delay=self.pace, stall_before=FIRST_TOKEN, tool_calls=calls)

    def report(self) -> list[dict[str, Any]]:
        rows = []
        for rec in self.requests:
            if rec.path != "/v1/chat/completions":
                continue
            marker, kind, index = identify(rec.messages) or ("", "", -1)
            rows.append(
                {
                    "marker": marker,
                    "kind": kind,
                    "round": index,
                    "started": rec.started + self.wall_offset,
                    "chunks": rec.chunks_sent,
                    "completed": rec.completed,
                    "disconnected": rec.disconnected,
                    "rejected": rec.rejected,
                }
            )
        return rows

    def _add_routes(self, app: web.Application) -> None:
        super()._add_routes(app)

        async def requests(request: web.Request) -> web.Response:
            return web.json_response(self.report())

        app.router.add_get("/chaos/requests", requests)


async def serve(pace: float) -> None:
    async with ChaosPeer(pace) as peer:
        print(f"PEER {peer.base_url}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pace", type=float, default=0.03, help="seconds between chunks")
    with contextlib.suppress(KeyboardInterrupt):
        runtime.run(serve(parser.parse_args().pace))


if __name__ == "__main__":
    main()
