"""The ``TurnStore`` contract, checked against every implementation (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import pytest

from hangar.server import running_text
from hangar.server.accounts import AccountError, Accounts, User
from hangar.server.closing import MessageRefused
from hangar.server.histories import session_history
from hangar.server.live_state import LocalLiveState
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.sqlite_store import SqliteTurnStore
from hangar.server.store import (
    SEARCHED_CHARS,
    Ending,
    RequestTakenError,
    SessionBusyError,
    SessionRecord,
    TurnRecord,
    TurnStore,
)
from hangar.shared.protocol import (
    TERMINAL_STATUSES,
    ChatMessage,
    EndReason,
    ToolCall,
    TurnStatus,
)

STORES = ["sqlite", "postgres"]
REASONS: dict[TurnStatus, EndReason] = {
    "finished": "finished",
    "aborted": "aborted",
    "error": "drone_failed",
    "processing": "finished",
    "queued": "finished",
}
T = TypeVar("T")


@dataclass
class Location:
    kind: str
    where: str

    def store(self) -> TurnStore:
        if self.kind == "sqlite":
            return SqliteTurnStore(self.where)
        return PostgresTurnStore(self.where)


@pytest.fixture(params=STORES)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """Where a store of each kind lives: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "postgres":
        return Location("postgres", cast(str, request.getfixturevalue("postgres_url")))
    return Location("sqlite", str(tmp_path / "store.db"))


@pytest.fixture
async def store(location: Location) -> AsyncIterator[TurnStore]:
    """An opened, empty store of each kind; closed afterwards."""
    opened = location.store()
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


async def end(store: TurnStore, turn_id: str, status: TurnStatus, result: str, text: str) -> bool:
    """End a turn as the relay does; whether this write was the one that ended it."""
    return await store.end_turn(turn_id, Ending(status, result, REASONS[status], text)) is not None


async def new_session(
    store: TurnStore, session_id: str, owner: str = "alice", created_at: float = 1000.0
) -> SessionRecord:
    session = SessionRecord(session_id, owner, f"Title of {session_id}", created_at)
    await store.create_session(session)
    return session


async def new_turn(
    store: TurnStore,
    turn_id: str,
    session_id: str,
    owner: str = "alice",
    created_at: float = 2000.0,
    messages: list[ChatMessage] | None = None,
    started_at: float | None = None,
) -> TurnRecord:
    turn = TurnRecord(
        started_at=started_at,
        turn_id=turn_id,
        session_id=session_id,
        owner=owner,
        prompt=f"prompt of {turn_id}",
        drone_id="drone-1",
        created_at=created_at,
        messages=messages if messages is not None else [ChatMessage(role="user", content="Hi")],
    )
    await store.create_turn(turn)
    return turn


def rich_messages() -> list[ChatMessage]:
    """Messages using every optional field, with text that is awkward to store."""
    return [
        ChatMessage(role="system", content="You are terse."),
        ChatMessage(role="user", content="Read 'a.txt' — «ünïcødé» 🚀\nline two\t\"quoted\"\\"),
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=[
                ToolCall(id="call_1", name="read_file", arguments='{"path": "a.txt"}'),
                ToolCall(id="call:2.b-c", name="run", arguments="{}"),
            ],
        ),
        ChatMessage(role="tool", content="contents of a", tool_call_id="call_1", name="read_file"),
        ChatMessage(role="tool", content="", tool_call_id="call:2.b-c", name="run"),
        ChatMessage(role="assistant", content="Partial answ", aborted=True),
        ChatMessage(role="assistant", content="Complete.", aborted=False),
    ]


# ---- sessions


async def test_a_created_session_can_be_read_back(store: TurnStore) -> None:
    session = await new_session(store, "s_1", created_at=1234.5678)

    assert await store.get_session("s_1") == session
    assert await store.get_session("s_missing") is None


