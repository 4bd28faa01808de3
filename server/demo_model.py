"""The offline demo model: an OpenAI-compatible streaming endpoint with a canned, slow answer.

It lets ``hangar demo`` run the whole real path (openai SDK, HTTP stream, hard cancel on abort)
on a machine with no model. Everything it says is labelled as a demo.

Some prompts make it call the drone's tools, as a real model would (``TOOL_PROMPTS``): list
the files, run a command (which waits for the person's approval on a default drone, and takes a
few seconds, so an abort can land in the middle of it), write a note, or hand a task to a
sub-agent. After a tool's result it answers with what the tool said.
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


COUNT_SLOWLY = "echo 'Counting to five, slowly:'; for i in 1 2 3 4 5; do echo $i; sleep 1; done"
NOTE = "# A note from the demo model\n\nWritten by a tool call.\n"
TOOL_PROMPTS: list[tuple[str, str, dict[str, str]]] = [
    (r"\b(sub-?agents?|delegate)\b", "spawn_subagent",
     {"task": "List the files in the work directory and say what you found."}),
    (r"\b(run|command|shell)\b", "run_shell", {"command": COUNT_SLOWLY}),
    (r"\b(write|note)\b", "write_file", {"path": "demo-note.md", "content": NOTE}),
    (r"\b(files?|list)\b", "list_directory", {"path": "."}),
]  # fmt: skip
"""Words in a prompt that make the demo model call a tool (first match wins), and the call."""
TOOL_ANSWER = (
    "[demo model] The tool {name} answered:\n\n{fence}\n{result}\n{fence}\n\n"
    "That is how a real model works with the drone's tools: it asks, the drone runs the tool "
    "(after your approval, where the drone's policy says to ask), and the result comes back."
)


def add_demo_model(app: web.Application) -> None:
    app.router.add_post(f"{DEMO_PATH}/chat/completions", chat_completions)
    app.router.add_get(f"{DEMO_PATH}/models", models)


NOT_A_REQUEST = {
    "message": "A chat completion request is a JSON object with a list of messages.",
    "type": "invalid_request_error",
}
"""What the demo model answers a body that is none (400), as OpenAI's API answers one."""


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": DEMO_MODEL, "object": "model", "owned_by": "hangar"}]}
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except ValueError:  # not JSON, or not UTF-8
        body = None
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(body, dict) or not isinstance(messages, list) or not messages:
        return web.json_response({"error": NOT_A_REQUEST}, status=400)
    prompt = _last_user_text(messages)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    call = _tool_call(prompt) if body.get("tools") and last.get("role") == "user" else None
    if last.get("role") == "tool":
        result = str(last.get("content") or "")[:600]
        # A fence longer than any run of backticks in the result: a sub-agent's answer with a
        # code block of its own stays inside this one.
        longest = max((len(run) for run in re.findall(r"`+", result)), default=0)
        fence = "`" * max(3, longest + 1)
        text = TOOL_ANSWER.format(name=_tool_name(messages, last), result=result, fence=fence)
    else:
        text = ANSWER.format(prompt=prompt[:200])
    words = re.findall(r"\S+\s*", text)
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
        if call is not None:
            name, arguments = call
            await asyncio.sleep(WORD_DELAY * 5)
            delta = {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": f"call_demo_{uuid.uuid4().hex[:12]}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)},
                    }
                ]
            }
            await response.write(chunk(delta))
            await response.write(chunk({}, "tool_calls"))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        for word in words:
            await asyncio.sleep(WORD_DELAY)
            await response.write(chunk({"content": word}))
        await response.write(chunk({}, "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the drone closed the stream: an abort, exactly what the demo shows off
    return response


def _tool_call(prompt: str) -> tuple[str, dict[str, str]] | None:
    """The tool a prompt asks for, by its words (``TOOL_PROMPTS``)."""
    for pattern, name, arguments in TOOL_PROMPTS:
        if re.search(pattern, prompt, re.IGNORECASE):
            return name, arguments
    return None


def _tool_name(messages: list[Any], result: dict[str, Any]) -> str:
    """The name of the tool whose result ``result`` is (OpenAI's tool messages carry only the
    call's id)."""
    for message in messages:
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            if isinstance(call, dict) and call.get("id") == result.get("tool_call_id"):
                return str(call.get("function", {}).get("name") or "tool")
    return str(result.get("name") or "tool")


def _last_user_text(messages: list[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""
