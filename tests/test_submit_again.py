"""A submit sent again (``docs/protocol.md``, ``submitWorkOrder``'s ``requestId``): a client whose
answer was lost sends the same submit with the same request id, and gets the first one's answer
instead of a second turn, whether the first landed long ago or lands at the same moment."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bench.peers import OpenAIPeer
from hangar.server.turns import REQUEST_ID_TAKEN
from tests.conftest import Browser, RelayHandle, Upstream


async def sessions_of(browser: Browser) -> list[dict[str, Any]]:
    answer = await browser.call("listSessions", {})
    assert answer["ok"] is True
    sessions: list[dict[str, Any]] = answer["sessions"]
    return sessions


async def turns_of(browser: Browser, session_id: str) -> list[dict[str, Any]]:
    answer = await browser.call("openSession", {"sessionId": session_id})
    assert answer["ok"] is True
    turns: list[dict[str, Any]] = answer["turns"]
    return turns


async def test_a_submit_sent_again_after_a_reconnect_is_the_turn_it_made(
    openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browsers: Any
) -> None:
    first_tab = await browsers("ann")
    first = await first_tab.submit("Only once, please", requestId="r_7f3a")
    await first_tab.close()  # its answer was lost with the connection; it sends again
    tab = await browsers("ann")

    again = await tab.submit("Only once, please", requestId="r_7f3a")

    assert first["ok"] is True
    assert again == {**first, "sentAgain": True}
    assert [s["sessionId"] for s in await sessions_of(tab)] == [first["sessionId"]]
    assert [t["turnId"] for t in await turns_of(tab, first["sessionId"])] == [first["turnId"]]
    # The connection that sent it again follows the turn to its end.
    await start_drone(Upstream("openai", openai_peer))
    _, success, result = await tab.completion(first["turnId"])
    assert success is True and result == tab.text(first["turnId"]) != ""
    assert len(openai_peer.requests) == 1


async def test_a_submit_sent_again_after_its_turn_ended_is_answered_as_before(
    openai_peer: OpenAIPeer, start_drone: Callable[..., Any], browser: Browser
) -> None:
    await start_drone(Upstream("openai", openai_peer))
    first = await browser.submit("Hello", requestId="r_ended")
    await browser.completion(first["turnId"])
    follow_up = await browser.submit("And then?", sessionId=first["sessionId"])
    await browser.completion(follow_up["turnId"])

    again = await browser.submit("Hello", requestId="r_ended")

    assert again == {**first, "sentAgain": True}
    turns = await turns_of(browser, first["sessionId"])
    assert [t["turnId"] for t in turns] == [first["turnId"], follow_up["turnId"]]
    assert len(openai_peer.requests) == 2


async def test_the_same_submit_sent_twice_at_once_makes_one_turn_and_one_session(
    relay: RelayHandle, browsers: Any
) -> None:
    tabs = [await browsers("bo") for _ in range(4)]

    answers = await asyncio.gather(
        *(tab.submit("Twice at once", requestId="r_race") for tab in tabs)
    )

    assert len({(a["turnId"], a["sessionId"]) for a in answers}) == 1
    assert sorted(bool(a.get("sentAgain")) for a in answers) == [False, True, True, True]
    sessions = await sessions_of(tabs[0])
    assert [s["sessionId"] for s in sessions] == [answers[0]["sessionId"]]
    assert len(await turns_of(tabs[0], answers[0]["sessionId"])) == 1


async def test_a_request_id_used_for_another_prompt_is_refused_and_stores_nothing(
    browser: Browser,
) -> None:
    first = await browser.submit("The first prompt", requestId="r_used")

    other_prompt = await browser.submit("Another prompt", requestId="r_used")
    other_session = await browser.submit("The first prompt", requestId="r_used", sessionId="s_x")

    assert other_prompt == other_session == {"ok": False, "error": REQUEST_ID_TAKEN}
    assert [s["sessionId"] for s in await sessions_of(browser)] == [first["sessionId"]]
    assert len(await turns_of(browser, first["sessionId"])) == 1


async def test_one_persons_request_id_is_nothing_to_another(browsers: Any) -> None:
    ann, bo = await browsers("ann"), await browsers("bo")
    mine = await ann.submit("Same words", requestId="r_shared")

    theirs = await bo.submit("Same words", requestId="r_shared")
    other_words = await bo.submit("Other words", requestId="r_mine")

    assert theirs["ok"] is True and "sentAgain" not in theirs
    assert theirs["turnId"] != mine["turnId"] and theirs["sessionId"] != mine["sessionId"]
    assert other_words["ok"] is True
    assert [s["sessionId"] for s in await sessions_of(ann)] == [mine["sessionId"]]


async def test_a_request_id_that_is_not_an_id_is_refused(browser: Browser) -> None:
    answer = await browser.submit("Hello", requestId="not an id!")

    assert answer["ok"] is False
    assert "requestId" in answer["error"]
    assert await sessions_of(browser) == []
