"""The relay's core, composed: rooms, the drone directory, the reaper and the turn lifecycle.

Connection objects (``browsers``, ``drones``) validate payloads and call into these parts;
the core keeps no connection objects, only drone routes and live turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import socketio

from . import running_text
from .accounts import Accounts
from .background import Background
from .directory import DroneDirectory
from .dispatch import Dispatcher
from .live_state import LiveState, LocalLiveState
from .metrics import RelayMetrics
from .reaper import Reaper
from .reports import DroneReports
from .rooms import Rooms
from .store import TurnStore
from .turns import ABORT_ANSWER, QUEUE_LIMIT, TurnLifecycle

log = logging.getLogger("hangar.relay")


class Relay:
    def __init__(
        self,
        store: TurnStore,
        sio: socketio.AsyncServer,
        live_state: LiveState,
        *,
        drone_token: str,
        abort_grace: float = 10.0,
        drone_grace: float = 3.0,
        queue_limit: int = QUEUE_LIMIT,
        abort_answer: float = ABORT_ANSWER,
    ) -> None:
        self.store = store
        self.sio = sio
        self.live_state = live_state
        self.drone_token = drone_token
        self.listening = False
        """Set once the relay listens: a relay that could not start says nothing of stopping."""
        self.metrics = RelayMetrics()
        self.background = Background()
        self.accounts = Accounts(store)
        self.rooms = Rooms(sio, store, live_state, self.accounts)
        self.directory = DroneDirectory(sio, live_state, store, self.metrics, self.background.later)
        self.reaper = Reaper(
            store,
            self.directory,
            self.background.later,
            abort_grace=abort_grace,
            drone_grace=drone_grace,
        )
        self.dispatcher = Dispatcher(store, live_state, self.directory, self.rooms, self.background)
        self.turns = TurnLifecycle(
            store,
            live_state,
            self.directory,
            self.rooms,
            self.reaper,
            self.dispatcher,
            self.metrics,
            queue_limit=queue_limit,
            abort_answer=abort_answer,
        )
        self.reports = DroneReports(self.turns)

    async def start(self) -> None:
        await self.live_state.start()
        if isinstance(self.live_state, LocalLiveState):  # Redis keeps it for relays sharing it
            if restored := await running_text.restore(self.store, self.live_state):
                log.info("running turns' text read from the database: %d", restored)
            self.background.spawn(running_text.write_forever(self.store, self.live_state))
        self.dispatcher.start(self.turns)
        self.reaper.start(self.turns, self.dispatcher.tick)

    async def close(self) -> None:
        self.reaper.close()
        if isinstance(self.live_state, LocalLiveState):  # what streamed since the last write
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await running_text.write(self.store, self.live_state)
        await self.background.close()
        await self.live_state.close()
