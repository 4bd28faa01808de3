"""Approvals sent to worker processes, waiting for each worker's verdict.

The drone's copy of a turn's waiting calls may be behind its worker: the worker may have
declined a call (its wait for a person ran out, or the turn's deadline came) with the news still
on its way. So a person's answer is the worker's: taken, or why not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hangar.shared.protocol import NO_SUCH_CALL

VERDICT_WITHIN = 0.5
"""Seconds a worker's verdict on an approval is waited for (below the relay's wait for the
drone's answer); past it the approval counts as taken: the worker takes it when it reads it,
if the call still waits."""


class Verdicts:
    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], asyncio.Future[str | None]] = {}

    async def ask(self, turn_id: str, call_id: str, send: Callable[[], None]) -> str | None:
        """``send`` the answer to the worker and wait for its verdict: None once taken."""
        verdict: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiting[(turn_id, call_id)] = verdict
        send()
        try:
            async with asyncio.timeout(VERDICT_WITHIN):
                return await verdict
        except TimeoutError:
            return None
        finally:
            self._waiting.pop((turn_id, call_id), None)

    def heard(self, turn_id: str, call_id: str, refusal: str | None) -> None:
        verdict = self._waiting.get((turn_id, call_id))
        if verdict is not None and not verdict.done():
            verdict.set_result(refusal)

    def ended(self, turn_id: str) -> None:
        """The turn ended with a verdict unsent: its worker never answered (it died)."""
        for (turn, _), verdict in self._waiting.items():
            if turn == turn_id and not verdict.done():
                verdict.set_result(NO_SUCH_CALL)
