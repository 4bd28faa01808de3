"""Password checks shared fairly: each is an argon2 hash (64 MiB, ~0.1 s of a core), so a
flood of wrong logins, each within its address's allowance, would hold every person's login
back behind the whole flood (22.8 s for 200 guesses from 10 addresses, on 2 cores).

At most ``AT_ONCE`` checks run at a time, and an address has one waiting at most (its next
waits for its last): a person's login waits for one check per address that floods, not for
the flood. IPv6 addresses count by their /64, the block one machine is usually given.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator

AT_ONCE = 2
"""Password checks run at a time (the hash uses a core each)."""


def address_group(address: str) -> str:
    """Who an address counts as, for login failures and checks: an IPv6 one by its /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if not isinstance(ip, ipaddress.IPv6Address):
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))


class LoginChecks:
    def __init__(self, at_once: int = AT_ONCE) -> None:
        self._slots = asyncio.Semaphore(at_once)
        self._addresses: dict[str, tuple[asyncio.Lock, int]] = {}
        """Each address's lock, and how many of its logins hold or wait for it."""

    @contextlib.asynccontextmanager
    async def turn(self, address: str) -> AsyncIterator[None]:
        """Wait for the address's turn to check a password, then for a free slot."""
        lock, users = self._addresses.get(address, (asyncio.Lock(), 0))
        self._addresses[address] = (lock, users + 1)
        try:
            async with lock, self._slots:
                yield
        finally:
            lock, users = self._addresses[address]
            if users == 1:
                del self._addresses[address]
            else:
                self._addresses[address] = (lock, users - 1)