async def test_a_search_looks_at_the_start_of_each_prompt_in_any_case(store: TurnStore) -> None:
    near, far = "x" * (SEARCHED_CHARS - 20), "x" * SEARCHED_CHARS
    for session_id, prompt in [("s_near", f"{near}NeedLe 100%"), ("s_far", f"{far}needle")]:
        await new_session(store, session_id)
        await store.create_turn(TurnRecord(f"t_{session_id}", session_id, "alice", prompt))

    assert [s.session_id for s in await store.list_sessions("alice", "nEEDLE")] == ["s_near"]
    assert [s.session_id for s in await store.list_sessions("alice", "0%")] == ["s_near"]
    assert await store.list_sessions("alice", "e_1") == []  # "_" is no wildcard
    assert [s.session_id for s in await store.list_sessions("alice", "TITLE OF S_FAR")] == ["s_far"]


async def test_a_search_is_quick_whatever_it_looks_for(store: TurnStore) -> None:
    """``LIKE '%…%'`` backtracked: one search of 200 characters over 200 prompts of 100,000
    took 3.3 s of the SQLite store's one thread (every person's work waited behind it) and
    4.6 s of PostgreSQL's; now 0.02 s."""
    for index in range(200):
        await new_session(store, f"s_{index}")
        await store.create_turn(TurnRecord(f"t_{index}", f"s_{index}", "alice", "a" * 100_000))
    loop = asyncio.get_running_loop()

    for query in ("a" * 199 + "b", "b" + "a" * 199):
        started = loop.time()
        assert await store.list_sessions("alice", query) == []
        assert loop.time() - started < 1.0, query[:2]


async def test_sessions_are_listed_per_owner_newest_first(store: TurnStore) -> None:
    await new_session(store, "s_old", "alice", created_at=100.0)
    await new_session(store, "s_bob", "bob", created_at=150.0)
    await new_session(store, "s_new", "alice", created_at=300.0)
    await new_session(store, "s_mid", "alice", created_at=200.0)

    alice = await store.list_sessions("alice")
    assert [s.session_id for s in alice] == ["s_new", "s_mid", "s_old"]
    assert all(s.owner == "alice" for s in alice)
    assert [s.session_id for s in await store.list_sessions("bob")] == ["s_bob"]
    assert await store.list_sessions("carol") == []


# ---- turns and messages


async def test_a_turn_is_stored_processing_with_its_first_messages(store: TurnStore) -> None:
    await new_session(store, "s_1")
    first = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Q")]
    created = await new_turn(store, "t_1", "s_1", created_at=2000.25, messages=first)

    turn = await store.get_turn("t_1")

    assert turn is not None
    assert turn.status == "processing"
    assert (turn.turn_id, turn.session_id, turn.owner, turn.prompt, turn.drone_id) == (
        "t_1",
        "s_1",
        "alice",
        created.prompt,
        "drone-1",
    )
    assert (turn.result, turn.text, turn.ended_at) == (None, "", None)
    assert turn.created_at == 2000.25
    assert turn.messages == first
    assert await store.get_turn("t_missing") is None


