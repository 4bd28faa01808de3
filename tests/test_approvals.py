"""Tool calls that wait for a person: approve, deny, always, abort while waiting, nobody answers,
across relays, and a drone with no sandbox, against real relays, drones and the OpenAI peer."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.peers import OpenAIPeer, Reply, ScriptedToolCall
from bench.services import free_port
from hangar.drone.approvals import DECLINED, not_allowed, too_long, unanswered
from hangar.drone.tools.policy import ToolPolicy
from hangar.drone.worker import DroneConfig, run_drone
from hangar.server.accounts import Accounts
from hangar.server.app import RelayConfig
from hangar.server.postgres_store import PostgresTurnStore
from hangar.server.turns import ANSWER_UNCONFIRMED, OWNER_APPROVES
from hangar.shared.abort import AbortController, AbortError
from hangar.shared.protocol import (
    ABORT_SIGNALED,
    ABORTED,
    NO_SUCH_CALL,
    TOOL_CANCELLED,
    UNKNOWN_TURN,
)
from tests.conftest import (
    DRONE_TOKEN,
    Browser,
    People,
    RelayHandle,
    Upstream,
    eventually,
    relay_folder,
    relay_on,
)

Start = Callable[..., Any]


def shell(command: str) -> Reply:
    return Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", {"command": command})])


async def waiting_call(browser: Browser, turn_id: str, timeout: float = 10) -> dict[str, Any]:
    found = await eventually(
        lambda: [p for p in browser.progress(turn_id, "tool") if p["state"] == "waiting"],
        timeout,
        "a tool call waiting for approval",
    )
    call: dict[str, Any] = found[-1]
    return call


def states(browser: Browser, turn_id: str) -> list[str]:
    return [p["state"] for p in browser.progress(turn_id, "tool")]


async def answer(
    browser: Browser, turn_id: str, call_id: str, approve: bool, always: bool = False
) -> dict[str, Any]:
    payload = {"turnId": turn_id, "callId": call_id, "approve": approve, "always": always}
    result: dict[str, Any] = await browser.call("approveToolCall", payload)
    return result


async def asking_drone(start_drone: Start, peer: OpenAIPeer, workdir: Path, **settings: Any) -> Any:
    return await start_drone(
        Upstream("openai", peer),
        workdir=str(workdir),
        tools=ToolPolicy.parse("run_shell=ask,write_file=ask"),
        **settings,
    )


async def test_an_asked_command_waits_and_runs_once_approved(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(shell("echo approved > out.txt"), Reply(chunks=["Done."]))
    await asking_drone(start_drone, openai_peer, tmp_path)
    turn_id = (await browser.submit("Write the file"))["turnId"]

    call = await waiting_call(browser, turn_id)
    assert call["name"] == "run_shell" and "echo approved" in call["arguments"]
    assert not (tmp_path / "out.txt").exists()  # nothing runs before the person says so
    assert len(openai_peer.requests) == 1

    assert await answer(browser, turn_id, call["callId"], approve=True) == {"ok": True}
    assert await browser.completion(turn_id) == (turn_id, True, "Done.")
    assert (tmp_path / "out.txt").read_text() == "approved\n"
    assert states(browser, turn_id) == ["waiting", "start", "end"]
    assert await answer(browser, turn_id, call["callId"], approve=True) == {
        "ok": False,
        "error": NO_SUCH_CALL,
    }


async def test_a_declined_call_gives_the_model_a_declined_result_and_the_loop_goes_on(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(shell("touch nope"), Reply(chunks=["Understood."]))
    await asking_drone(start_drone, openai_peer, tmp_path)
    turn_id = (await browser.submit("Try something"))["turnId"]
    call = await waiting_call(browser, turn_id)

    assert await answer(browser, turn_id, call["callId"], approve=False) == {"ok": True}

    assert await browser.completion(turn_id) == (turn_id, True, "Understood.")
    assert not (tmp_path / "nope").exists()
    assert states(browser, turn_id) == ["waiting", "declined"]
    last = openai_peer.requests[-1].messages[-1]
    assert (last["role"], last["content"]) == ("tool", DECLINED)


async def test_always_for_this_session_runs_the_tool_again_without_asking(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(
        shell("echo one >> log.txt"),
        shell("echo two >> log.txt"),
        Reply(chunks=["Twice."]),
        shell("echo three >> log.txt"),
        Reply(chunks=["Again."]),
    )
    await asking_drone(start_drone, openai_peer, tmp_path)
    first = await browser.submit("Log twice")
    call = await waiting_call(browser, first["turnId"])
    await answer(browser, first["turnId"], call["callId"], approve=True, always=True)
    assert (await browser.completion(first["turnId"]))[2] == "Twice."

    second = await browser.submit("Log again", sessionId=first["sessionId"])
    assert (await browser.completion(second["turnId"]))[2] == "Again."

    assert (tmp_path / "log.txt").read_text().split() == ["one", "two", "three"]
    assert states(browser, first["turnId"]) == ["waiting", "start", "end", "start", "end"]
    assert states(browser, second["turnId"]) == ["start", "end"]
    openai_peer.script(shell("echo four >> log.txt"))
    other = await browser.submit("In another session")  # "always" was for that session only
    await waiting_call(browser, other["turnId"])
    assert await browser.abort(other["turnId"]) == (True, ABORT_SIGNALED)


async def test_an_abort_while_a_call_waits_ends_the_turn_at_once_with_a_valid_history(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(shell("touch never"))
    await asking_drone(start_drone, openai_peer, tmp_path)
    ack = await browser.submit("Wait for me")
    call = await waiting_call(browser, ack["turnId"])

    assert await browser.abort(ack["turnId"]) == (True, ABORT_SIGNALED)
    assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, ABORTED)

    assert states(browser, ack["turnId"]) == ["waiting", "cancelled"]
    turn = await relay.relay.store.get_turn(ack["turnId"])
    assert turn is not None
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "Wait for me"),
        ("assistant", ""),
        ("tool", TOOL_CANCELLED),
    ]
    assert turn.messages[2].tool_call_id == call["callId"]
    assert not (tmp_path / "never").exists()
    openai_peer.script(Reply(chunks=["Fine."]))
    next_turn = await browser.submit("Go on", sessionId=ack["sessionId"])
    assert (await browser.completion(next_turn["turnId"]))[2] == "Fine."
    assert not [r for r in openai_peer.requests if r.rejected]


@pytest.mark.parametrize("workers", [1, 0], ids=["worker process", "in the drone"])
async def test_an_approval_racing_an_abort_is_refused_and_nothing_is_remembered(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
    workers: int,
) -> None:
    """Sent in the same instant as the abort, an approval with "always" was answered
    ``{ok: true}`` and the tool was remembered for the session, though its call was cancelled
    and never ran."""
    openai_peer.script(shell("touch never"), shell("touch later"), Reply(chunks=["Asked."]))
    await asking_drone(start_drone, openai_peer, tmp_path, workers=workers)
    ack = await browser.submit("Wait for me")
    call = await waiting_call(browser, ack["turnId"])

    aborted, approved = await asyncio.gather(
        browser.abort(ack["turnId"]),
        answer(browser, ack["turnId"], call["callId"], approve=True, always=True),
    )

    assert aborted == (True, ABORT_SIGNALED)
    assert approved == {"ok": False, "error": NO_SUCH_CALL}
    assert await browser.completion(ack["turnId"]) == (ack["turnId"], True, ABORTED)
    assert states(browser, ack["turnId"]) == ["waiting", "cancelled"]
    later = await browser.submit("Go on", sessionId=ack["sessionId"])
    await waiting_call(browser, later["turnId"])  # it asks: nothing was remembered
    assert await browser.abort(later["turnId"]) == (True, ABORT_SIGNALED)
    assert not (tmp_path / "never").exists() and not (tmp_path / "later").exists()


async def test_a_call_nobody_answers_is_declined_after_the_wait(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(shell("touch late"), Reply(chunks=["Moving on."]))
    await asking_drone(start_drone, openai_peer, tmp_path, approval_timeout=0.5)
    turn_id = (await browser.submit("Nobody is there"))["turnId"]

    assert await browser.completion(turn_id) == (turn_id, True, "Moving on.")
    declined = browser.progress(turn_id, "tool")[-1]
    assert (declined["state"], declined["result"]) == ("declined", unanswered(0.5))
    assert not (tmp_path / "late").exists()


async def test_a_denied_tool_is_refused_without_asking(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    openai_peer.script(shell("touch denied"), Reply(chunks=["Ok."]))
    await start_drone(
        Upstream("openai", openai_peer),
        workdir=str(tmp_path),
        tools=ToolPolicy.parse("run_shell=deny"),
    )
    turn_id = (await browser.submit("Run it"))["turnId"]

    assert await browser.completion(turn_id) == (turn_id, True, "Ok.")
    assert states(browser, turn_id) == ["declined"]
    assert browser.progress(turn_id, "tool")[0]["result"] == not_allowed("run_shell")


@pytest.mark.parametrize(
    "arguments",
    [
        {"command": "echo " + "x" * 150_000},  # past what one argument of a process may hold
        '{"command": "echo hi", "n": NaN}',
        {"command": 42},
    ],
    ids=["too-long", "not-json", "not-a-string"],
)
async def test_a_call_that_cannot_run_fails_without_asking_anyone(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
    arguments: dict[str, Any] | str,
) -> None:
    """A person approved a command of 150,000 characters, which then failed: "The command
    could not be started: Argument list too long." Whatever the answer, it could not run."""
    openai_peer.script(
        Reply(chunks=[], tool_calls=[ScriptedToolCall("run_shell", arguments)]),
        Reply(chunks=["It failed."]),
    )
    await asking_drone(start_drone, openai_peer, tmp_path)
    turn_id = (await browser.submit("Run it"))["turnId"]

    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "It failed.")
    assert states(browser, turn_id) == ["error"]
    result = browser.progress(turn_id, "tool")[0]["result"]
    assert result.startswith("Error: The ") and "could not be started" not in result


