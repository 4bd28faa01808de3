"""Rooms and snapshots: which browser connections hear about a session or a person, and what a
browser is sent when it opens a session or connects.

A session's room gets its turns' events; an owner's room gets the person's session list.
"""

from __future__ import annotations

from typing import Any

import socketio

from hangar.shared.protocol import IDE_NAMESPACE, SESSIONS

from .live_state import LiveState
from .store import TurnStore


def session_room(session_id: str) -> str:
    return f"session:{session_id}"


def owner_room(owner: str) -> str:
    return f"owner:{owner}"


class Rooms:
    def __init__(self, sio: socketio.AsyncServer, store: TurnStore, live: LiveState) -> None:
        self.sio = sio
        self.store = store
        self.live = live

    async def join_session(self, sid: str, session_id: str) -> None:
        await self.sio.enter_room(sid, session_room(session_id), namespace=IDE_NAMESPACE)

    async def to_session(self, session_id: str, event: str, data: Any) -> None:
        await self.sio.emit(event, data, room=session_room(session_id), namespace=IDE_NAMESPACE)

    async def send_sessions(self, owner: str) -> None:
        """Send the person's session list to every connection of theirs."""
        await self.sio.emit(
            SESSIONS,
            await self.session_views(owner),
            room=owner_room(owner),
            namespace=IDE_NAMESPACE,
        )

    async def session_views(self, owner: str) -> list[dict[str, Any]]:
        processing = {t.session_id: t.turn_id for t in await self.store.processing_turns(owner)}
        return [
            s.view(processing.get(s.session_id)).wire()
            for s in await self.store.list_sessions(owner)
        ]

    async def open_session(self, owner: str, sid: str, session_id: str) -> dict[str, Any]:
        """Join a session's room and return its snapshot (live text of a running turn included)."""
        session = await self.store.get_session(session_id)
        if session is None or session.owner != owner:
            return {"ok": False, "error": "Unknown session."}
        await self.join_session(sid, session_id)
        turns = await self.store.list_turns(session_id)
        processing = None
        for turn in turns:
            if turn.status == "processing":
                processing = turn.turn_id
                turn.text, turn.text_seq = await self.live.text(turn.turn_id)
        return {
            "ok": True,
            "session": session.view(processing).wire(),
            "turns": [turn.view().wire() for turn in turns],
        }