async def test_get_turn_without_messages_omits_them(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1", messages=rich_messages())

    bare = await store.get_turn("t_1", messages=False)

    assert bare is not None and bare.messages == []
    assert bare.status == "processing" and bare.prompt == "prompt of t_1"


async def test_appended_messages_keep_their_order_and_round_trip_exactly(
    store: TurnStore,
) -> None:
    await new_session(store, "s_1")
    first = [ChatMessage(role="user", content="Start")]
    await new_turn(store, "t_1", "s_1", messages=first)
    later = rich_messages()

    await store.append_messages("t_1", later[:3])
    await store.append_messages("t_1", [])
    await store.append_messages("t_1", later[3:4])
    await store.append_messages("t_1", later[4:])

    turn = await store.get_turn("t_1")
    assert turn is not None
    assert turn.messages == first + later
    assert [m.wire() for m in turn.messages] == [m.wire() for m in first + later]
    assert turn.messages[3].tool_calls is not None
    assert turn.messages[3].tool_calls[1].id == "call:2.b-c"
    assert turn.messages[-2].aborted is True and turn.messages[-1].aborted is False
    assert turn.messages[1].aborted is None


async def test_turns_of_a_session_are_listed_oldest_first_with_their_messages(
    store: TurnStore,
) -> None:
    await new_session(store, "s_1")
    await new_session(store, "s_2")
    for number, created_at in enumerate([10.0, 20.0, 30.0]):
        turn_id = f"t_{number}"
        await new_turn(
            store,
            turn_id,
            "s_1",
            created_at=created_at,
            messages=[ChatMessage(role="user", content=f"q{number}")],
        )
        await end(store, turn_id, "finished", "done", f"a{number}")
    await new_turn(store, "t_other", "s_2")

    turns = await store.list_turns("s_1")

    assert [t.turn_id for t in turns] == ["t_0", "t_1", "t_2"]
    assert [[m.content for m in t.messages] for t in turns] == [["q0"], ["q1"], ["q2"]]
    assert await store.list_turns("s_missing") == []


async def test_a_long_session_is_read_a_page_at_a_time_latest_first(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await new_session(store, "s_2")
    for number in range(75):
        prompt = [ChatMessage(role="user", content=f"prompt of t_{number:03d}")]
        await new_turn(store, f"t_{number:03d}", "s_1", created_at=float(number), messages=prompt)
        await end(store, f"t_{number:03d}", "finished", "done", "")
    await new_turn(store, "t_other", "s_2", created_at=50.5)

    latest, more = await store.recent_turns("s_1", 30)
    before, more_before = await store.recent_turns("s_1", 30, before=latest[0].turn_id)
    first, more_first = await store.recent_turns("s_1", 30, before=before[0].turn_id)

    assert [t.turn_id for t in latest] == [f"t_{n:03d}" for n in range(45, 75)]
    assert [t.turn_id for t in before] == [f"t_{n:03d}" for n in range(15, 45)]
    assert [t.turn_id for t in first] == [f"t_{n:03d}" for n in range(15)]
    assert (more, more_before, more_first) == (True, True, False)
    assert [m.content for m in latest[0].messages] == ["prompt of t_045"]


# ---- first terminal write wins


@pytest.mark.parametrize("first", TERMINAL_STATUSES)
async def test_the_first_terminal_write_wins(store: TurnStore, first: TurnStatus) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")

    assert await end(store, "t_1", first, f"result {first}", f"text {first}") is True
    for later in TERMINAL_STATUSES:
        assert await end(store, "t_1", later, "late result", "late text") is False
    assert await end(store, "t_1", "processing", "reopened", "") is False

    turn = await store.get_turn("t_1")
    assert turn is not None
    assert (turn.status, turn.result, turn.text) == (first, f"result {first}", f"text {first}")
    assert turn.ended_at is not None and turn.ended_at >= turn.created_at


async def test_an_ending_that_brings_the_drones_last_messages_stores_them_first_and_once(
    store: TurnStore,
) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")
    await store.add_message("t_1", ChatMessage(role="assistant", content="Look"), 0)
    # The drone's message 0 again (its first answer was lost) and message 1, with the ending.
    call = ToolCall(id="call_1", name="read_file", arguments="{}")
    asked = ChatMessage(role="assistant", content="Look", tool_calls=[call])
    partial = ChatMessage(role="assistant", content="It says", aborted=True)
    ending = Ending("aborted", "aborted", "aborted", messages=((0, asked), (1, partial)))

    assert await store.end_turn("t_1", ending) is not None

    turn = await store.get_turn("t_1")
    assert turn is not None and turn.status == "aborted"
    # Message 0 kept once (as first stored), message 1 added, then what keeps it valid.
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "Hi"), ("assistant", "Look"), ("assistant", "It says")
    ]  # fmt: skip
    # Once ended, the same ending again stores nothing more.
    assert await store.end_turn("t_1", ending) is None
    again = await store.get_turn("t_1")
    assert again is not None and again.messages == turn.messages


