"""Rooms and snapshots: which browser connections hear about a session or a person, and what a
browser is sent when it opens a session or connects.

A session's room gets its turns' events; an owner's room gets the person's session list.
"""

from __future__ import annotations

from typing import Any

import socketio

from hangar.shared.protocol import IDE_NAMESPACE, SESSIONS

from . import queue
from .accounts import Accounts, User
from .live_state import LiveState
from .store import SessionRecord, TurnStore


def session_room(session_id: str) -> str:
    return f"session:{session_id}"


def owner_room(owner: str) -> str:
    return f"owner:{owner}"


class Rooms:
    def __init__(
        self, sio: socketio.AsyncServer, store: TurnStore, live: LiveState, accounts: Accounts
    ) -> None:
        self.sio = sio
        self.store = store
        self.live = live
        self.accounts = accounts

    async def join_session(self, sid: str, session_id: str) -> None:
        await self.sio.enter_room(sid, session_room(session_id), namespace=IDE_NAMESPACE)

    async def to_session(self, session_id: str, event: str, data: Any) -> None:
        await self.sio.emit(event, data, room=session_room(session_id), namespace=IDE_NAMESPACE)

    def watched_here(self, session_id: str) -> bool:
        """Whether a browser connected to this relay has the session open."""
        room = session_room(session_id)
        return any(True for _ in self.sio.manager.get_participants(IDE_NAMESPACE, room))

    async def to_session_here(self, session_id: str, event: str, data: Any) -> None:
        """Send to the session's browsers on this relay only (each relay tells its own)."""
        await self.sio.emit(
            event, data, room=session_room(session_id), namespace=IDE_NAMESPACE, ignore_queue=True
        )

    async def send_sessions(self, owner: str) -> None:
        """Send the person's session list to every connection of theirs."""
        await self.sio.emit(
            SESSIONS,
            await self._views(await self.store.list_sessions(owner), owner),
            room=owner_room(owner),
            namespace=IDE_NAMESPACE,
        )

    async def session_views(self, viewer: User, everyone: bool = False) -> list[dict[str, Any]]:
        """The viewer's sessions, newest first (an admin may ask for everyone's)."""
        owner = None if everyone and viewer.admin else viewer.user_id
        return await self._views(await self.store.list_sessions(owner), viewer.user_id)

    async def _views(self, sessions: list[SessionRecord], viewer_id: str) -> list[dict[str, Any]]:
        if not sessions:
            return []
        owners = {s.owner for s in sessions}
        only = next(iter(owners)) if len(owners) == 1 else None
        processing = {t.session_id: t.turn_id for t in await self.store.processing_turns(only)}
        names = await self.accounts.names(owners - {viewer_id})
        waiting = await queue.queued_per_session(self.store, only)
        return [
            s.view(
                processing.get(s.session_id), names.get(s.owner), waiting.get(s.session_id, 0)
            ).wire()
            for s in sessions
        ]

    async def open_session(self, viewer: User, sid: str, session_id: str) -> dict[str, Any]:
        """Join a session's room and return its snapshot (live text of a running turn included)."""
        session = await self.store.get_session(session_id)
        if session is None or not viewer.may_see(session.owner):
            return {"ok": False, "error": "Unknown session."}
        await self.join_session(sid, session_id)
        turns = await self.store.list_turns(session_id)
        processing = None
        for turn in turns:
            if turn.status == "processing":
                processing = turn.turn_id
                turn.text, turn.text_seq = await self.live.text(turn.turn_id)
        views = [turn.view() for turn in turns]
        if any(turn.status == "queued" for turn in turns):
            where = {
                p.turn_id: p.position for p in queue.places(await queue.queue_order(self.store))
            }
            for view in views:
                view.position = where.get(view.turn_id) if view.status == "queued" else None
        names = await self.accounts.names({session.owner} - {viewer.user_id})
        return {
            "ok": True,
            "session": session.view(processing, names.get(session.owner)).wire(),
            "turns": [view.wire() for view in views],
        }
