"""The turn lifecycle: submit and abort (ending each turn exactly once is ``endings``; what
drones report on their turns is ``reports``).

A submitted turn is stored ``queued`` and the dispatcher starts it on a drone with room (at
once, when one is free). Turns live in the store, whose conditional update makes the first
terminal write win; the live text and aborts in flight are in the relays' shared live state. A
relay keeps in memory only the turns run by drones connected to it (``live``).

An abort is always honoured: a drone that does not acknowledge it within ``abort_answer`` (it
froze, or is away) has the turn ended by the relay, and is told when it is heard from again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any

import socketio

from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORT_WORK_ORDER,
    ABORTED,
    APPROVE_TOOL_CALL,
    NO_ACTIVE_WORK_ORDER,
    NO_SUCH_CALL,
    STOP_AFTER_STEP,
    TURN_STARTED,
    TURN_STOPPING,
    UNKNOWN_SESSION,
    UNKNOWN_TURN,
    AbortOrder,
    AbortWorkOrderRequest,
    ChatMessage,
    SubmitWorkOrder,
    ToolApproval,
)
from hangar.shared.wire import cut, shows

from . import queue, session_tools
from .accounts import User
from .directory import DroneDirectory
from .dispatch import Dispatcher, drone_refusal
from .endings import TurnEndings, brief
from .live_state import DroneRoute, LiveState, LiveTurn
from .metrics import RelayMetrics
from .reaper import Reaper
from .rooms import Rooms, session_title
from .store import (
    Ending,
    QueueFullError,
    RequestTakenError,
    SessionGoneError,
    SessionRecord,
    TurnRecord,
    TurnStore,
)

log = logging.getLogger("hangar.relay")

QUEUE_LIMIT = 20
"""Turns one person may have waiting at once."""
STORE_WAIT = 1.0
"""Seconds an abort waits for the database before it asks Redis whose the turn is."""
OWNER_APPROVES = "Only the person whose turn it is may approve its tool calls."
DRONE_AWAY = "The drone does not answer just now; try again in a moment."
ANSWER_UNCONFIRMED = (
    "The drone has not confirmed this answer: it may still act on it when it answers again."
)
EMPTY_PROMPT = "The prompt is empty: it has nothing to read."
REQUEST_ID_TAKEN = "This request id was already used for another prompt; make a new one."
ABORT_ANSWER = 2.0
"""Seconds a drone has to acknowledge an abort; past that the relay ends the turn itself."""


def queue_full(limit: int) -> str:
    return f"You have {limit} work orders waiting; cancel some or wait for them to start."


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class TurnLifecycle(TurnEndings):
    def __init__(
        self,
        store: TurnStore,
        live_state: LiveState,
        directory: DroneDirectory,
        rooms: Rooms,
        reaper: Reaper,
        dispatcher: Dispatcher,
        metrics: RelayMetrics,
        *,
        queue_limit: int = QUEUE_LIMIT,
        abort_answer: float = ABORT_ANSWER,
    ) -> None:
        self.store = store
        self.live_state = live_state
        self.directory = directory
        self.rooms = rooms
        self.reaper = reaper
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.queue_limit = queue_limit
        self.abort_answer = abort_answer
        self.live: dict[str, LiveTurn] = {}
        """Turns run by drones connected to this relay (``reports`` adds them)."""
        self.abort_asked_by: dict[str, str] = {}
        """Who asked (through this relay) to abort a turn still processing."""
        self.accepted: OrderedDict[str, str] = OrderedDict()
        """Processing turns whose order this relay saw a drone accept: turn -> drone (recent)."""
        self.ended_here: OrderedDict[str, None] = OrderedDict()
        """Turns whose ending this relay stored (recent): an order's late acceptance is no start."""

    # ---- browsers

    async def submit(self, viewer: User, sid: str, request: SubmitWorkOrder) -> dict[str, Any]:
        if not shows(request.prompt):
            return {"ok": False, "error": EMPTY_PROMPT}
        owner = viewer.user_id
        if request.request_id is not None:
            earlier = await self.store.turn_of_request(owner, request.request_id)
            if earlier is not None:
                return await self._sent_again(sid, request, earlier)
        if await queue.queued_count(self.store, owner) >= self.queue_limit:
            return {"ok": False, "error": queue_full(self.queue_limit)}
        if request.session_id is not None:
            session = await self.store.get_session(request.session_id)
            if session is None or session.owner != owner:
                return {"ok": False, "error": UNKNOWN_SESSION}
        else:
            session = SessionRecord(new_id("s"), owner, session_title(request.prompt))
            await self.store.create_session(session)
        turn = TurnRecord(
            turn_id=new_id("t"),
            session_id=session.session_id,
            owner=owner,
            prompt=request.prompt,
            status="queued",
            wanted_drone=request.drone_id,
            messages=[ChatMessage(role="user", content=request.prompt)],
            request_id=request.request_id,
        )
        if request.session_id is not None:
            turn.created_at = await queue.dated_after(
                self.store, session.session_id, turn.created_at
            )
        now = turn.created_at
        if request.mode == "interrupt" and request.session_id is not None:
            turn.created_at = await queue.interrupt_place(self.store, session.session_id, turn)
        try:
            await self.store.create_turn(turn, self.queue_limit)
        except SessionGoneError:  # deleted at this very moment
            return {"ok": False, "error": UNKNOWN_SESSION}
        except QueueFullError:  # others of this person's came in meanwhile
            if request.session_id is None:
                await self.store.delete_session(session.session_id)  # made for nothing
            return {"ok": False, "error": queue_full(self.queue_limit)}
        except RequestTakenError:  # the same submit, sent again, landed at this very moment
            if request.session_id is None:
                await self.store.delete_session(session.session_id)  # made for nothing
            earlier = await self.store.turn_of_request(owner, request.request_id or "")
            if earlier is None:  # and its session was deleted since
                return {"ok": False, "error": UNKNOWN_SESSION}
            return await self._sent_again(sid, request, earlier)
        if turn.created_at != now:  # an interrupt dated before the session's follow-ups
            await queue.interrupt_placed(self.store, turn)
        await self.rooms.join_session(sid, session.session_id)
        await self.rooms.to_session(session.session_id, TURN_STARTED, turn.view().wire())
        if request.mode == "interrupt":  # what ran before it (a dispatcher may start it now)
            for running in await self.store.processing_turns(session_id=session.session_id):
                if running.turn_id != turn.turn_id and running.created_at < turn.created_at:
                    await self.abort(viewer, AbortWorkOrderRequest(turn_id=running.turn_id))
        self.dispatcher.wake()
        return {"ok": True, "turnId": turn.turn_id, "sessionId": session.session_id}

    async def _sent_again(
        self, sid: str, request: SubmitWorkOrder, earlier: TurnRecord
    ) -> dict[str, Any]:
        """A submit whose request id made ``earlier``: the first one's answer, if it is the
        same prompt (for the same session); this connection now follows that session."""
        if earlier.prompt != request.prompt or request.session_id not in (
            None,
            earlier.session_id,
        ):
            return {"ok": False, "error": REQUEST_ID_TAKEN}
        await self.rooms.join_session(sid, earlier.session_id)
        log.info("submit turn=%s sent again (request %s)", earlier.turn_id, request.request_id)
        return {
            "ok": True,
            "turnId": earlier.turn_id,
            "sessionId": earlier.session_id,
            "sentAgain": True,
        }

    async def abort(self, viewer: User, request: AbortWorkOrderRequest) -> tuple[bool, str]:
        """Abort a queued turn at once, or tell the drone running it (the intent is kept)."""
        turn = await self._abort_target(viewer, request)
        if isinstance(turn, str):
            return False, turn
        if turn.status == "queued":  # no step of it runs yet: either mode cancels it
            ending = Ending("aborted", ABORTED, "aborted", ended_by=viewer.name)
            if await self.end_here(turn.turn_id, ending, from_statuses=("queued",)):
                log.info("abort turn=%s before it started", turn.turn_id)
                return True, ABORT_SIGNALED
            turn = await self.store.get_turn(turn.turn_id, messages=False) or turn  # it started
            if turn.status == "aborted":  # cancelled that moment, from another tab
                return True, ABORT_SIGNALED
        if turn.status != "processing":
            return False, NO_ACTIVE_WORK_ORDER
        if request.mode == "now":  # "after this step" once the drone says it will
            self._asked(turn.turn_id, viewer)
        route = await self._drone_route(turn.drone_id)
        if route is None:
            # Its drone is away (maybe coming back): the abort is honoured now, and the drone
            # is told when it is heard from again (the turn has ended by then).
            log.info("abort turn=%s while its drone is away: ended by the relay", turn.turn_id)
            ended = await self.end_here(turn.turn_id, self._unanswered(viewer))
            return await self.honoured(turn.turn_id, ended)
        return await self._tell_drone(turn, route, request.mode, viewer)

    async def _abort_target(self, viewer: User, request: AbortWorkOrderRequest) -> TurnRecord | str:
        """The turn an abort is for, or why there is none. Someone else's turn is refused as
        an unknown one: a refusal tells nothing of others."""
        if request.turn_id is None:
            owner = None if viewer.admin and request.session_id else viewer.user_id
            mine = await self.store.processing_turns(owner=owner, session_id=request.session_id)
            if not mine:
                return NO_ACTIVE_WORK_ORDER
            return mine[-1]
        live = self.live.get(request.turn_id)
        if live is not None and self.directory.here(live.drone_id) is not None:
            # The turn's drone is connected here: no store round trip before the drone's answer.
            if not viewer.may_see(live.owner):
                return UNKNOWN_TURN
            return TurnRecord(
                live.turn_id, live.session_id, live.owner, "", "processing", drone_id=live.drone_id
            )
        lookup = asyncio.ensure_future(self.store.get_turn(request.turn_id, messages=False))
        try:
            turn = await asyncio.wait_for(asyncio.shield(lookup), STORE_WAIT)
        except Exception:  # the database is down or slow: Redis knows the running turns
            try:
                noted = await self.live_state.noted_turn(request.turn_id)
            except Exception:
                noted = None
            if noted is None:
                turn = await lookup  # not running, or Redis cannot say: the database's answer
            else:
                lookup.add_done_callback(_quietly)
                owner, session_id, drone_id = noted
                turn = TurnRecord(
                    request.turn_id, session_id, owner, "", "processing", drone_id=drone_id
                )
                log.info("abort turn=%s: the database is slow or down; Redis has it", turn.turn_id)
        if turn is None or not viewer.may_see(turn.owner):
            return UNKNOWN_TURN
        return turn

    def _asked(self, turn_id: str, viewer: User) -> None:
        """Keep that ``viewer`` asked to stop the turn: it ends aborted whatever else ends it,
        naming them (the store's note reaches every relay)."""
        self.abort_asked_by[turn_id] = viewer.name
        self.dispatcher.background.spawn(queue.request_abort(self.store, turn_id, viewer.name))

    @staticmethod
    def _unanswered(viewer: User) -> Ending:
        return Ending("aborted", ABORTED, "unanswered", ended_by=viewer.name)

    async def _tell_drone(
        self, turn: TurnRecord, route: DroneRoute, mode: str, viewer: User
    ) -> tuple[bool, str]:
        turn_id = turn.turn_id
        requested_at = time.monotonic()
        await self.live_state.abort_started(turn_id, viewer.name)
        order = AbortOrder(turn_id=turn_id, mode="after_step" if mode == "after_step" else "now")
        try:
            answer = await self.directory.call(
                ABORT_WORK_ORDER, order.wire(), route, within=self.abort_answer
            )
            known = _abort_answer(answer, order.mode)
            if known is None:
                log.warning(
                    "abort turn=%s drone=%s: an answer no drone gives (%s); ended by the relay",
                    turn_id,
                    route.drone_id,
                    cut(repr(answer), 200),
                )
                return await self._relay_ends(turn_id, viewer)
        except socketio.exceptions.SocketIOError:
            log.warning(
                "abort turn=%s drone=%s: no answer within %g s; ended by the relay",
                turn_id,
                route.drone_id,
                self.abort_answer,
            )
            return await self._relay_ends(turn_id, viewer)
        finally:
            # Marked just before the ack goes out: a completion waiting on it is sent after it.
            await self.live_state.abort_answered(turn_id)
        success, message = known
        self.metrics.abort_latency.observe(time.monotonic() - requested_at)
        log.info(
            "abort turn=%s drone=%s answer=%s %r in %.1f ms",
            turn_id,
            route.drone_id,
            success,
            message,
            (time.monotonic() - requested_at) * 1000,
        )
        # A drone that says it runs no such turn ended it: its completion is on its way, or was
        # lost (its first answer to the order was); either way the turn ends within the grace.
        if message == ABORT_SIGNALED or (mode == "now" and message == NO_ACTIVE_WORK_ORDER):
            if mode != "now":  # asked to stop after its step, the drone stops it now
                self._asked(turn_id, viewer)
            self.reaper.watch_abort(turn_id, finished=not success)
        elif message == STOP_AFTER_STEP:  # every tab shows it stops after its step
            self._asked(turn_id, viewer)
            stopping = {"turnId": turn_id, "sessionId": turn.session_id}
            await self.rooms.to_session(turn.session_id, TURN_STOPPING, stopping)
        return success, message

    async def _relay_ends(self, turn_id: str, viewer: User) -> tuple[bool, str]:
        """A drone frozen, gone, or answering what no drone does: the abort is honoured
        anyway. The turn ends now (announced after this ack, as always); the drone hears of
        it when it is heard from again."""
        try:
            ended = await self.end_here(turn_id, self._unanswered(viewer))
            return await self.honoured(turn_id, ended)
        except Exception as error:  # the store failed: the sweep ends the turn later
            log.warning("could not end turn=%s now: %s", turn_id, brief(error))
            return True, ABORT_SIGNALED

    async def _drone_route(self, drone_id: str | None) -> DroneRoute | None:
        """Where a turn's drone is, waiting (up to ``abort_answer``) for its entry when Redis
        has just come back empty and its relay has yet to write it again."""
        if drone_id is None:
            return None
        return self.directory.here(drone_id) or (
            await self.live_state.drone_settled(drone_id, self.abort_answer)
        )

    async def approve(self, viewer: User, answer: ToolApproval) -> dict[str, Any]:
        """Take a person's answer to a tool call of theirs waiting for approval to the drone
        (through another relay if it is connected there)."""
        turn = await self.store.get_turn(answer.turn_id, messages=False)
        if turn is None or not viewer.may_see(turn.owner):
            return {"ok": False, "error": UNKNOWN_TURN}
        if turn.owner != viewer.user_id:
            return {"ok": False, "error": OWNER_APPROVES}
        calls = {c["callId"]: c for c in await self.live_state.waiting(turn.turn_id)}
        call = calls.get(answer.call_id)
        if turn.status != "processing" or call is None:
            return {"ok": False, "error": NO_SUCH_CALL}
        route = await self._drone_route(turn.drone_id)
        if route is None:
            return {"ok": False, "error": DRONE_AWAY}
        try:
            result = await self.directory.call(
                APPROVE_TOOL_CALL, answer.wire(), route, within=self.abort_answer
            )
        except socketio.exceptions.SocketIOError:  # sent: a frozen drone takes it on waking
            log.info("tool call %s turn=%s: not confirmed", answer.call_id, turn.turn_id)
            return {"ok": False, "error": ANSWER_UNCONFIRMED}
        if not isinstance(result, dict) or not isinstance(result.get("ok"), bool):
            return {"ok": False, "error": "The drone gave an invalid answer."}
        if result["ok"] and answer.approve and answer.always:
            try:  # the call runs already: a store that fails now loses only the "always"
                await session_tools.approve_always(self.store, turn.session_id, str(call["name"]))
            except Exception as error:
                log.warning("always not kept turn=%s (%s)", turn.turn_id, brief(error))
        log.info("tool call %s turn=%s approve=%s", answer.call_id, turn.turn_id, answer.approve)
        refusal = {} if result["ok"] else {"error": drone_refusal(result) or NO_SUCH_CALL}
        return {"ok": result["ok"], **refusal}


def _quietly(task: asyncio.Future[Any]) -> None:
    """Take a finished lookup's outcome, which nobody awaits any more."""
    if not task.cancelled():
        task.exception()


ANSWERS = {
    "now": ((True, ABORT_SIGNALED), (False, NO_ACTIVE_WORK_ORDER)),
    "after_step": ((True, STOP_AFTER_STEP), (True, ABORT_SIGNALED), (False, NO_ACTIVE_WORK_ORDER)),
}
"""What a drone answers an abort with, by its mode (docs/protocol.md); "Abort signaled" to
"after this step" when it stops the turn at once (an abort of it was under way)."""


def _abort_answer(answer: Any, mode: str) -> tuple[bool, str] | None:
    """The drone's answer, or None for one no drone gives."""
    pair = tuple(answer) if isinstance(answer, (list, tuple)) else None
    return next((known for known in ANSWERS[mode] if known == pair), None)