async def test_a_drones_message_out_of_place_in_the_conversation_is_refused_and_not_stored(
    store: TurnStore,
) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")
    calls = [ToolCall(id="c1", name="read_file"), ToolCall(id="c2", name="list_files")]
    asked = ChatMessage(role="assistant", content="Look", tool_calls=calls)
    one, two = (ChatMessage(role="tool", content="ok", tool_call_id=c.id) for c in calls)
    final = ChatMessage(role="assistant", content="Done")
    twice = ChatMessage(role="assistant", content="Look", tool_calls=[calls[0], calls[0]])
    with pytest.raises(MessageRefused, match="one id"):
        await store.add_message("t_1", twice, 0)
    assert await store.add_message("t_1", asked, 0)
    assert await store.add_message("t_1", asked, 0)  # sent again: stored once, not refused
    for message, why in [
        (final, "need their results"),
        (ChatMessage(role="system", content="Obey"), "only the model's"),
        (ChatMessage(role="tool", content="?", tool_call_id="c9"), "answers no call"),
    ]:
        with pytest.raises(MessageRefused, match=why):
            await store.add_message("t_1", message, 1)
    assert await store.add_message("t_1", two, 1)  # results in any order
    with pytest.raises(MessageRefused, match="answers no call"):
        await store.add_message("t_1", two, 2)  # the same call answered twice
    # An ending that brings a message out of place is refused whole.
    bad = Ending("finished", "done", "finished", messages=((2, final), (3, one)))
    with pytest.raises(MessageRefused, match="need their results"):
        await store.end_turn("t_1", bad)
    ending = Ending("finished", "done", "finished", messages=((2, one), (3, final)))
    assert await store.end_turn("t_1", ending) is not None

    turn = await store.get_turn("t_1")
    assert turn is not None and turn.status == "finished"
    assert turn.messages == [ChatMessage(role="user", content="Hi"), asked, two, one, final]


async def test_a_message_sent_again_is_stored_once_also_after_one_was_refused(
    store: TurnStore,
) -> None:
    """The drone numbers each message it sends, refused ones too: the relay knows a message
    sent again by its number, not by how many it has stored."""
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")
    asked = ChatMessage(role="assistant", content="Look", tool_calls=[ToolCall(id="c1", name="f")])
    stray = ChatMessage(role="tool", content="?", tool_call_id="c9")
    answered = ChatMessage(role="tool", content="ok", tool_call_id="c1")
    final = ChatMessage(role="assistant", content="Done")
    assert await store.add_message("t_1", asked, 0)
    with pytest.raises(MessageRefused):
        await store.add_message("t_1", stray, 1)
    for number, message in [(2, answered), (3, final), (3, final), (2, answered)]:
        assert await store.add_message("t_1", message, number)  # the last two: acks lost
    ending = Ending("finished", "done", "finished", messages=((3, final),))
    assert await store.end_turn("t_1", ending) is not None

    turn = await store.get_turn("t_1")
    assert turn is not None
    assert turn.messages == [ChatMessage(role="user", content="Hi"), asked, answered, final]


async def test_text_a_relay_kept_past_the_ending_grows_the_cut_answer_instead_of_a_second_one(
    store: TurnStore,
) -> None:
    """The drone's relay received more of the answer than the relay that ended the turn had
    (the drone streamed on until it heard of the abort): one answer, whole, flagged cut."""
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")
    assert await end(store, "t_1", "aborted", "aborted", "It sa")

    assert await store.fill_text("t_1", "It says more")
    assert not await store.fill_text("t_1", "It says")  # shorter: nothing to add

    turn = await store.get_turn("t_1")
    assert turn is not None and turn.text == "It says more"
    assert [(m.role, m.content, bool(m.aborted)) for m in turn.messages] == [
        ("user", "Hi", False), ("assistant", "It says more", True)
    ]  # fmt: skip


async def used_bytes(store: TurnStore, location: Location) -> int:
    """What the store's turns and messages take: SQLite's pages in use, PostgreSQL's tables
    (their rows and what is stored out of line, not their indexes, which hold no answer)."""
    if location.kind == "sqlite":
        sql = (
            "SELECT ((SELECT page_count FROM pragma_page_count())"
            " - (SELECT freelist_count FROM pragma_freelist_count()))"
            " * (SELECT page_size FROM pragma_page_size()) AS used"
        )
    else:
        sql = "SELECT pg_table_size('turns') + pg_table_size('messages') AS used"
    return int((await store.fetch(sql))[0]["used"])


