"""Reaching a relay at start: waiting for one that is not up yet, and saying why an address
that answers is not a relay (python-socketio's client says only "Connection error")."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import aiohttp

from hangar.shared.abort import AbortError, AbortSignal
from hangar.shared.protocol import ALREADY_CONNECTED

from .connection import DroneRefusedError, RelayConnection

log = logging.getLogger("hangar.drone")

RETRY_DELAYS = (1.0, 2.0, 3.0, 5.0)
"""Seconds between attempts to reach a relay that is not up yet (the last one repeats)."""
LOOK_WITHIN = 3.0
"""Seconds a look at what answers at a relay's address may take."""
ALREADY_WAIT = 20.0
"""Seconds a drone keeps coming again while a relay says a drone with its id is connected
already: one started again after it hung, or its machine went away, is that drone, and the
relay lets its earlier connection go within its grace. A second drone on the token is refused
for good then."""
ENGINE_PATH = "/socket.io/?EIO=4&transport=polling"
"""Where a relay (any socket.io server) answers a plain HTTP request with a session."""


async def reach_relay(connection: RelayConnection, signal: AbortSignal) -> bool:
    """Connect, waiting for a relay that is not up yet; False if ``signal`` fires first (an
    attempt under way is given up then: a relay frozen would hold it for seconds).

    Raises ``DroneRefusedError`` when a relay refuses this drone: waiting cannot help then. An
    address where something else answers is tried again too (it may be a relay being
    deployed), but the warning says what answers there.
    """
    try:
        async with signal.scope():
            await keep_trying(connection)
    except AbortError:
        await connection.close()  # what the attempt given up had opened
        return False
    return True


async def keep_trying(connection: RelayConnection) -> None:
    """``reach_relay``'s attempts, until one connects."""
    attempt = 0
    already_until: float | None = None
    while True:
        try:
            await connection.connect()
            return
        except DroneRefusedError as error:
            now = asyncio.get_running_loop().time()
            already_until = already_until or now + ALREADY_WAIT
            if str(error) != ALREADY_CONNECTED or now >= already_until:
                raise
            connection.forget_refusal()
            log.warning(
                "%s: if this drone was started again, the relay has not yet let its earlier "
                "connection go; trying again for up to %.0f s",
                error,
                already_until - now,
            )
            await asyncio.sleep(RETRY_DELAYS[0])
            continue
        except ConnectionError:
            pass
        delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
        attempt += 1
        urls = connection.urls
        which = f"relay {urls[0]} is" if len(urls) == 1 else f"relays {', '.join(urls)} are"
        found = await asyncio.gather(*(what_answers(url) for url in urls))
        said = [
            f"{url} {answer}" if len(urls) > 1 else answer
            for url, answer in zip(urls, found, strict=True)
            if answer
        ]
        if said:
            log.warning(
                "%s not reachable as a relay: %s; trying again in %g s",
                which,
                "; ".join(said),
                delay,
            )
        else:
            log.warning("%s not up yet; trying again in %g s", which, delay)
        await asyncio.sleep(delay)


async def what_answers(url: str) -> str | None:
    """What answers at a relay's address that the drone could not connect to, in a few words;
    None when nothing does (a relay not up yet)."""
    # Connecting and each read have their own bound, so that an address that accepts and then
    # says nothing (a relay frozen) is told from one where nothing listens.
    timeout = aiohttp.ClientTimeout(
        total=2 * LOOK_WITHIN, sock_connect=LOOK_WITHIN, sock_read=LOOK_WITHIN
    )
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(origin(url) + ENGINE_PATH, allow_redirects=False) as response,
        ):
            body = await response.content.read(200)
    except aiohttp.ClientConnectorCertificateError as error:
        return f"its TLS certificate is not trusted ({error.certificate_error})"
    except aiohttp.ClientSSLError:
        return "it does not speak HTTPS (http:// instead?)"
    except aiohttp.ClientConnectorDNSError:
        return "its host name does not resolve"
    except aiohttp.SocketTimeoutError:
        return "it accepts connections but answers nothing (a relay frozen or overloaded?)"
    except (aiohttp.ClientConnectorError, TimeoutError):
        return None  # nothing listens there (yet), or nothing reaches it
    except aiohttp.ClientError:
        return "it does not answer HTTP (https:// instead?)"
    if response.status == 200 and body.startswith(b"0{") and b'"sid"' in body:
        # A socket.io server, a relay (its refusal of this drone, if any, is said on its own).
        return (
            "it answers as a relay does, but the drone could not connect (a relay still"
            " starting, or a proxy in between that does not pass websockets)"
        )
    status = (
        f"HTTP {response.status} {response.reason}"
        if response.reason
        else f"HTTP {response.status}"
    )
    return f"it answers {status} at /socket.io/, as no Hangar relay does"


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL: socket.io's path starts there whatever the URL's own."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
