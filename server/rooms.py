"""Rooms and what browsers are sent: which browser connections hear about a session or a
person, a session's snapshot, the sessions list a page at a time, and a session's changes.

A session's room gets its turns' events; an owner's room gets the person's sessions as they
change, one session at a time (``sessionChanged``, ``sessionRemoved``), never the whole list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import OrderedDict
from typing import Any

import socketio

from hangar.shared.protocol import (
    IDE_NAMESPACE,
    SESSION_CHANGED,
    SESSION_REMOVED,
    TURN_ENDED,
    TURN_STARTED,
    UNKNOWN_SESSION,
    ListSessions,
    OpenSession,
    ToolActivity,
    TurnView,
)
from hangar.shared.wire import shows

from . import queue, sub_agents
from .accounts import Accounts, User
from .limits import QuietLog
from .live_state import LiveState
from .snapshots import Page
from .store import SessionBusyError, SessionCursor, SessionRecord, TurnRecord, TurnStore

log = logging.getLogger("hangar.relay")
SESSION_COALESCE = 0.05
"""Seconds a session's changed line waits for the session's other changes."""

LAST_TIME = 253_402_300_799.0
"""The end of the year 9999 in seconds since 1970: no later time is a session's activity."""
REMOVED_KEPT = 1000
"""Deleted sessions a relay remembers (``Rooms._removed``)."""
READ_FIRST, READ_AT_ONCE = 4, 13
"""Turns a snapshot reads from the store at once, first and then (30, the page's default, in
three reads): a session of large answers is never read whole."""
REMOVED_OWNER = "a removed person"
"""The owner's name shown for a session whose person was removed (``hangar user remove``)."""
SESSION_BUSY = "This session has a turn running or waiting; stop it before deleting the session."
NOT_YOUR_TITLE = "Only the person whose session it is can rename it."
EMPTY_TITLE = "A session's title cannot be empty."

SESSION_MOVES = (TURN_STARTED, TURN_ENDED)
"""Turn events after which the session's line in its owner's list changes: a turn created,
started, put back in line or ended changes its processing turn, queued count or activity."""


def owner_name(names: dict[str, str], owner: str, viewer_id: str) -> str | None:
    """Whose a session is, for its viewer: None for their own, else its owner's name (or that
    its owner was removed: never blank, which would read as the viewer's own)."""
    if owner == viewer_id:
        return None
    return names.get(owner, REMOVED_OWNER)


def session_room(session_id: str) -> str:
    return f"session:{session_id}"


def owner_room(owner: str) -> str:
    return f"owner:{owner}"


def cursor_of(session: SessionRecord) -> str:
    """The ``next`` of a page that ends with ``session`` (``ListSessions.cursor``)."""
    return f"{session.last_activity!r}~{session.session_id}"


def parse_cursor(cursor: str) -> SessionCursor | None:
    activity, _, session_id = cursor.partition("~")
    try:
        when = float(activity)
    except ValueError:
        return None
    # A session's last activity is a time since 1970: never infinite, negative or past 9999.
    return SessionCursor(when, session_id) if 0 <= when <= LAST_TIME else None


