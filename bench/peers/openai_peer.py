"""A local stand-in for the OpenAI Chat Completions API (SSE streaming wire format)."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from typing import Any

from aiohttp import web

from .base import RecordedRequest, Reply, UpstreamPeer, arguments_text, dumps, random_id

SERVER_ERROR_MESSAGE = "The server had an error while processing your request. Sorry about that!"


def error_body(message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": None}}


TOOL_WITHOUT_CALL = (
    "Invalid parameter: messages with role 'tool' must be a response "
    "to a preceeding message with 'tool_calls'."
)
UNANSWERED_CALLS = (
    "An assistant message with 'tool_calls' must be followed by tool messages "
    "responding to each 'tool_call_id'. The following tool_call_ids did not "
    "have response messages: {ids}"
)


NAME_PATTERN = "^[a-zA-Z0-9_-]+$"
MAX_NAME = 64
BAD_NAME = (
    "Invalid '{param}': string does not match pattern. Expected a string that matches the "
    f"pattern '{NAME_PATTERN}'."
)
LONG_NAME = (
    "Invalid '{param}': string too long. Expected a string with maximum length "
    f"{MAX_NAME}, but got a string with length {{length}} instead."
)


def _bad_name(calls: list[Any], i: int) -> tuple[str, str] | None:
    """A past call's name the service refuses (its pattern, or past its length)."""
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        param = f"messages[{i}].tool_calls[{j}].function.name"
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            return BAD_NAME.format(param=param), param
        if len(name) > MAX_NAME:
            return LONG_NAME.format(param=param, length=len(name)), param
    return None


def validate_messages(messages: Any) -> tuple[str, str] | None:
    """Check tool-call pairing and names like the real service; returns ``(message, param)``."""
    if messages is None:
        return "Missing required parameter: 'messages'.", "messages"
    if not isinstance(messages, list):
        return "Invalid type for 'messages': expected an array.", "messages"
    if not messages:
        return "[] is too short - 'messages'", "messages"
    pending: list[str] = []  # ids of the open tool-call block still lacking answers
    block: set[str] = set()  # ids of the open tool-call block
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if call_id not in block:
                return TOOL_WITHOUT_CALL, f"messages.[{i}].role"
            if call_id in pending:
                pending.remove(call_id)
            continue
        if pending:
            return UNANSWERED_CALLS.format(ids=", ".join(pending)), f"messages.[{i}].role"
        calls = msg.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and (bad := _bad_name(calls, i)) is not None:
            return bad
        pending = [str(c.get("id")) for c in calls or [] if isinstance(c, dict)]
        block = set(pending)
    if pending:
        return UNANSWERED_CALLS.format(ids=", ".join(pending)), "messages"
    return None


def split_pieces(text: str, pieces: int) -> list[str]:
    """Split ``text`` into ``pieces`` (at most ``len(text)``) contiguous parts."""
    pieces = max(1, min(pieces, len(text) or 1))
    size, extra = divmod(len(text), pieces)
    out: list[str] = []
    pos = 0
    for i in range(pieces):
        end = pos + size + (1 if i < extra else 0)
        out.append(text[pos:end])
        pos = end
    return out


ROLES_MUST_ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
"""What vLLM answers (400) when the model's chat template (Mistral's, Gemma's) refuses two
user messages in a row."""