async def test_a_command_too_long_to_show_whole_is_not_put_to_the_person(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    """A command of 109,051 characters (one a process may still take) was shown cut to its
    first 20,000: "echo building project" and spaces. The person approved that, and the rest,
    "; touch HIDDEN", ran unseen. A call longer than what a card shows whole is not asked."""
    command = "echo building project" + " " * 100_000 + "; touch HIDDEN"
    openai_peer.script(shell(command), Reply(chunks=["Not run."]))
    await asking_drone(start_drone, openai_peer, tmp_path)
    turn_id = (await browser.submit("Build it"))["turnId"]

    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "Not run.")
    assert states(browser, turn_id) == ["declined"]
    call = {"command": command}
    assert browser.progress(turn_id, "tool")[0]["result"] == too_long(len(json.dumps(call)))
    assert not (tmp_path / "HIDDEN").exists()


async def test_a_sub_agent_at_the_deepest_level_is_refused_without_asking_anyone(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browser: Browser,
    tmp_path: Path,
) -> None:
    """With ``spawn_subagent=ask``, a sub-agent two levels down that asked for a sub-agent of its
    own made its person approve it, and only then was told there is no such tool there."""
    delegate = [
        Reply(chunks=[], tool_calls=[ScriptedToolCall("spawn_subagent", {"task": t})])
        for t in "abc"
    ]
    openai_peer.script(
        *delegate,
        Reply(chunks=["Nothing deeper."]),
        Reply(chunks=["Level 1 done."]),
        Reply(chunks=["Done."]),
    )
    await start_drone(
        Upstream("openai", openai_peer),
        workdir=str(tmp_path),
        tools=ToolPolicy.parse("spawn_subagent=ask"),
    )
    turn_id = (await browser.submit("Delegate deeply"))["turnId"]
    for depth in (0, 1):

        def waiting(depth: int = depth) -> list[dict[str, Any]]:
            tools = browser.progress(turn_id, "tool")
            return [p for p in tools if p["state"] == "waiting" and p["depth"] == depth]

        call = (await eventually(waiting, 10, f"the call at depth {depth} waiting"))[0]
        assert await answer(browser, turn_id, call["callId"], approve=True) == {"ok": True}

    assert await browser.completion(turn_id, timeout=20) == (turn_id, True, "Done.")
    deepest = [p for p in browser.progress(turn_id, "tool") if p["depth"] == 2]
    assert [p["state"] for p in deepest] == ["error"]
    assert deepest[0]["result"] == "Error: There is no tool named 'spawn_subagent'."