class Rooms:
    def __init__(
        self, sio: socketio.AsyncServer, store: TurnStore, live: LiveState, accounts: Accounts
    ) -> None:
        self.sio = sio
        self.store = store
        self.live = live
        self.accounts = accounts
        self.quiet = QuietLog(log)
        self._moved: set[str] = set()
        """Sessions whose line changed and goes out with the next ``SESSION_COALESCE``."""
        self._sending: asyncio.Task[None] | None = None
        self._removed: OrderedDict[str, None] = OrderedDict()
        """Sessions deleted here lately: a change of one read before it was deleted is not sent
        after its removal (a browser would list it again)."""

    async def join_session(self, sid: str, session_id: str) -> None:
        await self.sio.enter_room(sid, session_room(session_id), namespace=IDE_NAMESPACE)

    async def to_session(self, session_id: str, event: str, data: Any) -> None:
        """Send a turn's event to the session's browsers; a start or an end also updates the
        session's line in its owner's list (``SESSION_MOVES``)."""
        await self.sio.emit(event, data, room=session_room(session_id), namespace=IDE_NAMESPACE)
        if event in SESSION_MOVES:
            self.moved(session_id)

    def moved(self, session_id: str) -> None:
        """Send the session's line in its owner's list again in a moment (``_send_moved``)."""
        self._moved.add(session_id)
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._send_moved())

    async def _send_moved(self) -> None:
        """One ``sessionChanged`` per session that moved in the last moment: a turn that starts
        and ends at once, or a burst of endings, costs each session one line, not one each."""
        while self._moved:  # those that moved while the others were sent go next
            await asyncio.sleep(SESSION_COALESCE)
            moved, self._moved = self._moved, set()
            for session_id in moved:
                await self.send_session(session_id)

    def watched_here(self, session_id: str) -> bool:
        """Whether a browser connected to this relay has the session open."""
        room = session_room(session_id)
        return any(True for _ in self.sio.manager.get_participants(IDE_NAMESPACE, room))

    async def to_session_here(self, session_id: str, event: str, data: Any) -> None:
        """Send to the session's browsers on this relay only (each relay tells its own)."""
        await self.sio.emit(
            event, data, room=session_room(session_id), namespace=IDE_NAMESPACE, ignore_queue=True
        )

    async def send_session(self, session_id: str) -> None:
        """Send one session's view as it is now to its owner's browsers. A failure (the store
        or Redis down) is one log line: the list catches up with the session's next change."""
        try:
            session = await self.store.get_session(session_id)
            if session is not None:
                await self._changed(session)
        except Exception as error:
            self.quiet.warning("session change not sent session=%s: %s", session_id, error)

    async def _changed(self, session: SessionRecord) -> dict[str, Any]:
        """Tell the owner's browsers the session's view; returns it."""
        view = (await self._views([session], session.owner))[0]
        if session.session_id in self._removed:  # deleted meanwhile: "removed" went out first
            return view
        await self.sio.emit(
            SESSION_CHANGED,
            {"session": view},
            room=owner_room(session.owner),
            namespace=IDE_NAMESPACE,
        )
        return view

    async def session_page(self, viewer: User, request: ListSessions) -> dict[str, Any]:
        """One page of the viewer's sessions (everyone's for an admin who asks), latest
        activity first, with ``next`` to ask for the page after it when there is one."""
        owner = None if request.everyone and viewer.admin else viewer.user_id
        after = parse_cursor(request.cursor) if request.cursor else None
        if request.cursor and after is None:
            return {"ok": False, "error": "Invalid payload (cursor: not a page's next)."}
        query = request.query.strip()
        found = await self.store.list_sessions(owner, query, after, request.limit + 1)
        sessions = found[: request.limit]
        page: dict[str, Any] = {"ok": True, "sessions": await self._views(sessions, viewer.user_id)}
        if len(found) > request.limit:
            page["next"] = cursor_of(sessions[-1])
        return page

    async def _views(self, sessions: list[SessionRecord], viewer_id: str) -> list[dict[str, Any]]:
        if not sessions:
            return []
        owners = {s.owner for s in sessions}
        only = next(iter(owners)) if len(owners) == 1 else None
        single = sessions[0].session_id if len(sessions) == 1 else None
        running = await self.store.processing_turns(only, single)
        processing = {turn.session_id: turn.turn_id for turn in running}
        names = await self.accounts.names(owners - {viewer_id})
        waiting = await queue.queued_per_session(self.store, only)
        shown = {s.session_id for s in sessions}
        approvals = {}
        for turn in running:
            if turn.session_id in shown:
                with contextlib.suppress(Exception):  # Redis down: the list without them
                    approvals[turn.session_id] = len(await self.live.waiting(turn.turn_id))
        return [
            s.view(
                processing.get(s.session_id),
                owner_name(names, s.owner, viewer_id),
                waiting.get(s.session_id, 0),
                approvals.get(s.session_id, 0),
            ).wire()
            for s in sessions
        ]

    async def open_session(self, viewer: User, sid: str, request: OpenSession) -> dict[str, Any]:
        """Join a session's room and return its snapshot: its latest turns (a page of them, or
        the page before ``request.before``), a running turn's live text and waiting calls
        included, and whether older turns exist (``more``). A page holds ``request.limit``
        turns at most, and no more than ``SNAPSHOT_BYTES`` of them (``snapshots``); the turns
        are read from the store a few at a time, so a session of large answers is never read
        whole."""
        session_id = request.session_id
        session = await self.store.get_session(session_id)
        if session is None or not viewer.may_see(session.owner):
            return {"ok": False, "error": UNKNOWN_SESSION}
        if request.before is None:
            await self.join_session(sid, session_id)
        line = (await self._views([session], viewer.user_id))[0]
        page, before, more, where = Page(), request.before, True, None
        # The first page holds the running turn, after any turns queued behind it (newer).
        running = line.get("processingTurnId") if request.before is None else None
        while more and (len(page.turns) < request.limit or running is not None):
            wanted = min(
                READ_AT_ONCE if page.turns else READ_FIRST,
                max(request.limit - len(page.turns), 1),
            )
            turns, more = await self.store.recent_turns(session_id, wanted, before)
            if where is None and any(turn.status == "queued" for turn in turns):
                where = {
                    p.turn_id: p.position for p in await queue.where_queued(self.store, self.live)
                }
            for turn in reversed(turns):
                view = (await self._turn_view(turn, where or {})).wire()
                if not page.add(view, ahead=running is not None):
                    more = True
                    break
                running = None if turn.turn_id == running else running
            else:
                before = turns[0].turn_id if turns else None
                continue
            break
        return {
            "ok": True,
            "session": line,
            "turns": page.turns[::-1],
            "more": more,
        }

    async def _turn_view(self, turn: TurnRecord, where: dict[str, int]) -> TurnView:
        """A turn as a snapshot shows it: a running one with its live text, its calls waiting
        for approval and its sub-agents' output; a queued one with its place in line."""
        if turn.status == "processing":
            turn.text, turn.text_seq = await self.live.text(turn.turn_id)
        view = turn.view()
        if turn.status == "processing":
            calls = await self.live.waiting(turn.turn_id)
            view.waiting = [ToolActivity.model_validate(c) for c in calls]
            kept = await self.live.sub_agent_events(turn.turn_id)
            view.sub_agents, view.sub_agent_seq = sub_agents.runs(kept), len(kept)
        elif turn.status == "queued":
            view.position = where.get(turn.turn_id)
        return view

    async def rename_session(self, viewer: User, session_id: str, title: str) -> dict[str, Any]:
        """Retitle one of the viewer's own sessions; its owner's browsers hear of it."""
        title = " ".join(one_line(title).split())
        session = await self.store.get_session(session_id)
        if session is None or not viewer.may_see(session.owner):
            return {"ok": False, "error": UNKNOWN_SESSION}
        if session.owner != viewer.user_id:
            return {"ok": False, "error": NOT_YOUR_TITLE}
        if not shows(title):
            return {"ok": False, "error": EMPTY_TITLE}
        renamed = await self.store.rename_session(session_id, title, time.time())
        if renamed is None:
            return {"ok": False, "error": UNKNOWN_SESSION}  # deleted meanwhile
        return {"ok": True, "session": await self._changed(renamed)}

    async def delete_session(self, viewer: User, session_id: str) -> dict[str, Any]:
        """Delete a session of the viewer's (an admin: anyone's) with its turns and messages,
        unless a turn of it runs or waits; every browser that lists or shows it hears of it."""
        session = await self.store.get_session(session_id)
        if session is None or not viewer.may_see(session.owner):
            return {"ok": False, "error": UNKNOWN_SESSION}
        try:
            deleted = await self.store.delete_session(session_id)
        except SessionBusyError:
            return {"ok": False, "error": SESSION_BUSY}
        if not deleted:
            return {"ok": False, "error": UNKNOWN_SESSION}
        log.info("session deleted session=%s by=%s", session_id, viewer.name)
        self._removed[session_id] = None
        while len(self._removed) > REMOVED_KEPT:
            self._removed.popitem(last=False)
        rooms = [owner_room(session.owner), owner_room(viewer.user_id), session_room(session_id)]
        await self.sio.emit(
            SESSION_REMOVED, {"sessionId": session_id}, room=rooms, namespace=IDE_NAMESPACE
        )
        return {"ok": True}


def session_title(prompt: str) -> str:
    """A new session's title: the first line of its first prompt that shows, each control
    character a space, white space around it left out, at most 60 characters
    (``web/protocol.js`` has the same rule)."""
    line = next((one_line(line) for line in prompt.splitlines() if shows(line)), "New session")
    return line[:60] + ("…" if len(line) > 60 else "")


CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
"""Unicode's control characters (NUL, ESC, DEL…): a title shows none of them."""


def one_line(text: str) -> str:
    """``text`` with each control character a space, white space around it left out."""
    return CONTROLS.sub(" ", text).strip()
