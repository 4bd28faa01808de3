"""``fetch_url``: an HTTP GET whose connection is closed the moment the work order is aborted."""

from __future__ import annotations

import aiohttp

from hangar.shared.abort import AbortSignal

from .errors import ToolError

MAX_BODY_CHARS = 50_000


async def fetch_url(url: str, signal: AbortSignal, seconds: float) -> str:
    if not url.startswith(("http://", "https://")):
        raise ToolError("Only http:// and https:// URLs can be fetched.")

    async def fetch() -> str:
        limits = aiohttp.ClientTimeout(total=seconds)
        async with (
            aiohttp.ClientSession(timeout=limits) as session,
            session.get(url) as response,
        ):
            body = await response.content.read(MAX_BODY_CHARS * 4)
            text = body.decode(response.charset or "utf-8", errors="replace")[:MAX_BODY_CHARS]
            return f"HTTP {response.status}\n{text}"

    try:
        # On abort the scope cancels the read: the ``async with`` blocks close the connection.
        async with signal.scope():
            return await fetch()
    except aiohttp.ClientError as error:
        raise ToolError(f"Fetching {url} failed: {error}") from None
    except TimeoutError:
        raise ToolError(f"Fetching {url} timed out after {seconds:g} s.") from None
