"""Ending each turn exactly once: the first terminal write to the store wins, and only that one
is announced to the turn's session (``turns`` and ``reports`` end turns through this)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace
from typing import TypeVar

from hangar.shared.protocol import (
    ABORT_SIGNALED,
    NO_ACTIVE_WORK_ORDER,
    TURN_ENDED,
    WORK_ORDER_COMPLETE,
    WORK_ORDER_PROGRESS,
    MessageAdded,
    TurnEnded,
    TurnStatus,
)

from .directory import DroneDirectory
from .dispatch import Dispatcher
from .live_state import LiveState, LiveTurn
from .metrics import RelayMetrics
from .reaper import Reaper
from .reports import shown_message, utf16_length
from .rooms import Rooms
from .store import Ending, TurnRecord, TurnStore

log = logging.getLogger("hangar.relay")

V = TypeVar("V")
REMEMBERED = 10_000
"""Accepted and ended turns remembered (``accepted``, ``ended_here``); the oldest go first."""


class TurnEndings:
    """The ending part of ``turns.TurnLifecycle``."""

    store: TurnStore
    live_state: LiveState
    directory: DroneDirectory
    rooms: Rooms
    reaper: Reaper
    dispatcher: Dispatcher
    metrics: RelayMetrics
    abort_answer: float
    live: dict[str, LiveTurn]
    abort_asked_by: dict[str, str]
    accepted: OrderedDict[str, str]
    ended_here: OrderedDict[str, None]

    async def end_turn(
        self,
        turn_id: str,
        ending: Ending,
        from_statuses: tuple[TurnStatus, ...] = ("queued", "processing"),
    ) -> bool:
        """End a turn once: the first terminal write wins, later ones are logged and ignored."""
        ended = await self._store_ending(turn_id, ending, from_statuses)
        if ended is None:
            return False
        await self._announce(ended, ending)
        return True

    async def end_here(
        self,
        turn_id: str,
        ending: Ending,
        from_statuses: tuple[TurnStatus, ...] = ("queued", "processing"),
    ) -> bool:
        """End a turn the relay aborts by itself (queued, or its drone away or silent): stored
        before the abort is answered, so the answer can say whether this abort ended it (not
        if the turn had ended, or started, just before), and announced after the answer, as a
        drone's ending is."""
        ended = await self._store_ending(turn_id, ending, from_statuses)
        if ended is None:
            return False
        self.dispatcher.background.spawn(self._announce(ended, ending))
        return True

    async def honoured(self, turn_id: str, ended: bool) -> tuple[bool, str]:
        """The answer to an abort the relay honoured by itself (``ended``: ``end_here`` ended
        the turn): signalled if the turn ended aborted, by this ending or by its drone that
        heard of the abort another way; nothing to abort if it had just ended otherwise."""
        if not ended:
            turn = await self.store.get_turn(turn_id, messages=False)
            ended = turn is not None and turn.status == "aborted"
        return (True, ABORT_SIGNALED) if ended else (False, NO_ACTIVE_WORK_ORDER)

    async def _store_ending(
        self, turn_id: str, ending: Ending, from_statuses: tuple[TurnStatus, ...]
    ) -> TurnRecord | None:
        """Store the turn's ending if it is the first (the turn as stored), else None."""
        try:
            text, _ = await self.live_state.text(turn_id)
        except Exception as error:  # Redis failing: the store keeps the messages' text
            log.warning("live text not read turn=%s: %s", turn_id, brief(error))
            text = ""
        ended = await self.store.end_turn(
            turn_id,
            replace(ending, text=text or ending.text),
            from_statuses,
        )
        if ended is None:
            log.info("late end ignored turn=%s status=%s", turn_id, ending.status)
            return None
        self.reaper.forget(turn_id)
        remember(self.ended_here, turn_id, None)
        self.live.pop(turn_id, None)
        self.abort_asked_by.pop(turn_id, None)
        self.accepted.pop(turn_id, None)
        return ended

    def started(self, turn: TurnRecord) -> None:
        """Its drone accepted the turn's work order: live here if the drone is connected here.
        Not once it ended: a drone may complete a turn before its answer to the order comes
        (it was then taken for running, its text and aborts taken for a live turn's)."""
        if turn.drone_id is None or turn.turn_id in self.ended_here:
            return
        remember(self.accepted, turn.turn_id, turn.drone_id)
        if self.directory.here(turn.drone_id) is not None:
            live = LiveTurn(turn.turn_id, turn.session_id, turn.owner, turn.drone_id)
            self.live.setdefault(turn.turn_id, live)

    async def _announce(self, ended: TurnRecord, ending: Ending) -> None:
        """Tell people of a stored ending: nothing here may fail on Redis."""
        turn_id = ended.turn_id
        try:
            await self.live_state.forget_turn(turn_id)
            # The abort ack and the completion are separate; the ack goes first (bounded
            # below the drone's own wait for this completion's ack).
            await self.live_state.wait_abort_answered(turn_id, self.abort_answer)
        except Exception as error:  # Redis failing: its keys expire by themselves
            log.warning("live state not updated turn=%s: %s", turn_id, brief(error))
        self.metrics.ended(ended.status, ending.reason, ending.usage)
        log.info(
            "turn ended turn=%s drone=%s status=%s reason=%s",
            turn_id,
            ended.drone_id,
            ended.status,
            ending.reason,
        )
        for number, message in ending.messages:  # as if each had come on its own, before
            added = MessageAdded(turn_id=turn_id, message=message, number=number).wire()
            shown = shown_message(added)
            self.metrics.progress_events.inc()
            await self.rooms.to_session(
                ended.session_id, WORK_ORDER_PROGRESS, {**shown, "sessionId": ended.session_id}
            )
        success = ended.status != "error"
        await self.rooms.to_session(
            ended.session_id, WORK_ORDER_COMPLETE, (turn_id, success, ending.result)
        )
        event = TurnEnded(
            turn_id=turn_id,
            session_id=ended.session_id,
            status=ended.status,
            reason=ending.reason,
            result=ending.result,
            ended_by=ended.ended_by,
            usage=ending.usage,
            text_chars=utf16_length(ended.text),
        )
        await self.rooms.to_session(ended.session_id, TURN_ENDED, event.wire())
        await self.directory.broadcast()
        self.dispatcher.wake()  # a slot is free, or the session's next turn may start


def remember(recent: OrderedDict[str, V], key: str, value: V) -> None:
    recent[key] = value
    if len(recent) > REMEMBERED:
        recent.popitem(last=False)


def brief(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]
