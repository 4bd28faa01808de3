"""The offline demo model: an OpenAI-compatible streaming endpoint with a canned, slow answer.

It lets ``hangar demo`` run the whole real path (openai SDK, HTTP stream, hard cancel on abort)
on a machine with no model. Everything it says is labelled as a demo.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any

from aiohttp import web

DEMO_MODEL = "hangar-demo"
DEMO_PATH = "/demo/v1"
WORD_DELAY = 0.06

ANSWER = (
    "[demo model] This answer comes from Hangar's offline demo model, not a real LLM. "
    "You asked: “{prompt}”. "
    "The words arrive one by one over a real HTTP stream, through the openai SDK on the drone, "
    "then the relay, to this page. Press Cancel, or Esc twice, at any moment: the drone closes "
    "the HTTP stream at once, the turn ends as aborted, and your next request in this session "
    "works as before. To talk to a real model, start a drone with an OpenAI key or an Ollama "
    "server (see the README)."
)


def add_demo_model(app: web.Application) -> None:
    app.router.add_post(f"{DEMO_PATH}/chat/completions", chat_completions)
    app.router.add_get(f"{DEMO_PATH}/models", models)


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": DEMO_MODEL, "object": "model", "owned_by": "hangar"}]}
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt = _last_user_text(body.get("messages", []))
    words = re.findall(r"\S+\s*", ANSWER.format(prompt=prompt[:200]))
    completion_id = f"chatcmpl-demo-{uuid.uuid4().hex[:12]}"
    created = int(time.time())
    model = str(body.get("model") or DEMO_MODEL)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        payload = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(payload)}\n\n".encode()

    if not body.get("stream"):
        message = {"role": "assistant", "content": "".join(words)}
        return web.json_response(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        await response.write(chunk({"role": "assistant", "content": ""}))
        for word in words:
            await asyncio.sleep(WORD_DELAY)
            await response.write(chunk({"content": word}))
        await response.write(chunk({}, "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the drone closed the stream: an abort, exactly what the demo shows off
    return response


def _last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""