class OpenAIPeer(UpstreamPeer):
    """Serves ``POST /v1/chat/completions`` and ``GET /v1/models``.

    ``alternating``: as a compatible server whose chat template requires alternating roles.
    """

    def __init__(
        self,
        *,
        default: Reply | None = None,
        models: tuple[str, ...] = ("gpt-4o-mini",),
        host: str = "127.0.0.1",
        port: int = 0,
        alternating: bool = False,
    ) -> None:
        super().__init__(default=default, models=models, host=host, port=port)
        self.system_fingerprint = random_id("fp_", 10).lower()
        self.alternating = alternating

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.route(self._chat))
        app.router.add_get("/v1/models", self.route(self._models))

    async def _models(self, request: web.Request, rec: RecordedRequest) -> web.StreamResponse:
        data = [
            {"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "system"}
            for m in self.models
        ]
        return await self.send_json(request, rec, 200, {"object": "list", "data": data})

    async def _chat(self, request: web.Request, rec: RecordedRequest) -> web.StreamResponse:
        body = rec.body
        if not isinstance(body, dict):
            rec.rejected = "We could not parse the JSON body of your request."
            err = error_body(rec.rejected, "invalid_request_error")
            return await self.send_json(request, rec, 400, err)
        problem = validate_messages(body.get("messages"))
        if problem is None and self.alternating:
            roles = [m.get("role") for m in body["messages"]]
            if any(a == b == "user" for a, b in itertools.pairwise(roles)):
                problem = ROLES_MUST_ALTERNATE, "messages"
        if problem is not None:
            rec.rejected = problem[0]
            err = error_body(problem[0], "invalid_request_error", problem[1])
            return await self.send_json(request, rec, 400, err)

        reply = rec.reply = self.next_reply()
        if reply.status != 200:
            server_side = reply.status >= 500
            message = reply.error_message or (
                SERVER_ERROR_MESSAGE if server_side else "Invalid request."
            )
            err_type = "server_error" if server_side else "invalid_request_error"
            err = error_body(message, err_type)
            return await self.send_error(request, rec, reply, err)

        if body.get("stream"):
            return await self._stream(request, rec, reply, body)
        await self.pace_start(rec, reply)
        return await self.send_json(request, rec, 200, self._completion(rec, reply, body))

    def _tool_call_ids(self, reply: Reply) -> list[str]:
        return [tc.id or random_id("call_") for tc in reply.tool_calls]

    def _usage(
        self, body: dict[str, Any], completion_tokens: int, reply: Reply | None = None
    ) -> dict[str, Any]:
        prompt_tokens = max(1, len(dumps(body.get("messages", []))) // 4)
        if reply is not None and reply.counts is not None:
            return {"prompt_tokens": reply.counts[0], "completion_tokens": reply.counts[1]}
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _completion(self, rec: RecordedRequest, reply: Reply, body: dict[str, Any]) -> Any:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text if reply.chunks else None,
            "refusal": None,
        }
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": tc.name,
                        "arguments": arguments_text(tc.arguments),
                    },
                }
                for tc, call_id in zip(reply.tool_calls, self._tool_call_ids(reply), strict=True)
            ]
        return {
            "id": random_id("chatcmpl-", 29),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if reply.tool_calls else "stop",
                }
            ],
            "usage": self._usage(body, len(reply.chunks) + len(reply.tool_calls), reply),
            "system_fingerprint": self.system_fingerprint,
        }

    async def _stream(
        self,
        request: web.Request,
        rec: RecordedRequest,
        reply: Reply,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        base: dict[str, Any] = {
            "id": random_id("chatcmpl-", 29),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model"),
            "system_fingerprint": self.system_fingerprint,
        }

        def event(delta: dict[str, Any], finish_reason: str | None = None) -> str:
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            chunk = {**base, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            return f"data: {dumps(chunk)}\n\n"

        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "x-request-id": random_id("req_", 32),
            },
        )
        rec.status = 200
        await resp.prepare(request)
        await self.pace_start(rec, reply)
        if reply.events is not None:
            for data in reply.events:
                await self.emit(rec, resp, f"data: {data}\n\n")
            if reply.cut_short:
                return await self.cut(request, rec, resp)
            await self.emit(rec, resp, "data: [DONE]\n\n", counted=False)
            return await self.finish(rec, resp)

        role_sent = False
        if reply.chunks or not reply.tool_calls:
            role = {"role": "assistant", "content": "", "refusal": None}
            await self.emit(rec, resp, event(role), counted=False)
            role_sent = True
        for piece in reply.thinking:
            await self.emit(rec, resp, event({"reasoning_content": piece}))
        encoded: dict[str, str] = {}  # a short piece that recurs is encoded once per reply

        def content(piece: str) -> str:
            if len(piece) > 64:
                return event({"content": piece})
            if piece not in encoded:
                encoded[piece] = event({"content": piece})
            return encoded[piece]

        step = max(1, reply.chunks_per_write)
        for start in range(0, len(reply.chunks), step):
            pieces = reply.chunks[start : start + step]
            data = "".join(map(content, pieces))
            await self.emit(rec, resp, data, chunks=len(pieces))
        for raw in reply.raw_content:
            before, after = event({"content": "\0"}).encode().split(b"\\u0000")
            await self.emit(rec, resp, before + raw[: len(raw) // 2])
            await self.emit(rec, resp, raw[len(raw) // 2 :] + after, counted=False)
        if reply.garbage is not None:
            await self.emit(rec, resp, f"data: {reply.garbage}\n\n", counted=False)

        ids = self._tool_call_ids(reply)
        for i, (tc, call_id) in enumerate(zip(reply.tool_calls, ids, strict=True)):
            head: dict[str, Any] = {}
            if not role_sent:
                head = {"role": "assistant", "content": None, "refusal": None}
                role_sent = True
            place = i if reply.index_of is None else reply.index_of[i]
            index = {} if reply.unindexed else {"index": place}
            whole = reply.arguments_whole and not isinstance(tc.arguments, str)
            head["tool_calls"] = [
                {
                    **index,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments if whole else ""},
                }
            ]
            await self.emit(rec, resp, event(head))
            pieces = (
                [] if whole else split_pieces(arguments_text(tc.arguments), reply.tool_call_pieces)
            )
            for piece in pieces:
                delta = {"tool_calls": [{**index, "function": {"arguments": piece}}]}
                await self.emit(rec, resp, event(delta))

        if reply.cut_short or reply.drop:
            return await self.cut(request, rec, resp)
        finish = reply.finish or ("tool_calls" if reply.tool_calls else "stop")
        counts = self._usage(body, max(rec.chunks_sent, 1), reply)
        last = event({}, finish)
        if include_usage and reply.usage_twice:
            last = last.replace('"usage":null', f'"usage":{dumps(counts)}')
        await self.emit(rec, resp, last, counted=False)
        if include_usage:
            usage = {**base, "choices": [], "usage": counts}
            await self.emit(rec, resp, f"data: {dumps(usage)}\n\n", counted=False)
        if reply.linger:
            await asyncio.sleep(reply.linger)
        await self.emit(rec, resp, "data: [DONE]\n\n", counted=False)
        return await self.finish(rec, resp)
