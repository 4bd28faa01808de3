"""A local stand-in for the Ollama HTTP API (NDJSON streaming wire format)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from .base import RecordedRequest, Reply, UpstreamPeer, dumps

OLLAMA_VERSION = "0.12.6"
SERVER_ERROR_MESSAGE = "an error was encountered while running the model: unexpected EOF"


def created_at() -> str:
    """RFC 3339 with nanoseconds, as Go's ``time.Time`` marshals it."""
    ns = time.time_ns()
    stamp = datetime.fromtimestamp(ns // 1_000_000_000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{ns % 1_000_000_000:09d}Z"


class OllamaPeer(UpstreamPeer):
    """Serves ``POST /api/chat``, ``GET /api/tags`` and ``GET /api/version``."""

    def __init__(
        self,
        *,
        default: Reply | None = None,
        models: tuple[str, ...] = ("llama3.2:latest",),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(default=default, models=models, host=host, port=port)

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_post("/api/chat", self.route(self._chat))
        app.router.add_get("/api/tags", self.route(self._tags))
        app.router.add_get("/api/version", self.route(self._version))

    async def _version(self, request: web.Request, rec: RecordedRequest) -> web.StreamResponse:
        return await self.send_json(request, rec, 200, {"version": OLLAMA_VERSION})

    async def _tags(self, request: web.Request, rec: RecordedRequest) -> web.StreamResponse:
        models = [
            {
                "name": m,
                "model": m,
                "modified_at": created_at(),
                "size": 2_019_393_189,
                "digest": hashlib.sha256(m.encode()).hexdigest(),
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "llama",
                    "families": ["llama"],
                    "parameter_size": "3.2B",
                    "quantization_level": "Q4_K_M",
                },
            }
            for m in self.models
        ]
        return await self.send_json(request, rec, 200, {"models": models})

    async def _chat(self, request: web.Request, rec: RecordedRequest) -> web.StreamResponse:
        body = rec.body
        if not isinstance(body, dict):
            rec.rejected = "invalid character in request body"
            return await self.send_json(request, rec, 400, {"error": rec.rejected})
        if not body.get("model"):
            rec.rejected = "model is required"
            return await self.send_json(request, rec, 400, {"error": rec.rejected})

        reply = rec.reply = self.next_reply()
        if reply.status != 200:
            error = reply.error_message or (
                SERVER_ERROR_MESSAGE if reply.status >= 500 else "invalid request"
            )
            return await self.send_error(request, rec, reply, {"error": error})

        model = str(body["model"])
        if body.get("stream", True) is False:
            await self.pace_start(rec, reply)
            message: dict[str, Any] = {"role": "assistant", "content": reply.text}
            if reply.tool_calls:
                message["tool_calls"] = self._tool_calls(reply)
            final = self._done(rec, model, len(reply.chunks) + len(reply.tool_calls))
            return await self.send_json(request, rec, 200, {**final, "message": message})

        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson"})
        rec.status = 200
        await resp.prepare(request)
        await self.pace_start(rec, reply)
        for piece in reply.thinking:
            part = self._part(model, {"role": "assistant", "content": "", "thinking": piece})
            await self.emit(rec, resp, dumps(part) + "\n")
        for piece in reply.chunks:
            part = self._part(model, {"role": "assistant", "content": piece})
            await self.emit(rec, resp, dumps(part) + "\n")
        if reply.garbage is not None:
            await self.emit(rec, resp, reply.garbage + "\n", counted=False)
        if reply.tool_calls:
            calls = {"role": "assistant", "content": "", "tool_calls": self._tool_calls(reply)}
            await self.emit(rec, resp, dumps(self._part(model, calls)) + "\n")
        if reply.cut_short or reply.drop:
            return await self.cut(request, rec, resp)
        final = self._done(rec, model, max(rec.chunks_sent, 1))
        if reply.counts is not None:
            final["prompt_eval_count"], final["eval_count"] = reply.counts
        final["done_reason"] = reply.finish or "stop"
        await self.emit(rec, resp, dumps(final) + "\n", counted=False)
        if reply.linger:
            await asyncio.sleep(reply.linger)
        return await self.finish(rec, resp)

    @staticmethod
    def _part(model: str, message: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": model,
            "created_at": created_at(),
            "message": message,
            "done": False,
        }

    @staticmethod
    def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = []
        for i, tc in enumerate(reply.tool_calls):
            call: dict[str, Any] = {}
            if tc.id is not None:
                call["id"] = tc.id
            call["function"] = {
                "index": i,
                "name": tc.name,
                "arguments": tc.arguments if isinstance(tc.arguments, dict) else {},
            }
            calls.append(call)
        return calls

    @staticmethod
    def _done(rec: RecordedRequest, model: str, eval_count: int) -> dict[str, Any]:
        total = max(int((time.monotonic() - rec.started) * 1e9), 1_000_000)
        prompt_count = max(1, len(dumps(rec.messages)) // 4)
        return {
            "model": model,
            "created_at": created_at(),
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "stop",
            "total_duration": total,
            "load_duration": total // 10,
            "prompt_eval_count": prompt_count,
            "prompt_eval_duration": total // 5,
            "eval_count": eval_count,
            "eval_duration": total // 2,
        }
