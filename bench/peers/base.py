"""Shared machinery for the fake upstream LLM peers: scripting, recording, waiting."""

from __future__ import annotations

import asyncio
import json
import secrets
import string
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

from aiohttp import web

_T = TypeVar("_T")
_ALNUM = string.ascii_letters + string.digits

Handler = Callable[[web.Request, "RecordedRequest"], Awaitable[web.StreamResponse]]


def random_id(prefix: str, length: int = 24) -> str:
    """An id shaped like the real services' ids, e.g. ``call_Xy12...``."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


REQUEST_LIMIT = 64 * 1024 * 1024
"""The largest request a peer takes (a long history with a file's text in it, say)."""


def dumps(obj: Any) -> str:
    """Compact JSON, as both real services emit on the wire (half a surrogate pair, which has
    no UTF-8, escaped as ``\\ud83d``, as JSON allows)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":"))
    return text


@dataclass
class ScriptedToolCall:
    """A tool call the peer should emit. ``id`` is generated when ``None`` (OpenAI)."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    """An object, or (OpenAI only) the text to send as they are, valid JSON or not."""
    id: str | None = None


def not_json(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity``, which Python's ``json`` reads: the services
    refuse them, as JSON does not have them (RFC 8259)."""
    raise ValueError(f"{name} is not JSON")


def arguments_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


@dataclass
class Reply:
    """How the peer answers one generation request."""

    chunks: list[str] = field(default_factory=lambda: ["Hello", " world"])
    delay: float = 0.0
    stall_before: float = 0.0
    stall_after: tuple[int, float] | None = None
    status: int = 200
    tool_calls: list[ScriptedToolCall] = field(default_factory=list)
    tool_call_pieces: int = 3
    error_message: str | None = None
    chunks_per_write: int = 1
    """Chunks written to the socket at once (the OpenAI peer): a flood that costs the peer
    little, so that its reader, not the peer, is the one kept busy."""
    garbage: str | None = None
    """A line sent verbatim as one more streamed chunk after ``chunks``: a service that sends
    something else than the API's chunks (JSON of another shape, or no JSON at all)."""
    cut_short: bool = False
    """The stream ends after ``chunks`` without its last chunk: no ``finish_reason``, usage or
    ``[DONE]`` (OpenAI), no ``"done": true`` (Ollama); a service that stopped mid-answer."""
    drop: bool = False
    """After ``chunks`` the connection is dropped, the response unfinished: a service (or a
    proxy) that died mid-answer."""
    headers: dict[str, str] = field(default_factory=dict)
    """Headers sent with an error ``status`` (the OpenAI peer), such as ``Retry-After``."""
    thinking: list[str] = field(default_factory=list)
    """Reasoning streamed before the answer, paced like ``chunks``: OpenAI's
    ``reasoning_content`` deltas, Ollama's ``message.thinking`` parts."""
    finish: str | None = None
    """How the answer says it ended, in place of ``stop`` / ``tool_calls``: OpenAI's
    ``finish_reason``, Ollama's ``done_reason`` (``length``, ``content_filter``)."""
    unindexed: bool = False
    """(OpenAI) Tool call pieces without their ``index``, as some compatible services stream
    them: each call's first piece carries its id and name."""
    index_of: list[int] | None = None
    """(OpenAI) The ``index`` each call's pieces carry, in place of its place in the answer: a
    service that gives two calls the same index (each with its own id and name)."""
    arguments_whole: bool = False
    """(OpenAI) Each call's arguments sent with its first piece as a JSON object, not as a
    string of JSON, as some compatible services send them."""
    usage_twice: bool = False
    """(OpenAI) The usage sent on the finishing chunk as well as after it."""
    error_body: tuple[str, str] | None = None
    """With an error ``status``: the response's content type and body as given, in place of the
    API's JSON error (an HTML page from a proxy, an empty body, a JSON string)."""
    linger: float = 0.0
    """Seconds the response stays open after its ``"done": true`` line (Ollama), or after its
    finish reason and usage, before ``[DONE]`` (OpenAI), as a server that keeps the
    connection: the answer is whole already."""
    counts: tuple[Any, Any] | None = None
    """The token counts the service reports (prompt, completion) in place of its own, whatever
    they are: OpenAI's ``usage``, Ollama's ``prompt_eval_count`` and ``eval_count``."""
    raw_content: list[bytes] = field(default_factory=list)
    """(OpenAI) Text streamed after ``chunks``, a chunk for each piece, its bytes put in the
    chunk's JSON string as they are (bytes that are no UTF-8, a character cut short), each line
    written in two writes cut in the middle of its piece (a character's bytes split between
    two of them)."""
    events: list[str] | None = None
    """(OpenAI) The stream's chunks as the JSON given, one ``data:`` line each, in place of the
    ones ``chunks``, ``tool_calls`` and ``finish`` make (a service's own shapes: several
    choices, no finish reason); then ``[DONE]``, unless ``cut_short``."""

    @property
    def text(self) -> str:
        return "".join(self.chunks)


@dataclass
class RecordedRequest:
    """One request as seen by a peer."""

    method: str
    path: str
    body: Any
    started: float
    headers: dict[str, str] = field(default_factory=dict)
    reply: Reply | None = None
    status: int | None = None
    ended: float | None = None
    disconnected: bool = False
    disconnected_at: float | None = None
    completed: bool = False
    rejected: str | None = None
    chunks_sent: int = 0

    @property
    def model(self) -> str | None:
        if isinstance(self.body, dict):
            model = self.body.get("model")
            return model if isinstance(model, str) else None
        return None

    @property
    def messages(self) -> list[dict[str, Any]]:
        if isinstance(self.body, dict) and isinstance(self.body.get("messages"), list):
            return list(self.body["messages"])
        return []


class UpstreamPeer:
    """Base class: an aiohttp server on 127.0.0.1 that records and scripts replies."""

    def __init__(
        self,
        *,
        default: Reply | None = None,
        models: Sequence[str] = ("test-model",),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.default: Reply = default if default is not None else Reply()
        self.models: list[str] = list(models)
        self.requests: list[RecordedRequest] = []
        self._script: deque[Reply] = deque()
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._changed = asyncio.Event()

    def script(self, *replies: Reply) -> None:
        """Queue replies (FIFO); ``default`` is used once the queue is empty."""
        self._script.extend(replies)

    @property
    def pending_replies(self) -> int:
        return len(self._script)

    def next_reply(self) -> Reply:
        return self._script.popleft() if self._script else self.default

    def reset(self) -> None:
        """Forget recorded requests and queued replies (``default`` is kept)."""
        self.requests.clear()
        self._script.clear()
        self._notify()

    @property
    def port(self) -> int:
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError(f"{type(self).__name__} is not running")
        return int(self._runner.addresses[0][1])

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def _add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def route(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """Wrap a handler so the request is recorded and disconnects are detected."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                body: Any = json.loads(raw, parse_constant=not_json) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            rec = RecordedRequest(request.method, request.path, body, time.monotonic())
            rec.headers = dict(request.headers)
            self.requests.append(rec)
            task = asyncio.current_task()
            if task is not None:
                self._tasks.add(task)
            self._notify()
            try:
                return await handler(request, rec)
            except (asyncio.CancelledError, ConnectionError) as gone:
                if not self._stopping and not rec.completed:
                    rec.disconnected = True
                    rec.disconnected_at = time.monotonic()
                if isinstance(gone, ConnectionError):
                    # The client hung up while we wrote: nothing left to answer.
                    return web.StreamResponse()
                raise
            finally:
                rec.ended = time.monotonic()
                if task is not None:
                    self._tasks.discard(task)
                self._notify()

        return wrapped

    async def start(self) -> Self:
        if self._runner is not None:
            return self
        self._stopping = False
        self._changed = asyncio.Event()
        app = web.Application(client_max_size=REQUEST_LIMIT)
        self._add_routes(app)
        runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None
        )
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        return self

    async def stop(self) -> None:
        """Stop the server; in-flight (even stalled) handlers are cancelled."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._stopping = True
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        await runner.cleanup()
        self._notify()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def pace_start(self, rec: RecordedRequest, reply: Reply) -> None:
        """Called once the response headers are sent, before the first chunk."""
        if reply.stall_before > 0:
            await asyncio.sleep(reply.stall_before)
        if reply.stall_after is not None and reply.stall_after[0] == 0:
            await asyncio.sleep(reply.stall_after[1])

    async def emit(
        self,
        rec: RecordedRequest,
        resp: web.StreamResponse,
        data: str | bytes,
        *,
        counted: bool = True,
        chunks: int = 1,
    ) -> None:
        """Write (and flush) one piece of the body (``chunks`` chunks; bytes as they are);
        counted pieces obey the pacing."""
        reply = rec.reply or self.default
        if counted and rec.chunks_sent > 0 and reply.delay > 0:
            await asyncio.sleep(reply.delay)
        await resp.write(data if isinstance(data, bytes) else data.encode("utf-8"))
        if reply.delay <= 0:
            # A write the socket takes whole does not yield: without this, an unpaced reply
            # would hold the loop of the process it shares (the tests') for as long as its
            # reader keeps up, hundreds of ms at a time.
            await asyncio.sleep(0)
        if not counted:
            return
        rec.chunks_sent += chunks
        self._notify()
        if reply.stall_after is not None and reply.stall_after[0] == rec.chunks_sent:
            await asyncio.sleep(reply.stall_after[1])

    async def cut(
        self, request: web.Request, rec: RecordedRequest, resp: web.StreamResponse
    ) -> web.StreamResponse:
        """End the stream early as ``rec.reply`` says: whole but short, or dropped."""
        if rec.reply is not None and rec.reply.drop and request.transport is not None:
            request.transport.abort()
            rec.completed = True
            self._notify()
            return resp
        return await self.finish(rec, resp)

    async def finish(self, rec: RecordedRequest, resp: web.StreamResponse) -> web.StreamResponse:
        await resp.write_eof()
        rec.completed = True
        self._notify()
        return resp

    async def send_error(
        self, request: web.Request, rec: RecordedRequest, reply: Reply, payload: Any
    ) -> web.StreamResponse:
        """The reply's error ``status`` with ``payload`` as JSON, or its ``error_body``."""
        if reply.error_body is None:
            return await self.send_json(request, rec, reply.status, payload, reply.headers)
        content_type, body = reply.error_body
        resp = web.Response(status=reply.status, body=body.encode(), headers=reply.headers)
        resp.headers["Content-Type"] = content_type
        rec.status = reply.status
        await resp.prepare(request)
        return await self.finish(rec, resp)

    async def send_json(
        self,
        request: web.Request,
        rec: RecordedRequest,
        status: int,
        payload: Any,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Send a complete JSON response and mark the request completed."""
        resp = web.Response(
            status=status, text=dumps(payload), content_type="application/json", headers=headers
        )
        rec.status = status
        await resp.prepare(request)
        return await self.finish(rec, resp)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, check: Callable[[], _T | None], limit: float, what: str) -> _T:
        try:
            async with asyncio.timeout(limit):
                while True:
                    result = check()
                    if result is not None:
                        return result
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"{type(self).__name__}: timed out after {limit}s waiting for {what}"
            ) from None

    def _find(self, index: int | None) -> RecordedRequest | None:
        if index is None:
            return next((r for r in reversed(self.requests) if r.reply is not None), None)
        inside = -len(self.requests) <= index < len(self.requests)
        return self.requests[index] if inside else None

    @property
    def last(self) -> RecordedRequest | None:
        """The latest generation request (the last one that got a scripted reply)."""
        return self._find(None)

    @property
    def chunks_sent(self) -> int:
        rec = self.last
        return rec.chunks_sent if rec is not None else 0

    async def wait_for_requests(
        self, n: int, timeout: float = 5.0, *, path: str | None = None
    ) -> list[RecordedRequest]:
        """Wait until at least ``n`` requests (optionally only to ``path``) arrived."""

        def check() -> list[RecordedRequest] | None:
            found = [r for r in self.requests if path is None or r.path == path]
            return found if len(found) >= n else None

        return await self._wait(check, timeout, f"{n} request(s)")

    async def wait_for_chunks(
        self, n: int, timeout: float = 5.0, *, index: int | None = None
    ) -> RecordedRequest:
        """Wait until ``n`` counted chunks were written for the request.

        ``index=None`` means the latest generation request.
        """

        def check() -> RecordedRequest | None:
            rec = self._find(index)
            return rec if rec is not None and rec.chunks_sent >= n else None

        return await self._wait(check, timeout, f"{n} chunk(s)")

    async def wait_for_end(self, index: int | None = None, timeout: float = 5.0) -> RecordedRequest:
        """Wait until the handler for the request finished (completed or not)."""

        def check() -> RecordedRequest | None:
            rec = self._find(index)
            return rec if rec is not None and rec.ended is not None else None

        return await self._wait(check, timeout, "the request to end")

    async def wait_for_disconnect(self, index: int | None = None, timeout: float = 5.0) -> float:
        """Wait until the client dropped the request; returns ``disconnected_at``.

        Raises ``AssertionError`` at once if the request ended without a disconnect.
        """

        def check() -> float | None:
            rec = self._find(index)
            if rec is None:
                return None
            if rec.disconnected_at is not None:
                return rec.disconnected_at
            if rec.ended is not None:
                raise AssertionError(f"request {rec.path} ended without a client disconnect")
            return None

        return await self._wait(check, timeout, "a client disconnect")
