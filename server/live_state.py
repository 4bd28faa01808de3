"""What relays share besides the database: which drones are online where, the live text of
running turns, and aborts in flight. One relay keeps it in memory (``LocalLiveState``); several
share it through Redis (``RedisLiveState``).

Turns themselves live in the store, and so does what each drone runs (its processing turns):
this is only the fast-changing part, and all of it can be lost (a Redis restart) and rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from hangar.shared.protocol import DroneRecord

ENDED_READ = 1000
"""Endings read at most per ``ended_elsewhere`` call."""


class DroneRoute(DroneRecord):
    """A connected drone: what it is, where to reach it (its socket.io sid), and the hash of
    its process's instance secret (a reconnect must present the same secret)."""

    sid: str
    instance: str


class LiveText:
    """A running turn's text: a few pieces, not one per delta, and how many deltas it holds.

    A new delta is joined with the last pieces until the piece before them is at least twice
    as long as they are together, so each piece is at least twice the next: at most
    log2(length) + 1 pieces, and each character is copied O(log length) times however many
    deltas the text comes in (a list of deltas cost ~60 bytes of objects per delta, for ever).
    """

    __slots__ = ("count", "length", "pieces")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.count = 0
        self.length = 0

    def append(self, text: str) -> int:
        pieces = self.pieces
        pieces.append(text)
        self.length += len(text)
        cut, tail = len(pieces) - 1, len(text)
        while cut > 0 and len(pieces[cut - 1]) < 2 * tail:
            cut -= 1
            tail += len(pieces[cut])
        if cut < len(pieces) - 1:
            pieces[cut:] = ["".join(pieces[cut:])]
        self.count += 1
        return self.count

    def value(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def since(self, start: int) -> str:
        """The text from character ``start`` on, in time proportional to it (not to the whole
        text): the last pieces, the first of them cut."""
        tail: list[str] = []
        end = self.length
        for piece in reversed(self.pieces):
            if end <= start:
                break
            end -= len(piece)
            tail.append(piece[start - end :] if end < start else piece)
        return "".join(reversed(tail))


@dataclass
class LiveTurn:
    """A processing turn run by a drone connected to this relay."""

    turn_id: str
    session_id: str
    owner: str
    drone_id: str
    said: int = 0
    """How far into the turn's text (in the drone's characters) the relay has it."""
    units: int = 0
    """The same length in UTF-16 code units (where browsers put the next text)."""
    waiting: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Its calls waiting for a person (``tool`` events), by call id: written back to a live
    state that lost them."""


class LiveState(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def claim_drone(self, route: DroneRoute) -> DroneRoute | None:
        """The connection of another instance that holds the drone's id, or None: then the id
        is this one's, taken in one step (two relays letting one id in at once cannot both)."""

    async def add_drone(self, route: DroneRoute) -> None:
        """Register (or replace) a drone connected to this relay."""

    async def remove_drone(self, drone_id: str, sid: str) -> None:
        """Forget a drone, unless it has reconnected meanwhile (another sid)."""

    async def drones(self) -> list[DroneRoute]: ...

    async def silent_drones(self) -> set[str]:
        """Drones still listed whose relay stopped vouching for them (it died, say): silent
        for the time that relay gave them, so their turns need no further wait."""
        ...

    async def drone(self, drone_id: str) -> DroneRoute | None: ...

    async def drone_settled(self, drone_id: str, within: float) -> DroneRoute | None:
        """The drone's route; while the drones listed are in doubt (Redis failed or came back
        empty lately) waits up to ``within`` for its relay to list it again, and None after
        that (or if Redis does not answer)."""
        ...

    def endings_in_doubt(self) -> float | None:
        """Whether endings other relays made may have been missed since ``endings_checked``
        (Redis failed, or came back without its stream of ended turns): the time of the last
        failure seen, else None."""
        ...

    def endings_checked(self, since: float) -> None:
        """This relay's live turns were checked against the store, from a check that began
        when ``endings_in_doubt`` said ``since``."""

    def kept_turns(self) -> set[str]:
        """Turns this relay keeps text of."""
        ...

    def take_kept(self, turn_id: str) -> str:
        """The text this relay kept of a turn it streamed ("" if none), forgotten now."""
        ...

    async def note_turn(self, turn_id: str, owner: str, session_id: str, drone_id: str) -> None:
        """Whose a running turn is and where it runs, for a relay that cannot ask its database
        (it is down or slow) when a person aborts the turn; dropped by ``forget_turn``."""

    async def noted_turn(self, turn_id: str) -> tuple[str, str, str] | None:
        """``note_turn``'s owner, session and drone of a running turn."""

    async def append_text(self, turn_id: str, text: str) -> int:
        """Add a text delta; returns its sequence number (1 for the turn's first)."""

    async def text(self, turn_id: str) -> tuple[str, int]:
        """The turn's text so far and how many deltas it holds."""

    async def forget_turn(self, turn_id: str, tell_others: bool = True) -> None:
        """Drop what was kept of a turn that has ended (its text, its waiting calls), and let
        the other relays know it ended (``ended_elsewhere``) unless they were told already."""

    async def ended_elsewhere(self) -> list[str]:
        """Turns ended since the last call, by any relay, at most ``ENDED_READ``: a relay
        forgets its own live turns as it ends them, but not those another relay ended (its
        drone went on streaming here). One relay alone has none to hear of."""

    async def set_waiting(self, turn_id: str, call_id: str, call: dict[str, Any] | None) -> None:
        """Keep a tool call waiting for a person (its ``tool`` progress event), or drop it."""

    async def lost_everything(self) -> bool:
        """Whether the live state lost what it held since the last call (Redis restarted
        empty): what only this relay knows is to be written back."""

    async def waiting(self, turn_id: str) -> list[dict[str, Any]]:
        """The turn's tool calls waiting for a person."""

    async def keep_sub_agent(
        self, turn_id: str, event: dict[str, Any], size: int, limit: int
    ) -> int | None:
        """Keep what a snapshot shows of a sub-agent's progress event (``sub_agents``), of
        ``size`` characters, unless the turn's kept characters would pass ``limit`` (then
        nothing more of it is kept); returns how many the turn has kept now (its ``subSeq``)."""

    async def sub_agent_events(self, turn_id: str) -> list[dict[str, Any]]:
        """What ``keep_sub_agent`` kept of the turn, in order."""

    async def abort_started(self, turn_id: str, by: str) -> None:
        """``by`` asked to abort the turn; the drone's answer is awaited."""

    async def abort_asker(self, turn_id: str) -> str | None:
        """Who asked, through any relay, to abort the turn (None if no one, or unknown): the
        drone's relay names them in the ending when the database could not keep it."""

    async def abort_answered(self, turn_id: str) -> None: ...

    async def wait_abort_answered(self, turn_id: str, within: float) -> None:
        """Return once no abort of the turn is waiting for the drone's answer (bounded)."""


class LocalLiveState:
    """One relay: everything in memory, and the running turns' text in its database as well
    (``running_text``)."""

    def __init__(self) -> None:
        self.routes: dict[str, DroneRoute] = {}
        self.texts: dict[str, LiveText] = {}
        self.written: dict[str, int] = {}
        """How many characters of each running turn's text are in the database."""
        self.unwritten: set[str] = set()
        """Turns whose text grew since it was last written."""
        self.aborts: dict[str, asyncio.Event] = {}
        self.calls: dict[str, dict[str, dict[str, Any]]] = {}
        self.subs: dict[str, list[dict[str, Any]]] = {}
        self.sub_chars: dict[str, int] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def claim_drone(self, route: DroneRoute) -> DroneRoute | None:
        held = self.routes.get(route.drone_id)  # one relay: its connects of an id wait in turn
        return held if held is not None and held.instance != route.instance else None

    async def add_drone(self, route: DroneRoute) -> None:
        self.routes[route.drone_id] = route

    async def remove_drone(self, drone_id: str, sid: str) -> None:
        route = self.routes.get(drone_id)
        if route is not None and route.sid == sid:
            del self.routes[drone_id]

    async def silent_drones(self) -> set[str]:
        return set()  # one relay: its drones are the ones connected to it

    async def drones(self) -> list[DroneRoute]:
        return list(self.routes.values())

    async def drone(self, drone_id: str) -> DroneRoute | None:
        return self.routes.get(drone_id)

    async def drone_settled(self, drone_id: str, within: float) -> DroneRoute | None:
        return self.routes.get(drone_id)

    def endings_in_doubt(self) -> float | None:
        return None  # one relay makes every ending itself

    def endings_checked(self, since: float) -> None:
        pass

    def kept_turns(self) -> set[str]:
        return set()  # its text is the live state's own, dropped as the turn ends

    def take_kept(self, turn_id: str) -> str:
        live = self.texts.pop(turn_id, None)
        self.written.pop(turn_id, None)
        return live.value() if live is not None else ""

    async def note_turn(self, turn_id: str, owner: str, session_id: str, drone_id: str) -> None:
        pass  # one relay: its running turns are live here

    async def noted_turn(self, turn_id: str) -> tuple[str, str, str] | None:
        return None

    async def append_text(self, turn_id: str, text: str) -> int:
        live = self.texts.get(turn_id)
        if live is None:
            live = self.texts[turn_id] = LiveText()
        self.unwritten.add(turn_id)
        return live.append(text)

    def restore(self, turn_id: str, text: str) -> None:
        """A running turn's text as the database holds it (this relay restarted)."""
        live = self.texts[turn_id] = LiveText()
        live.append(text)
        self.written[turn_id] = len(text)

    def to_write(self) -> list[tuple[str, int, str]]:
        """What of the running turns' text the database lacks: (turn, offset, text) each, taken
        as written (``not_written`` gives it back)."""
        pieces = []
        for turn_id in self.unwritten:
            live = self.texts.get(turn_id)
            at = self.written.get(turn_id, 0)
            if live is not None and live.length > at:
                pieces.append((turn_id, at, live.since(at)))
                self.written[turn_id] = live.length
        self.unwritten.clear()
        return pieces

    def not_written(self, pieces: list[tuple[str, int, str]]) -> None:
        """Pieces ``to_write`` gave that the database did not take: to be written again."""
        for turn_id, at, _ in pieces:
            if turn_id in self.texts:
                self.written[turn_id] = min(self.written.get(turn_id, at), at)
                self.unwritten.add(turn_id)

    async def text(self, turn_id: str) -> tuple[str, int]:
        live = self.texts.get(turn_id)
        return (live.value(), live.count) if live is not None else ("", 0)

    async def forget_turn(self, turn_id: str, tell_others: bool = True) -> None:
        self.texts.pop(turn_id, None)
        self.written.pop(turn_id, None)
        self.unwritten.discard(turn_id)
        self.calls.pop(turn_id, None)
        self.subs.pop(turn_id, None)
        self.sub_chars.pop(turn_id, None)

    async def ended_elsewhere(self) -> list[str]:
        return []  # one relay: every ending is its own

    async def lost_everything(self) -> bool:
        return False  # it lives and dies with this relay

    async def set_waiting(self, turn_id: str, call_id: str, call: dict[str, Any] | None) -> None:
        if call is not None:
            self.calls.setdefault(turn_id, {})[call_id] = call
        elif (calls := self.calls.get(turn_id)) is not None:
            calls.pop(call_id, None)

    async def waiting(self, turn_id: str) -> list[dict[str, Any]]:
        return list(self.calls.get(turn_id, {}).values())

    async def keep_sub_agent(
        self, turn_id: str, event: dict[str, Any], size: int, limit: int
    ) -> int | None:
        self.sub_chars[turn_id] = chars = self.sub_chars.get(turn_id, 0) + size
        if chars > limit:
            return None
        kept = self.subs.setdefault(turn_id, [])
        kept.append(event)
        return len(kept)

    async def sub_agent_events(self, turn_id: str) -> list[dict[str, Any]]:
        return list(self.subs.get(turn_id, ()))

    async def abort_started(self, turn_id: str, by: str) -> None:
        self.aborts[turn_id] = asyncio.Event()

    async def abort_asker(self, turn_id: str) -> str | None:
        return None  # one relay: it knows who asked (``abort_asked_by``)

    async def abort_answered(self, turn_id: str) -> None:
        event = self.aborts.pop(turn_id, None)
        if event is not None:
            event.set()

    async def wait_abort_answered(self, turn_id: str, within: float) -> None:
        event = self.aborts.get(turn_id)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), within)