async def test_only_the_person_whose_turn_it_is_answers_and_a_page_opened_now_shows_the_call(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browsers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    openai_peer.script(shell("touch mine"), Reply(chunks=["Mine."]))
    await asking_drone(start_drone, openai_peer, tmp_path)
    owner: Browser = await browsers("ada")
    ack = await owner.submit("Mine to approve")
    call = await waiting_call(owner, ack["turnId"])

    stranger: Browser = await browsers("bob")
    assert await answer(stranger, ack["turnId"], call["callId"], True) == {
        "ok": False,
        "error": UNKNOWN_TURN,
    }
    await relay.people.token("root", role="admin")
    admin: Browser = await browsers("root")
    assert await answer(admin, ack["turnId"], call["callId"], True) == {
        "ok": False,
        "error": OWNER_APPROVES,
    }
    second_tab: Browser = await browsers("ada")
    snapshot = await second_tab.call("openSession", {"sessionId": ack["sessionId"]})
    [turn] = snapshot["turns"]
    assert [(c["callId"], c["state"]) for c in turn["waiting"]] == [(call["callId"], "waiting")]

    assert await answer(second_tab, ack["turnId"], call["callId"], True) == {"ok": True}
    assert (await owner.completion(ack["turnId"]))[2] == "Mine."
    assert not (await second_tab.call("openSession", {"sessionId": ack["sessionId"]}))["turns"][0][
        "waiting"
    ]


async def test_an_approval_given_on_one_relay_reaches_a_drone_on_another(
    relay_processes: Start,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    postgres_url: str,
    tmp_path: Path,
) -> None:
    a, b = await relay_processes(), await relay_processes()
    openai_peer.script(shell("echo crossed > crossed.txt"), Reply(chunks=["Crossed."]))
    drone_process(Upstream("openai", openai_peer), server=a.url, tools="run_shell=ask")
    store = PostgresTurnStore(postgres_url)
    await store.open()
    browser = await Browser(b.url, await People(Accounts(store)).token("ada")).connect()
    try:
        await eventually(lambda: _drones(browser), timeout=15, what="the drone")
        turn_id = (await browser.submit("Across relays"))["turnId"]
        call = await waiting_call(browser, turn_id, timeout=15)

        assert await answer(browser, turn_id, call["callId"], approve=True) == {"ok": True}
        assert await browser.completion(turn_id, timeout=15) == (turn_id, True, "Crossed.")
        assert (tmp_path / "crossed.txt").read_text() == "crossed\n"
    finally:
        await browser.close()
        await store.close()


async def test_an_answer_a_frozen_drone_did_not_confirm_is_not_said_to_be_lost(
    drone_process: Start, openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    """A person's Approve to a drone frozen meanwhile was refused with "The drone does not
    answer just now; try again in a moment.", and the drone, awake again, ran the command all
    the same (a Deny after it, refused the same way, changed nothing). What the relay sent
    cannot be taken back: the refusal now says the drone may still act on it."""
    config = RelayConfig(
        port=0,
        database=str(relay_folder(tmp_path) / "hangar.db"),
        drone_token=DRONE_TOKEN,
        abort_answer=1.0,
        drone_grace=10.0,
    )
    openai_peer.script(shell("echo ran > ran.txt"), Reply(chunks=["Ran."]))
    async with relay_on(config) as relay:
        drone = drone_process(Upstream("openai", openai_peer), relay.url, tools="run_shell=ask")
        await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
        browser = await Browser(relay.url, await relay.people.token("ada")).connect()
        try:
            turn_id = (await browser.submit("Run it"))["turnId"]
            call = await waiting_call(browser, turn_id, timeout=15)
            drone.send_signal(signal.SIGSTOP)
            try:
                approved = await answer(browser, turn_id, call["callId"], approve=True)
                declined = await answer(browser, turn_id, call["callId"], approve=False)
            finally:
                drone.send_signal(signal.SIGCONT)

            assert approved == declined == {"ok": False, "error": ANSWER_UNCONFIRMED}
            assert await browser.completion(turn_id, timeout=15) == (turn_id, True, "Ran.")
            assert (tmp_path / "ran.txt").read_text() == "ran\n"  # the first answer it got
            assert states(browser, turn_id) == ["waiting", "start", "end"]
        finally:
            await browser.close()


async def test_a_drone_with_no_sandbox_says_so_and_always_asks_before_a_command(
    relay: RelayHandle,
    drone_process: Start,
    openai_peer: OpenAIPeer,
    browser: Browser,
    tmp_path: Path,
) -> None:
    """Whatever ``--tools`` says, and whatever "Always for this session" said (on this drone,
    or on a sandboxed one that ran the session before: the session keeps it): an "always"
    still ran the session's later commands unconfined without asking."""
    # Only the virtualenv's programs on the PATH: bubblewrap cannot be found.
    path = str(Path(sys.executable).parent)
    assert shutil.which("bwrap", path=path) is None
    openai_peer.script(
        shell("echo one"), shell("echo two"), Reply(chunks=["Asked."]),
        shell("echo three"), Reply(chunks=["Asked again."]),
    )  # fmt: skip
    drone_process(
        Upstream("openai", openai_peer), server=relay.url, tools="all=allow", env={"PATH": path}
    )
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    first = await browser.submit("Run a command")
    turn_id = first["turnId"]

    call = await waiting_call(browser, turn_id)
    assert await answer(browser, turn_id, call["callId"], approve=True, always=True) == {"ok": True}
    second_call = await eventually(
        lambda: [p for p in browser.progress(turn_id, "tool") if p["state"] == "waiting"][1:],
        10,
        "the second command waiting",
    )
    assert await answer(browser, turn_id, second_call[0]["callId"], approve=True) == {"ok": True}
    assert await browser.completion(turn_id) == (turn_id, True, "Asked.")
    later = (await browser.submit("Once more", sessionId=first["sessionId"]))["turnId"]
    call = await waiting_call(browser, later)
    assert await answer(browser, later, call["callId"], approve=True) == {"ok": True}
    assert await browser.completion(later) == (later, True, "Asked again.")
    assert states(browser, later) == ["waiting", "start", "end"]
    log = (tmp_path / "proc-drone-0.log").read_text()
    lines = [line for line in log.splitlines() if "No sandbox available" in line]
    assert len(lines) == 1 and "bubblewrap not found" in lines[0], log


async def _drones(browser: Browser) -> list[Any]:
    answer = await browser.call("listDrones", {})
    drones: list[Any] = answer["drones"]
    return drones


async def test_always_for_this_session_outlives_a_restart_of_the_relay(
    tmp_path: Path, openai_peer: OpenAIPeer
) -> None:
    """Kept with the session in the store: neither a relay's restart nor Redis restarted
    empty (which kept it before) makes the tool ask again."""
    config = RelayConfig(
        port=free_port(),
        database=str(relay_folder(tmp_path) / "hangar.db"),
        drone_token=DRONE_TOKEN,
        drone_grace=10.0,
    )
    openai_peer.script(
        shell("echo one >> log.txt"), Reply(chunks=["Once."]),
        shell("echo two >> log.txt"), Reply(chunks=["Again."]),
    )  # fmt: skip
    drone = DroneConfig(
        server=f"http://127.0.0.1:{config.port}",
        token=DRONE_TOKEN,
        name="keeper",
        tools=ToolPolicy.parse("run_shell=ask"),
        workdir=str(tmp_path),
        **Upstream("openai", openai_peer).drone_settings(),
    )
    root = AbortController()
    running = asyncio.ensure_future(run_drone(drone, root))
    try:
        async with relay_on(config) as relay:
            token = await relay.people.token("ada")
            browser = await Browser(relay.url, token).connect()
            await eventually(lambda: relay.relay.directory.local, 15, "the drone")
            first = await browser.submit("Log once")
            call = await waiting_call(browser, first["turnId"])
            await answer(browser, first["turnId"], call["callId"], approve=True, always=True)
            assert (await browser.completion(first["turnId"]))[2] == "Once."
            await browser.close()

        async with relay_on(config) as relay:  # the same file and port
            browser = await Browser(relay.url, token).connect()
            await eventually(lambda: relay.relay.directory.local, 15, "the drone back")
            second = await browser.submit("Log again", sessionId=first["sessionId"])
            assert (await browser.completion(second["turnId"]))[2] == "Again."
            assert states(browser, second["turnId"]) == ["start", "end"]
            await browser.close()
    finally:
        root.abort(AbortError("The test ends.", cause="operator"))
        await asyncio.wait_for(running, 10)
    assert (tmp_path / "log.txt").read_text().split() == ["one", "two"]


async def test_the_sessions_list_says_which_session_waits_for_an_approval(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Start,
    browsers: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """A call waiting for its person in a session not on screen showed nowhere: the person
    working in another session saw the list say "working" while the turn stood still for the
    10 minutes the drone waits, then was declined. The session's line counts its calls waiting
    (``approvals``, docs/protocol.md ``sessionChanged``), in the list's pages too."""
    openai_peer.script(shell("touch later"), Reply(chunks=["Ran ", "it."], delay=0.5))
    await asking_drone(start_drone, openai_peer, tmp_path)
    owner: Browser = await browsers("ada")
    elsewhere: Browser = await browsers("ada")  # another tab, in no session
    ack = await owner.submit("Ask before you run")
    session_id = ack["sessionId"]

    def lines() -> list[int]:
        return [
            data["session"]["approvals"]
            for event, data in elsewhere.events
            if event == "sessionChanged" and data["session"]["sessionId"] == session_id
        ]

    call = await waiting_call(owner, ack["turnId"])
    await eventually(lambda: 1 in lines(), what="the session's line counting the call")
    page = await elsewhere.call("listSessions", {})
    [line] = [s for s in page["sessions"] if s["sessionId"] == session_id]
    assert (line["processingTurnId"], line["approvals"]) == (ack["turnId"], 1)

    assert await answer(owner, ack["turnId"], call["callId"], approve=True) == {"ok": True}
    await eventually(lambda: lines()[-1] == 0, what="the line without the answered call")
    assert not owner.completions(ack["turnId"])  # said while the turn still ran
    assert (await owner.completion(ack["turnId"]))[2] == "Ran it."
