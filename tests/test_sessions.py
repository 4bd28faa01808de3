"""Sessions a person manages (rename, delete, search) and a sessions list that scales: pages
latest activity first, and one session's change at a time to its owner's browsers. A real relay
on SQLite and on PostgreSQL, real socket.io clients, real drones."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest

from bench.peers import OpenAIPeer, Reply
from hangar.server.accounts import Accounts
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.rooms import EMPTY_TITLE, NOT_YOUR_TITLE, REMOVED_OWNER, SESSION_BUSY
from hangar.server.schema import migrations
from hangar.server.sqlite_file import finds
from hangar.server.sqlite_store import SqliteTurnStore
from hangar.server.store import Ending, SessionRecord, TurnRecord, list_sessions_sql
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    SESSION_CHANGED,
    SESSION_REMOVED,
    UNKNOWN_SESSION,
    ChatMessage,
    ToolCall,
    cut,
)
from tests.conftest import DRONE_TOKEN, Browser, People, RelayHandle, Upstream, eventually

Start = Callable[..., Any]
SESSION_EVENTS = (SESSION_CHANGED, SESSION_REMOVED, "sessions")
SLOW = Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03)


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The relay's database: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "postgres":
        return cast(str, request.getfixturevalue("postgres_url"))
    return str(tmp_path / "hangar.db")


@pytest.fixture
async def relay(database: str) -> AsyncIterator[RelayHandle]:
    """A relay on each kind of store (the drones and browsers of conftest connect to it)."""
    config = RelayConfig(port=0, database=database, drone_token=DRONE_TOKEN, drone_grace=0.5)
    runner, port = await start_relay(config)
    relay = runner.app[RELAY]
    yield RelayHandle(f"http://127.0.0.1:{port}", relay, config, People(relay.accounts))
    await runner.cleanup()


async def user_id(relay: RelayHandle, name: str) -> str:
    user = await relay.relay.accounts.user(name)
    assert user is not None
    return user.user_id


def session_events(browser: Browser) -> list[tuple[str, Any]]:
    return [(event, args) for event, args in browser.events if event in SESSION_EVENTS]


def session_bytes(browser: Browser) -> int:
    """The bytes of session data the browser received (its events' JSON)."""
    return sum(
        len(json.dumps(args, separators=(",", ":")).encode()) for _, args in session_events(browser)
    )


def changes_of(browser: Browser, session_id: str) -> list[dict[str, Any]]:
    return [
        args["session"]
        for event, args in browser.events
        if event == SESSION_CHANGED and args["session"]["sessionId"] == session_id
    ]


async def listed(browser: Browser, **request: Any) -> dict[str, Any]:
    page: dict[str, Any] = await browser.call("listSessions", request)
    assert page["ok"] is True, page
    return page


def ids(page: dict[str, Any]) -> list[str]:
    return [session["sessionId"] for session in page["sessions"]]


async def ended_quickly(browser: Browser, prompt: str, **extra: Any) -> dict[str, Any]:
    """Submit with no drone online and abort it where it waits: a session with an ended turn."""
    ack = await browser.submit(prompt, **extra)
    assert ack["ok"] is True, ack
    assert await browser.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    await browser.completion(ack["turnId"])
    return ack


# ---- the list: by last activity, a page at a time


async def test_sessions_are_listed_by_last_activity_a_page_at_a_time(
    browsers: Start,
) -> None:
    alice = await browsers("alice")
    first = await ended_quickly(alice, "First question")
    second = await ended_quickly(alice, "Second question")
    third = await ended_quickly(alice, "Third question")
    # A follow-up in the first session makes it the latest activity.
    await ended_quickly(alice, "Back to the first", sessionId=first["sessionId"])

    page = await listed(alice, limit=2)
    assert ids(page) == [first["sessionId"], third["sessionId"]]
    rest = await listed(alice, limit=2, cursor=page["next"])
    assert ids(rest) == [second["sessionId"]]
    assert "next" not in rest
    activity = [s["lastActivity"] for s in page["sessions"] + rest["sessions"]]
    assert activity == sorted(activity, reverse=True)
    assert page["sessions"][0]["title"] == "First question"


async def test_a_page_request_that_is_malformed_is_refused_with_a_sentence(
    browser: Browser,
) -> None:
    bad_cursor = await browser.call("listSessions", {"cursor": "not a cursor"})
    odd_cursor = await browser.call("listSessions", {"cursor": "1.2.3~s_1"})
    # No relay hands out a time that is not one: these gave the first page, or an empty one.
    endless = [
        await browser.call("listSessions", {"cursor": f"{time}~s_1"})
        for time in ("1e400", "-1e400", "-5", "1e308", "9" * 32, "1e18")  # 1e18: past 9999
    ]
    too_many = await browser.call("listSessions", {"limit": 1000})

    assert bad_cursor["ok"] is False and bad_cursor["error"].startswith("Invalid payload (cursor")
    assert odd_cursor == {"ok": False, "error": "Invalid payload (cursor: not a page's next)."}
    assert endless == [odd_cursor] * 6
    assert too_many["ok"] is False and too_many["error"].startswith("Invalid payload (limit")


async def test_a_malformed_rename_or_deletion_is_refused_with_a_sentence(
    browser: Browser,
) -> None:
    for event, payload in [
        ("renameSession", {"sessionId": "s_1", "title": 7}),
        ("renameSession", {"title": "No session named"}),
        ("deleteSession", {"sessionId": "not an id!"}),
        ("deleteSession", {"sessionId": "s_1", "also": True}),
        ("listDrones", {"junk": 1}),
        ("listDrones", "all of them"),
    ]:
        answer = await browser.call(event, payload)
        assert answer["ok"] is False and answer["error"].startswith("Invalid payload ("), answer


async def test_a_browser_is_sent_no_session_list_when_it_connects(browsers: Start) -> None:
    alice = await browsers("alice")
    ack = await ended_quickly(alice, "Something to list")
    await eventually(  # its ending's line went out (to the browsers connected then)
        lambda: any(v["queuedTurns"] == 0 for v in changes_of(alice, ack["sessionId"])),
        what="the session's line",
    )

    again = await browsers("alice")
    assert (await listed(again))["sessions"]  # asked for, a page at a time
    assert session_events(again) == []


# ---- changes: one session at a time, to its owner only


async def test_a_turn_sends_its_owner_its_sessions_changes_and_nobody_else_anything(
    browsers: Start, start_drone: Start, openai_peer: OpenAIPeer
) -> None:
    alice, alice_phone, bob = await browsers("alice"), await browsers("alice"), await browsers()
    await start_drone(Upstream("openai", openai_peer))
    openai_peer.script(SLOW)

    ack = await alice.submit("A long one")
    session_id, turn_id = ack["sessionId"], ack["turnId"]
    await eventually(
        lambda: any(
            v.get("processingTurnId") == turn_id for v in changes_of(alice_phone, session_id)
        ),
        what="the session shown working",
    )
    assert await alice.abort(turn_id) == (True, ABORT_SIGNALED)
    await alice.completion(turn_id)
    await eventually(
        lambda: "processingTurnId" not in changes_of(alice_phone, session_id)[-1],
        what="the session shown idle",
    )

    views = changes_of(alice_phone, session_id)
    # Created (waiting in line), unless a dispatch started it before its view was read.
    assert views[0]["queuedTurns"] == 1 or views[0].get("processingTurnId") == turn_id
    assert views[-1]["queuedTurns"] == 0
    assert views[-1]["lastActivity"] > views[0]["lastActivity"]  # the end is its latest activity
    assert {e for e, _ in session_events(alice_phone)} == {SESSION_CHANGED}
    assert session_events(bob) == []


async def test_a_turn_among_ten_thousand_sessions_sends_its_owner_a_few_hundred_bytes(
    relay: RelayHandle, browsers: Start, start_drone: Start, openai_peer: OpenAIPeer
) -> None:
    await relay.people.token("alice")
    owner = await user_id(relay, "alice")
    store = relay.relay.store
    for first in range(0, 10_000, 500):  # in batches: the loop keeps answering pings
        await asyncio.gather(
            *(
                store.create_session(SessionRecord(f"s_{n:05d}", owner, f"Session {n}", 1000.0 + n))
                for n in range(first, first + 500)
            )
        )
    alice = await browsers("alice")  # connecting sends none of the 10,000 either
    await start_drone(Upstream("openai", openai_peer))

    ack = await alice.submit("One more question")
    await alice.completion(ack["turnId"])
    await eventually(
        lambda: (
            (v := changes_of(alice, ack["sessionId"]))
            and "processingTurnId" not in v[-1]
            and v[-1]["queuedTurns"] == 0
        ),
        what="the session's end",
    )

    # Created, started, ended: one small view each, not the list of 10,001.
    assert len(session_events(alice)) <= 4
    assert session_bytes(alice) < 1_500
    page = await listed(alice)
    assert len(page["sessions"]) == 50 and ids(page)[:2] == [ack["sessionId"], "s_09999"]
    assert len(json.dumps(page).encode()) < 15_000
    following = await listed(alice, cursor=page["next"])
    assert ids(following) == [f"s_{n:05d}" for n in range(9950, 9900, -1)]


# ---- rename


async def test_renaming_a_session_retitles_it_for_every_browser_of_its_owner(
    browsers: Start,
) -> None:
    alice, alice_phone = await browsers("alice"), await browsers("alice")
    older = await ended_quickly(alice, "Older question")
    await ended_quickly(alice, "Newer question")

    answer = await alice.call(
        "renameSession", {"sessionId": older["sessionId"], "title": "  Release\nnotes   2.0 "}
    )

    assert answer["ok"] is True and answer["session"]["title"] == "Release notes 2.0"
    await eventually(
        lambda: (
            [v["title"] for v in changes_of(alice_phone, older["sessionId"])][-1:]
            == ["Release notes 2.0"]
        ),
        what="the new title on the other browser",
    )
    page = await listed(alice_phone)
    assert ids(page)[0] == older["sessionId"]  # a rename is activity
    assert page["sessions"][0]["title"] == "Release notes 2.0"


async def test_a_title_that_is_blank_or_too_long_is_refused(browser: Browser) -> None:
    ack = await ended_quickly(browser, "Keep this title")
    blank = await browser.call("renameSession", {"sessionId": ack["sessionId"], "title": " \n "})
    unseen = await browser.call("renameSession", {"sessionId": ack["sessionId"], "title": "\u200b"})
    nul = await browser.call("renameSession", {"sessionId": ack["sessionId"], "title": "\x00"})
    long = await browser.call("renameSession", {"sessionId": ack["sessionId"], "title": "x" * 201})

    assert blank == unseen == nul == {"ok": False, "error": EMPTY_TITLE}
    assert long == {  # it spoke of "items"
        "ok": False,
        "error": "Invalid payload (title: String should have at most 200 characters).",
    }
    assert (await listed(browser))["sessions"][0]["title"] == "Keep this title"
    # The bound counts the title as kept, on one line.
    spaced = await browser.call(
        "renameSession", {"sessionId": ack["sessionId"], "title": "x  " * 99 + "y"}
    )
    assert spaced["ok"] is True and spaced["session"]["title"] == "x " * 99 + "y"


# ---- delete


async def test_deleting_a_session_removes_it_with_its_turns_and_messages(
    relay: RelayHandle, browsers: Start, start_drone: Start, openai_peer: OpenAIPeer
) -> None:
    alice, alice_phone = await browsers("alice"), await browsers("alice")
    kept = await ended_quickly(alice, "Something to keep")  # before a drone could answer it
    await start_drone(Upstream("openai", openai_peer))
    ack = await alice.submit("Something to forget")
    await alice.completion(ack["turnId"])
    assert (await alice_phone.call("openSession", {"sessionId": ack["sessionId"]}))["ok"]

    assert await alice.call("deleteSession", {"sessionId": ack["sessionId"]}) == {"ok": True}

    await eventually(
        lambda: (SESSION_REMOVED, {"sessionId": ack["sessionId"]}) in alice_phone.events,
        what="the other browser told",
    )
    store = relay.relay.store
    assert await store.get_session(ack["sessionId"]) is None
    assert await store.get_turn(ack["turnId"]) is None
    rows = await store.fetch("SELECT count(*) AS n FROM messages WHERE turn_id = ?", ack["turnId"])
    assert rows[0]["n"] == 0
    assert ids(await listed(alice)) == [kept["sessionId"]]
    gone = await alice.call("openSession", {"sessionId": ack["sessionId"]})
    assert gone == {"ok": False, "error": UNKNOWN_SESSION}


async def test_a_session_whose_turn_waits_or_runs_is_not_deleted(
    relay: RelayHandle, browser: Browser
) -> None:
    ack = await browser.submit("Waiting for a drone")  # no drone: it waits in line

    refused = await browser.call("deleteSession", {"sessionId": ack["sessionId"]})

    assert refused == {"ok": False, "error": SESSION_BUSY}
    assert await relay.relay.store.get_session(ack["sessionId"]) is not None
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None and turn.status == "queued"


# ---- whose sessions


async def test_someone_elses_session_reads_as_unknown_to_a_member(browsers: Start) -> None:
    alice, bob = await browsers("alice"), await browsers("bob")
    ack = await ended_quickly(alice, "Alice's own")

    for event, payload in [
        ("renameSession", {"title": "Mine now"}),
        ("deleteSession", {}),
    ]:
        theirs = await bob.call(event, {"sessionId": ack["sessionId"], **payload})
        missing = await bob.call(event, {"sessionId": "s_missing", **payload})
        assert theirs == missing == {"ok": False, "error": UNKNOWN_SESSION}
    assert (await listed(bob, everyone=True))["sessions"] == []
    assert (await listed(alice))["sessions"][0]["title"] == "Alice's own"


async def test_an_admin_lists_and_deletes_anyones_sessions_but_renames_only_their_own(
    relay: RelayHandle, browsers: Start
) -> None:
    alice = await browsers("alice")
    await relay.people.token("root", role="admin")
    root = await browsers("root")
    ack = await ended_quickly(alice, "Alice's question")

    everyone = await listed(root, everyone=True)
    assert [(s["sessionId"], s.get("ownerName")) for s in everyone["sessions"]] == [
        (ack["sessionId"], "alice")
    ]
    renamed = await root.call("renameSession", {"sessionId": ack["sessionId"], "title": "Root's"})
    assert renamed == {"ok": False, "error": NOT_YOUR_TITLE}

    assert await root.call("deleteSession", {"sessionId": ack["sessionId"]}) == {"ok": True}
    await eventually(
        lambda: (SESSION_REMOVED, {"sessionId": ack["sessionId"]}) in alice.events,
        what="the owner told",
    )
    assert (await listed(alice))["sessions"] == []


async def test_a_removed_persons_session_is_shown_as_theirs_not_as_the_admins(
    relay: RelayHandle, browsers: Start
) -> None:
    """A person removed (``hangar user remove``) leaves their sessions: an admin sees whose
    they were, never a blank owner that would read as the admin's own."""
    dave = await browsers("dave")
    await relay.people.token("root", role="admin")
    root = await browsers("root")
    ack = await ended_quickly(dave, "Dave's question")
    assert await relay.relay.accounts.remove_user("dave")

    everyone = await listed(root, everyone=True)
    opened = await root.call("openSession", {"sessionId": ack["sessionId"]})

    assert [(s["sessionId"], s.get("ownerName")) for s in everyone["sessions"]] == [
        (ack["sessionId"], REMOVED_OWNER)
    ]
    assert opened["session"]["ownerName"] == REMOVED_OWNER
    renamed = await root.call("renameSession", {"sessionId": ack["sessionId"], "title": "Mine"})
    assert renamed == {"ok": False, "error": NOT_YOUR_TITLE}


# ---- search


async def test_search_finds_sessions_by_title_or_prompt_in_any_case(browsers: Start) -> None:
    alice, bob = await browsers("alice"), await browsers("bob")
    uber = await ended_quickly(alice, "Deploy the ÜBER app")
    follow = await ended_quickly(alice, "Plain title")
    await ended_quickly(alice, "A needle in a follow-up", sessionId=follow["sessionId"])
    percent = await ended_quickly(alice, "Save 100% of it")
    await ended_quickly(alice, "Unrelated")
    await ended_quickly(bob, "Bob's über needle")

    assert ids(await listed(alice, query="über")) == [uber["sessionId"]]
    assert ids(await listed(alice, query="NEEDLE")) == [follow["sessionId"]]
    assert ids(await listed(alice, query="0%")) == [percent["sessionId"]]  # % is no wildcard
    assert ids(await listed(alice, query="a_p")) == []  # nor is _
    assert ids(await listed(alice, query="nothing like it")) == []
    paged = await listed(alice, query="e", limit=2)
    assert len(paged["sessions"]) == 2 and "next" in paged


async def test_search_finds_a_title_by_its_own_text_and_greek_in_either_sigma(
    browsers: Start,
) -> None:
    """PostgreSQL's lower() and Python's differ (a final sigma, a dotted I): a title searched
    for by its own exact text was not found on PostgreSQL, and a Greek word typed in small
    letters, with its final sigma, matched its capitals on one store and not the other."""
    alice = await browsers("alice")
    greek = await ended_quickly(alice, "ΟΔΥΣΣΕΑΣ myth")
    turkish = await ended_quickly(alice, "İZMİR notes")

    for query in ("ΟΔΥΣΣΕΑΣ", "οδυσσεας", "οδυσσεασ", "ΟΔΥΣΣΕΑΣ MYTH"):
        assert ids(await listed(alice, query=query)) == [greek["sessionId"]], query
    assert ids(await listed(alice, query="İZMİR")) == [turkish["sessionId"]]


# ---- stores made before last activity was kept


ACTIVITY_MIGRATION = next(i for i, m in enumerate(migrations("sqlite")) if "last_activity" in m)
"""The index of the migration that orders sessions by their last activity."""


async def test_a_sqlite_store_of_an_earlier_version_orders_its_sessions_by_activity(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    earlier = migrations("sqlite")[:ACTIVITY_MIGRATION]
    db.executescript("".join(earlier) + f"PRAGMA user_version = {len(earlier)};")
    _old_rows(db.execute)
    db.commit()
    db.close()

    store = SqliteTurnStore(path)
    await store.open()
    try:
        found = await store.list_sessions("alice")
    finally:
        await store.close()

    assert [(s.session_id, s.last_activity) for s in found] == [
        ("s_ended", 500.0),
        ("s_asked", 400.0),
        ("s_new", 300.0),
    ]


async def test_a_postgres_store_of_an_earlier_version_orders_its_sessions_by_activity(
    postgres_url: str,
) -> None:
    db = await asyncpg.connect(postgres_url)
    earlier = migrations("postgresql")[:ACTIVITY_MIGRATION]
    await db.execute("CREATE TABLE hangar_schema (version INTEGER NOT NULL)")
    for number, script in enumerate(earlier, start=1):
        await db.execute(script)
        await db.execute("INSERT INTO hangar_schema (version) VALUES ($1)", number)
    rows: list[tuple[str, tuple[Any, ...]]] = []
    _old_rows(lambda sql, values: rows.append((sql, values)))
    for sql, values in rows:
        await db.execute(_numbered(sql), *values)
    await db.close()

    store = PostgresTurnStore(postgres_url)
    await store.open()
    try:
        found = await store.list_sessions("alice")
    finally:
        await store.close()

    assert [(s.session_id, s.last_activity) for s in found] == [
        ("s_ended", 500.0),
        ("s_asked", 400.0),
        ("s_new", 300.0),
    ]


def _old_rows(execute: Callable[[str, tuple[Any, ...]], Any]) -> None:
    """Sessions as an earlier version stored them: one with a turn that ended late, one with
    a turn still queued, one with none (its creation is its activity)."""
    session = "INSERT INTO sessions (session_id, owner, title, created_at) VALUES (?, ?, ?, ?)"
    turn = (
        "INSERT INTO turns (turn_id, session_id, owner, prompt, status, created_at, ended_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)"
    )
    execute(session, ("s_ended", "alice", "Ended", 100.0))
    execute(session, ("s_asked", "alice", "Asked", 200.0))
    execute(session, ("s_new", "alice", "New", 300.0))
    execute(turn, ("t_1", "s_ended", "alice", "q", "finished", 150.0, 500.0))
    execute(turn, ("t_2", "s_asked", "alice", "q", "queued", 400.0, None))


def _numbered(sql: str) -> str:
    parts = sql.split("?")
    return "".join(f"{part}${n}" for n, part in enumerate(parts[:-1], start=1)) + parts[-1]


# ---- several relays


async def test_a_rename_through_one_relay_reaches_the_owners_browser_on_another(
    relay_processes: Start, postgres_url: str
) -> None:
    a, b = await relay_processes(), await relay_processes()
    store = PostgresTurnStore(postgres_url)
    await store.open()
    people = People(Accounts(store))
    on_a = await Browser(a.url, await people.token("alice")).connect()
    on_b = await Browser(b.url, await people.token("alice")).connect()
    try:
        ack = await ended_quickly(on_a, "Asked through relay A")
        await eventually(
            lambda: changes_of(on_b, ack["sessionId"]), what="relay B's browser told of it"
        )

        answer = await on_b.call("renameSession", {"sessionId": ack["sessionId"], "title": "B's"})

        assert answer["ok"] is True
        await eventually(
            lambda: changes_of(on_a, ack["sessionId"])[-1]["title"] == "B's",
            what="relay A's browser told of the rename",
        )
        assert await on_b.call("deleteSession", {"sessionId": ack["sessionId"]}) == {"ok": True}
        await eventually(
            lambda: (SESSION_REMOVED, {"sessionId": ack["sessionId"]}) in on_a.events,
            what="relay A's browser told of the deletion",
        )
    finally:
        await on_a.close()
        await on_b.close()
        await store.close()


# ---- a long session is opened a page at a time


async def test_a_long_session_opens_with_its_latest_turns_and_pages_back(
    relay: RelayHandle, browsers: Start
) -> None:
    alice = await browsers("alice")
    owner = (await relay.relay.accounts.user("alice")).user_id  # type: ignore[union-attr]
    store = relay.relay.store
    await store.create_session(SessionRecord("s_long", owner, "A long one"))
    for number in range(45):
        turn = TurnRecord(
            f"t_{number:03d}",
            "s_long",
            owner,
            f"question {number}",
            status="processing",
            created_at=1000.0 + number,
            messages=[ChatMessage(role="user", content=f"question {number}")],
        )
        await store.create_turn(turn)
        await store.end_turn(turn.turn_id, Ending("finished", "done", "finished", "answer"))

    latest = await alice.call("openSession", {"sessionId": "s_long"})
    older = await alice.call("openSession", {"sessionId": "s_long", "before": "t_015"})

    assert [t["prompt"] for t in latest["turns"]] == [f"question {n}" for n in range(15, 45)]
    assert latest["more"] is True
    assert [t["prompt"] for t in older["turns"]] == [f"question {n}" for n in range(15)]
    assert older["more"] is False
    stranger = await browsers("bob")
    assert await stranger.call("openSession", {"sessionId": "s_long", "before": "t_015"}) == {
        "ok": False,
        "error": UNKNOWN_SESSION,
    }
    # Another's turn in one's own session's ``before`` tells as much as a turn that never was.
    own = (await stranger.submit("Mine"))["sessionId"]
    later = (await alice.submit("Asked after bob's"))["turnId"]
    paged = [
        await stranger.call("openSession", {"sessionId": own, "before": before})
        for before in (later, "t_000", "t_nothing")
    ]
    assert [answer["turns"] for answer in paged] == [[], [], []]


async def stored_turn(
    relay: RelayHandle, owner: str, number: int, answer: str, messages: list[ChatMessage]
) -> None:
    turn = TurnRecord(
        f"t_{number:03d}",
        "s_large",
        owner,
        f"question {number}",
        status="processing",
        created_at=1000.0 + number,
        messages=[ChatMessage(role="user", content=f"question {number}"), *messages],
    )
    await relay.relay.store.create_turn(turn)
    await relay.relay.store.end_turn(turn.turn_id, Ending("finished", "done", "finished", answer))


async def test_a_session_of_large_answers_opens_and_pages_back_within_what_a_client_reads(
    relay: RelayHandle, browsers: Start
) -> None:
    """Twelve answers of a million characters made a 24 MB snapshot (each answer is in its
    turn's text and in its message): a default python-socketio client, which reads 4 MiB a
    message, lost its connection instead of getting it. A page now holds what fits in 3 MB,
    and the person pages back through every turn, each whole."""
    alice = await browsers("alice")
    owner = (await relay.relay.accounts.user("alice")).user_id  # type: ignore[union-attr]
    await relay.relay.store.create_session(SessionRecord("s_large", owner, "Large answers"))
    for number in range(12):
        answer = f"{number:02d}" * 500_000
        await stored_turn(
            relay, owner, number, answer, [ChatMessage(role="assistant", content=answer)]
        )

    pages = [await alice.call("openSession", {"sessionId": "s_large"})]
    while pages[-1]["more"]:
        first = pages[-1]["turns"][0]["turnId"]
        pages.append(await alice.call("openSession", {"sessionId": "s_large", "before": first}))

    assert all(page["ok"] for page in pages) and 1 < len(pages) <= 12
    assert all(len(json.dumps(page)) < 3_100_000 for page in pages)
    turns = [turn for page in reversed(pages) for turn in page["turns"]]
    assert [turn["prompt"] for turn in turns] == [f"question {n}" for n in range(12)]
    assert [turn["text"] for turn in turns] == [f"{n:02d}" * 500_000 for n in range(12)]


async def test_a_turn_too_large_for_a_page_by_itself_comes_cut_saying_so(
    relay: RelayHandle, browsers: Start
) -> None:
    """One turn of two long answers and a long tool call: its view alone was over 13 MB. It
    comes with its messages' long strings and the end of its text cut, each saying how much
    was left out; the store keeps it whole, and the model gets it whole."""
    alice = await browsers("alice")
    owner = (await relay.relay.accounts.user("alice")).user_id  # type: ignore[union-attr]
    await relay.relay.store.create_session(SessionRecord("s_large", owner, "One large turn"))
    first, second = "a" * 2_900_000, "b" * 2_900_000
    call = ToolCall(id="call_1", name="write_file", arguments=json.dumps({"content": "c" * 10**6}))
    messages = [
        ChatMessage(role="assistant", content=first, tool_calls=[call]),
        ChatMessage(role="tool", content="d" * 10**6, tool_call_id="call_1", name="write_file"),
        ChatMessage(role="assistant", content=second),
    ]
    await stored_turn(relay, owner, 0, first + second, messages)

    page = await alice.call("openSession", {"sessionId": "s_large"})

    assert len(json.dumps(page)) < 3_100_000 and page["more"] is False
    [turn] = page["turns"]
    kept = len(turn["text"].split("\n\n[…")[0])
    assert 2_000_000 < kept < 3_000_000
    assert turn["text"] == first[:kept] + second[: max(0, kept - len(first))] + (
        f"\n\n[… {len(first + second) - kept} more characters not shown]"
    )
    assert [m.get("content", "") for m in turn["messages"]] == [
        "question 0",
        cut(first, 20_000),
        cut("d" * 10**6, 20_000),
        cut(second, 20_000),
    ]
    assert turn["messages"][1]["toolCalls"][0]["arguments"] == cut(call.arguments, 20_000)
    stored = await relay.relay.store.get_turn("t_000")
    assert stored is not None and stored.messages[3].content == second


async def test_a_running_turn_is_in_the_first_page_whatever_the_turns_after_it_take(
    relay: RelayHandle, browsers: Start
) -> None:
    """Only the newest turn was sure of its place: a running turn with a long answer behind a
    queued follow-up of large prompt was left for "Show earlier turns", and the page showed
    the session as idle."""
    alice = await browsers("alice")
    owner = (await relay.relay.accounts.user("alice")).user_id  # type: ignore[union-attr]
    store = relay.relay.store
    await store.create_session(SessionRecord("s_large", owner, "Running"))
    prompts = {"t_run": "run", "t_next": "é" * 100_000}  # 600 kB as JSON
    for number, (turn_id, prompt) in enumerate(prompts.items()):
        turn = TurnRecord(turn_id, "s_large", owner, prompt, status="queued")
        turn.created_at = 1000.0 + number
        turn.messages = [ChatMessage(role="user", content=prompt)]
        await store.create_turn(turn)
    [running] = await store.claim_queued({"d1": 1})
    await relay.relay.live_state.append_text(running.turn_id, "x" * 2_700_000)

    page = await alice.call("openSession", {"sessionId": "s_large"})

    assert [(t["turnId"], t["status"]) for t in page["turns"]] == [
        ("t_run", "processing"),
        ("t_next", "queued"),
    ]
    assert page["turns"][0]["text"] == "x" * 2_700_000 and page["more"] is False


def _search_steps(path: Path, sessions: int) -> int:
    """SQLite's VM steps (in thousands) for a member's search matching nothing, over
    ``sessions`` sessions of 5 turns each."""
    db = sqlite3.connect(path)
    db.create_function("hangar_finds", 2, finds, deterministic=True)
    db.execute("DELETE FROM turns")
    db.execute("DELETE FROM sessions")
    for i in range(sessions):
        at = 1_795_950_000.0 + i
        db.execute(
            "INSERT INTO sessions (session_id, owner, title, created_at, last_activity)"
            " VALUES (?, 'alice', ?, ?, ?)",
            (f"s_{i:06d}", f"Session {i}", at, at),
        )
        db.executemany(
            "INSERT INTO turns (turn_id, session_id, owner, prompt, status, created_at,"
            " started_at, ended_at, drone_id) VALUES (?, ?, 'alice', ?, 'finished', ?, ?, ?, 'd')",
            [
                (f"t_{i:06d}_{j}", f"s_{i:06d}", f"prompt {i}.{j}", at + j, at + j, at + j)
                for j in range(5)
            ],
        )
    db.commit()
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    db.set_progress_handler(count, 1000)
    sql, values = list_sessions_sql("alice", "no such text", None, 51, "hangar_finds({}, ?)".format)
    assert db.execute(sql, values).fetchall() == []
    db.close()
    return steps


async def test_a_members_search_looks_at_each_prompt_once(tmp_path: Path) -> None:
    """A member's search tested each session's turns through the index of the person's turns
    (by owner): every session walked all the person's turns, and a search over 4,000 sessions
    of 5 turns took 21 s, the relay's database held for everyone meanwhile. Twice the sessions
    now cost twice the work (docs/protocol.md, ``listSessions``: in proportion to the text)."""
    store = SqliteTurnStore(tmp_path / "hangar.db")
    await store.open()
    await store.close()

    few, many = (_search_steps(tmp_path / "hangar.db", n) for n in (300, 600))

    assert many < 2.5 * few, (few, many)


async def test_a_session_that_moves_while_others_are_sent_is_sent_too(
    relay: RelayHandle, browsers: Start
) -> None:
    """The sessions that moved in a moment are sent together (``rooms._send_moved``); one that
    moved while they were being sent waited for some later change to be sent, and without one
    never was: 1-8 of 18 sessions whose turns ended together stayed "working" in their owner's
    list."""
    await relay.people.token("alice")
    owner = await user_id(relay, "alice")
    store, rooms = relay.relay.store, relay.relay.rooms
    await asyncio.gather(
        *(store.create_session(SessionRecord(f"s_{n:03d}", owner, f"S {n}")) for n in range(201))
    )
    alice = await browsers("alice")

    for n in range(200):  # their turns ended at once, say
        rooms.moved(f"s_{n:03d}")
    await eventually(lambda: session_events(alice), what="the first of them sent")
    rooms.moved("s_200")  # while the rest are on their way

    await eventually(lambda: changes_of(alice, "s_200"), what="the late one sent")
    assert {data["session"]["sessionId"] for _, data in session_events(alice)} == {
        f"s_{n:03d}" for n in range(201)
    }


async def test_a_change_read_before_a_deletion_never_follows_it(
    relay: RelayHandle, browsers: Start
) -> None:
    """A session's changed line read from the store just before the session was deleted went
    out after ``sessionRemoved`` (5 times in 80 when a turn ended 35-75 ms before the delete):
    the owner's other tab listed the deleted session again, and opening it said "Unknown
    session."."""
    await relay.people.token("alice")
    session = SessionRecord("s_gone", await user_id(relay, "alice"), "Gone")
    await relay.relay.store.create_session(session)
    alice, other = await browsers("alice"), await browsers("alice")

    assert await alice.call("deleteSession", {"sessionId": "s_gone"}) == {"ok": True}
    await relay.relay.rooms._changed(session)  # the line as read before, sent only now
    assert (await other.call("listSessions", {}))["ok"] is True  # what came before has come

    assert (SESSION_REMOVED, {"sessionId": "s_gone"}) in other.events
    assert changes_of(other, "s_gone") == []


async def test_a_title_keeps_no_control_character(browser: Browser) -> None:
    """A title "\\x00abc" or an escape sequence was kept as sent, NUL and ESC included, as was a
    first prompt's line holding them: the list drew them as boxes, a terminal reading the
    database as colours. Each is a space now, on both ways a title is made."""
    ack = await ended_quickly(browser, "\x1b[31mRed\x1b[0m alert\x00")
    assert (await listed(browser))["sessions"][0]["title"] == "[31mRed [0m alert"

    for sent, kept in (("\x00abc", "abc"), ("Tab\there\x7fand\x85there", "Tab here and there")):
        answer = await browser.call("renameSession", {"sessionId": ack["sessionId"], "title": sent})
        assert answer["ok"] is True and answer["session"]["title"] == kept, answer