async def test_an_answer_is_stored_once_and_read_whole_whoever_ends_its_turn(
    store: TurnStore, location: Location
) -> None:
    """An ended turn's answer is in its messages: the store does not keep it a second time as
    the turn's text (docs/architecture.md, "Storage and several relays"), and every read still
    gives the text."""
    size = 1_000_000
    answers = [base64.b64encode(random.randbytes(size * 3 // 4)).decode() for _ in range(3)]
    await new_session(store, "s_1")
    await new_session(store, "s_2")
    await new_session(store, "s_3")
    before = await used_bytes(store, location)

    # Finished: the drone's last message is the answer, and the text streamed is the same.
    await new_turn(store, "t_1", "s_1")
    said = ChatMessage(role="assistant", content=answers[0])
    assert await store.end_turn("t_1", Ending("finished", "done", "finished", answers[0],
                                                messages=((0, said),)))  # fmt: skip
    # Aborted mid-answer: what streamed becomes the turn's cut answer.
    await new_turn(store, "t_2", "s_2")
    assert await end(store, "t_2", "aborted", "aborted", answers[1][: size // 2])
    # Ended by another relay, and the drone's relay kept more of it (``fill_text``).
    await new_turn(store, "t_3", "s_3")
    assert await end(store, "t_3", "error", "lost", answers[2][: size // 2])
    assert await store.fill_text("t_3", answers[2])

    grew = await used_bytes(store, location) - before
    assert grew < 1.3 * (size + size // 2 + size), f"{grew:,} bytes for 2.5 MB of answers"
    expected = {"t_1": answers[0], "t_2": answers[1][: size // 2], "t_3": answers[2]}
    for turn_id, text in expected.items():
        read = await store.get_turn(turn_id)
        assert read is not None and read.text == text
        assert "".join(m.content for m in read.messages if m.role == "assistant") == text
    for session_id, turn_id in [("s_1", "t_1"), ("s_2", "t_2"), ("s_3", "t_3")]:
        [listed] = await store.list_turns(session_id)
        [recent], _ = await store.recent_turns(session_id, 5)
        assert listed.text == recent.text == expected[turn_id]


async def test_a_finished_turns_text_that_went_past_its_messages_is_kept(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")
    await store.add_message("t_1", ChatMessage(role="assistant", content="Half"), 0)

    assert await end(store, "t_1", "finished", "done", "Half and the rest")

    [turn] = await store.list_turns("s_1")
    assert turn.text == "Half and the rest"


async def test_an_ending_with_messages_for_a_queued_turn_stores_nothing(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await store.create_turn(
        TurnRecord(
            "t_q",
            "s_1",
            "alice",
            "Q",
            status="queued",
            messages=[ChatMessage(role="user", content="Q")],
        )
    )
    stray = Ending(
        "finished", "done", "finished", messages=((0, ChatMessage(role="assistant", content="A")),)
    )

    assert await store.end_turn("t_q", stray) is None

    turn = await store.get_turn("t_q")
    assert turn is not None and turn.status == "queued"
    assert [m.content for m in turn.messages] == ["Q"]


async def test_ending_an_unknown_turn_changes_nothing(store: TurnStore) -> None:
    assert await end(store, "t_missing", "finished", "done", "") is False
    assert await store.get_turn("t_missing") is None


async def test_exactly_one_of_many_concurrent_terminal_writes_wins(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1")
    attempts: list[tuple[TurnStatus, str, str]] = [
        (TERMINAL_STATUSES[i % 3], f"result {i}", f"text {i}") for i in range(20)
    ]

    outcomes = await asyncio.gather(
        *(end(store, "t_1", status, result, text) for status, result, text in attempts)
    )

    assert outcomes.count(True) == 1
    winner = attempts[outcomes.index(True)]
    turn = await store.get_turn("t_1")
    assert turn is not None
    assert (turn.status, turn.result, turn.text) == winner


# ---- one processing turn per session


async def test_a_session_has_at_most_one_processing_turn(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await new_turn(store, "t_1", "s_1", created_at=10.0)

    with pytest.raises(SessionBusyError):
        await new_turn(store, "t_2", "s_1", created_at=20.0)
    assert await store.get_turn("t_2") is None
    assert [t.turn_id for t in await store.list_turns("s_1")] == ["t_1"]

    assert await end(store, "t_1", "aborted", "aborted", "") is True
    await new_turn(store, "t_3", "s_1", created_at=30.0)

    assert [t.turn_id for t in await store.processing_turns(session_id="s_1")] == ["t_3"]
    assert [t.turn_id for t in await store.list_turns("s_1")] == ["t_1", "t_3"]


async def test_a_turn_is_found_by_its_owners_request_id_which_makes_no_second_turn(
    store: TurnStore,
) -> None:
    await new_session(store, "s_1")
    await new_session(store, "s_2", owner="bob")

    def turn(turn_id: str, session_id: str, owner: str, request_id: str | None) -> TurnRecord:
        return TurnRecord(turn_id, session_id, owner, "Hi", "queued", request_id=request_id)

    await store.create_turn(turn("t_1", "s_1", "alice", "r_1"))
    await store.create_turn(turn("t_2", "s_2", "bob", "r_1"))  # another person's key
    await store.create_turn(turn("t_3", "s_1", "alice", None))
    await store.create_turn(turn("t_4", "s_1", "alice", None))  # no key: never "the same"
    with pytest.raises(RequestTakenError):
        await store.create_turn(turn("t_5", "s_1", "alice", "r_1"))

    found = await store.turn_of_request("alice", "r_1")
    assert found is not None and (found.turn_id, found.request_id) == ("t_1", "r_1")
    found = await store.turn_of_request("bob", "r_1")
    assert found is not None and found.turn_id == "t_2"
    assert await store.turn_of_request("alice", "r_2") is None
    assert await store.get_turn("t_5") is None
    assert [t.turn_id for t in await store.list_turns("s_1")] == ["t_1", "t_3", "t_4"]


async def test_a_busy_session_does_not_block_other_sessions(store: TurnStore) -> None:
    await new_session(store, "s_1")
    await new_session(store, "s_2")
    await new_turn(store, "t_1", "s_1")

    await new_turn(store, "t_2", "s_2")

    assert {t.turn_id for t in await store.processing_turns()} == {"t_1", "t_2"}


async def test_concurrent_turns_in_one_session_let_exactly_one_in(store: TurnStore) -> None:
    await new_session(store, "s_1")

    outcomes = await asyncio.gather(
        *(new_turn(store, f"t_{i}", "s_1", created_at=float(i)) for i in range(10)),
        return_exceptions=True,
    )

    created = [o for o in outcomes if isinstance(o, TurnRecord)]
    assert len(created) == 1
    assert all(isinstance(o, SessionBusyError) for o in outcomes if o not in created)
    assert [t.turn_id for t in await store.list_turns("s_1")] == [created[0].turn_id]
    stored = await store.get_turn(created[0].turn_id)
    assert stored is not None and [m.content for m in stored.messages] == ["Hi"]


async def after_yields(count: int, work: Awaitable[T]) -> T:
    """``work``, started after ``count`` passes through the event loop."""
    for _ in range(count):
        await asyncio.sleep(0)
    return await work


async def test_a_refused_turn_does_not_undo_a_concurrent_ending(store: TurnStore) -> None:
    await new_session(store, "s_busy")
    await new_turn(store, "t_busy", "s_busy")
    problems: list[str] = []
    for refused_after in range(4):
        for ended_after in range(4):
            session_id = f"s_{refused_after}_{ended_after}"
            await new_session(store, session_id)
            ending = await new_turn(store, f"t_{refused_after}_{ended_after}", session_id)
            refused, ended = await asyncio.gather(
                after_yields(refused_after, new_turn(store, f"t_x{session_id}", "s_busy")),
                after_yields(ended_after, end(store, ending.turn_id, "finished", "ok", "")),
                return_exceptions=True,
            )
            assert isinstance(refused, SessionBusyError) and ended is True
            turn = await store.get_turn(ending.turn_id)
            assert turn is not None
            if turn.status != "finished":
                problems.append(f"{ending.turn_id}: won, yet stored as {turn.status}")
            if await end(store, ending.turn_id, "error", "late", ""):
                problems.append(f"{ending.turn_id}: a second terminal write won too")

    assert problems == []


# ---- processing turns


async def test_processing_turns_filter_by_owner_and_session_and_skip_ended_ones(
    store: TurnStore,
) -> None:
    await new_session(store, "s_a1", "alice")
    await new_session(store, "s_a2", "alice")
    await new_session(store, "s_a3", "alice")
    await new_session(store, "s_b1", "bob")
    await new_turn(store, "t_a1", "s_a1", "alice", created_at=30.0)
    await new_turn(store, "t_a2", "s_a2", "alice", created_at=10.0)
    await new_turn(store, "t_a3", "s_a3", "alice", created_at=20.0)
    await new_turn(store, "t_b1", "s_b1", "bob", created_at=15.0)
    await end(store, "t_a3", "finished", "done", "")

    def ids(turns: list[TurnRecord]) -> list[str]:
        return [t.turn_id for t in turns]

    assert ids(await store.processing_turns()) == ["t_a2", "t_b1", "t_a1"]
    assert ids(await store.processing_turns(owner="alice")) == ["t_a2", "t_a1"]
    assert ids(await store.processing_turns(owner="bob")) == ["t_b1"]
    assert ids(await store.processing_turns(owner="carol")) == []
    assert ids(await store.processing_turns(session_id="s_a1")) == ["t_a1"]
    assert ids(await store.processing_turns(session_id="s_a3")) == []
    assert ids(await store.processing_turns(owner="alice", session_id="s_a2")) == ["t_a2"]
    assert ids(await store.processing_turns(owner="bob", session_id="s_a2")) == []
    processing = await store.processing_turns()
    assert all(t.status == "processing" and t.messages == [] for t in processing)


# ---- history


async def test_session_history_concatenates_every_turns_messages_in_order(
    store: TurnStore,
) -> None:
    await new_session(store, "s_1")
    await new_session(store, "s_other")
    messages = rich_messages()
    await new_turn(store, "t_1", "s_1", created_at=10.0, messages=messages[:2])
    await store.append_messages("t_1", messages[2:5])
    await end(store, "t_1", "finished", "ok", "")
    await new_turn(store, "t_other", "s_other", created_at=15.0)
    await new_turn(store, "t_2", "s_1", created_at=20.0, messages=messages[5:6], started_at=21.0)
    await end(store, "t_2", "aborted", "aborted", "Partial answ")
    await new_turn(store, "t_3", "s_1", created_at=30.0, messages=[])
    await store.append_messages("t_3", messages[6:])

    assert await session_history(store, "s_1") == messages
    assert await session_history(store, "s_missing") == []


# ---- opening and migrating


async def test_opening_an_existing_store_again_keeps_its_data(location: Location) -> None:
    first = location.store()
    await first.open()
    try:
        await new_session(first, "s_1")
        await new_turn(first, "t_1", "s_1", messages=rich_messages())
    finally:
        await first.close()

    for _ in range(2):
        again = location.store()
        await again.open()
        try:
            turn = await again.get_turn("t_1")
            assert turn is not None and turn.messages == rich_messages()
            assert [s.session_id for s in await again.list_sessions("alice")] == ["s_1"]
            with pytest.raises(SessionBusyError):
                await new_turn(again, "t_2", "s_1")
        finally:
            await again.close()


async def test_two_stores_opened_at_once_on_a_fresh_postgres_database_both_work(
    postgres_url: str,
) -> None:
    stores = [PostgresTurnStore(postgres_url) for _ in range(4)]
    try:
        await asyncio.gather(*(s.open() for s in stores))
        await new_session(stores[0], "s_1")
        await new_turn(stores[1], "t_1", "s_1")

        for each in stores:
            turn = await each.get_turn("t_1")
            assert turn is not None and turn.status == "processing"
        with pytest.raises(SessionBusyError):
            await new_turn(stores[2], "t_2", "s_1")
        ends = await asyncio.gather(
            *(end(s, "t_1", "finished", f"by {i}", "") for i, s in enumerate(stores))
        )
        assert ends.count(True) == 1
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_text_with_nul_characters_is_kept_as_a_replacement_on_postgres(
    store: TurnStore, location: Location
) -> None:
    nul = "\x00" if location.kind == "sqlite" else "\ufffd"  # PostgreSQL text cannot hold NUL
    await new_session(store, "s_1")
    await store.create_session(SessionRecord("s_2", "alice", "nul \x00 title", 1.0))
    message = ChatMessage(role="tool", content="binary\x00output", tool_call_id="c1")
    turn = TurnRecord("t_1", "s_1", "alice", "prompt \x00", messages=[message])
    await store.create_turn(turn)
    await store.append_messages("t_1", [message])

    assert await end(store, "t_1", "finished", "done \x00", "text \x00") is True

    stored = await store.get_turn("t_1")
    assert stored is not None
    assert (stored.prompt, stored.result, stored.text) == (
        f"prompt {nul}",
        f"done {nul}",
        f"text {nul}",
    )
    kept = message.model_copy(update={"content": f"binary{nul}output"})
    assert stored.messages == [kept, kept]
    session = await store.get_session("s_2")
    assert session is not None and session.title == f"nul {nul} title"


async def test_a_running_turns_text_is_written_as_it_grows_read_back_whole_and_dropped_at_its_end(
    store: TurnStore, location: Location
) -> None:
    """docs/reliability.md, "a relay that dies": a relay without Redis writes its running turns'
    text as it streams (only what is new each time), and a restarted one reads it back."""
    nul = "\x00" if location.kind == "sqlite" else "\ufffd"
    await new_session(store, "s_1")
    await new_session(store, "s_2")
    await new_turn(store, "t_1", "s_1")
    await new_turn(store, "t_2", "s_2")
    live = LocalLiveState()
    deltas = ["Hello, ", "wörld 🚀", " and \x00", " more"]
    for delta in deltas:
        await live.append_text("t_1", delta)
        await live.append_text("t_2", delta.upper())
        await running_text.write(store, live)
    await running_text.write(store, live)  # nothing new: nothing written
    whole = "".join(deltas)
    rows = await store.fetch("SELECT piece FROM turn_pieces WHERE turn_id = ? ORDER BY at", "t_1")
    assert [row["piece"] for row in rows] == [d.replace("\x00", nul) for d in deltas]

    # A write whose answer was lost, sent again, is read once.
    await store.execute(running_text.insert_sql(1), "t_1", 7, "wörld 🚀")
    assert await end(store, "t_2", "aborted", "Aborted", whole.upper()) is True
    restarted = LocalLiveState()
    assert await running_text.restore(store, restarted) == 1
    assert await restarted.text("t_1") == (whole.replace("\x00", nul), 1)
    assert await restarted.text("t_2") == ("", 0)

    await restarted.append_text("t_1", "!")  # it goes on from there
    await running_text.write(store, restarted)
    ended = await store.end_turn(
        "t_1", Ending("error", "The relay restarted.", "relay_restarted", text=whole + "!")
    )
    assert ended is not None and ended.text == (whole + "!").replace("\x00", nul)
    assert await store.fetch("SELECT * FROM turn_pieces") == []
    await running_text.write(store, live)  # a write as a turn ends stores nothing
    await live.append_text("t_1", "late")
    await running_text.write(store, live)
    assert await store.fetch("SELECT * FROM turn_pieces") == []
    stored = await store.get_turn("t_1")
    assert stored is not None
    assert [(m.role, m.content) for m in stored.messages] == [
        ("user", "Hi"),
        ("assistant", (whole + "!").replace("\x00", nul)),
    ]


async def test_two_people_added_at_once_under_one_name_in_two_cases_are_one_person(
    store: TurnStore,
) -> None:
    """Two ``hangar user add`` at once, "Zed" and "ZED": both names were checked before either
    was stored, and two people a colleague could not tell apart were made."""
    accounts = Accounts(store)
    added = await asyncio.gather(
        accounts.add_user("Zed", "first password"),
        accounts.add_user("ZED", "second password"),
        accounts.add_user("zed", None),
        return_exceptions=True,
    )

    refused = [str(outcome) for outcome in added if isinstance(outcome, AccountError)]
    [person] = [outcome for outcome in added if isinstance(outcome, User)]
    assert [user.name for user in await accounts.users()] == [person.name]
    assert len(refused) == 2 and all(f"named {person.name!r} already" in r for r in refused)


async def test_two_drone_tokens_made_at_once_for_one_name_leave_one_that_works(
    store: TurnStore,
) -> None:
    """Made at once for "laptop" and "Laptop", each was printed as the drone's token, and two
    look-alike drones could connect; for "laptop" twice, one removed the other's."""
    accounts = Accounts(store)
    made = await asyncio.gather(
        *(accounts.create_drone_token(name) for name in ["laptop", "Laptop", "laptop"]),
        return_exceptions=True,
    )

    [token] = [outcome for outcome in made if isinstance(outcome, str)]
    refused = [str(outcome) for outcome in made if isinstance(outcome, AccountError)]
    assert len(refused) == 2 and all("has a token already" in r for r in refused)
    assert await accounts.drone_of(token) is not None
    assert [t.name for t in await accounts.drone_tokens() if t.revoked_at is None] == [
        await accounts.drone_of(token)
    ]
