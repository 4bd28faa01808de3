"""What an operator sees: metrics, health, and the drone command in and out of a terminal."""

from __future__ import annotations

import asyncio
import logging
import os
import pty
import signal
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.peers import OpenAIPeer, Reply
from hangar.server.app import RELAY, RelayConfig
from hangar.server.cli import start_relay
from hangar.shared.protocol import ABORT_SIGNALED
from tests.browser.hand_drone import HandDrone
from tests.conftest import (
    DRONE_TOKEN,
    HANGAR,
    ROOT,
    Browser,
    People,
    RelayHandle,
    Upstream,
    eventually,
    relay_folder,
)


async def metrics_of(relay: RelayHandle) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(relay.url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def test_metrics_count_connections_endings_aborts_and_progress(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    start_drone: Callable[..., Any],
    browser: Browser,
) -> None:
    openai_peer.script(
        Reply(chunks=["a", "b", "c"]), Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03)
    )
    await start_drone(Upstream("openai", openai_peer))
    finished = await browser.submit("Quick")
    await browser.completion(finished["turnId"])
    aborted = await browser.submit("Slow")
    await browser.wait_text(aborted["turnId"], pieces=2)
    await browser.abort(aborted["turnId"])
    await browser.completion(aborted["turnId"])

    metrics = await metrics_of(relay)

    assert metrics["hangar_browsers_connected"] == 1
    assert metrics["hangar_drones_connected"] == 1
    assert metrics['hangar_work_orders_total{status="finished"}'] == 1
    assert metrics['hangar_work_orders_total{status="aborted"}'] == 1
    assert metrics['hangar_work_orders_total{status="error"}'] == 0
    assert metrics["hangar_abort_latency_seconds_count"] == 1
    relayed = [e for e, _ in browser.events if e == "workOrderProgress"]
    assert metrics["hangar_progress_events_total"] == len(relayed) >= 1 + 2 + 2


async def test_healthz_answers_with_what_the_relay_holds(relay: RelayHandle) -> None:
    async with aiohttp.ClientSession() as http, http.get(relay.url + "/healthz") as response:
        assert response.status == 200
        assert await response.json() == {"ok": True, "drones": 0, "live": 0}


@pytest.mark.parametrize(
    ("signum", "reason"),
    [(signal.SIGINT, "operator"), (signal.SIGTERM, "shutdown"), (signal.SIGHUP, "shutdown")],
    ids=["ctrl-c", "sigterm", "hangup"],
)
async def test_ctrl_c_once_aborts_running_work_orders_reports_them_and_exits_cleanly(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
    signum: signal.Signals,
    reason: str,
) -> None:
    openai_peer.script(Reply(chunks=[f"w{i} " for i in range(300)], delay=0.03))
    process = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    turn_id = (await browser.submit("Long job"))["turnId"]
    await browser.wait_text(turn_id, pieces=2)

    process.send_signal(signum)

    assert await browser.completion(turn_id) == (turn_id, True, "aborted")
    ending = await browser.ending(turn_id)
    assert (ending["status"], ending["reason"]) == ("aborted", reason)
    assert "endedBy" not in ending  # not a person's abort
    turn = await relay.relay.store.get_turn(turn_id, messages=False)
    assert turn is not None and turn.reason == reason
    await openai_peer.wait_for_disconnect()
    assert await asyncio.to_thread(process.wait, 10) == 0


async def goes_on_through(
    sent: signal.Signals,
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    started: subprocess.Popen[bytes],
    browser: Browser,
) -> None:
    """``sent`` (also while it loads) leaves the drone ``started`` running: a turn it streams
    when it comes again ends whole, and the drone runs on."""
    openai_peer.script(Reply(chunks=[f"w{i} " for i in range(20)], delay=0.03))
    started.send_signal(sent)  # while it loads
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    turn_id = (await browser.submit("Long job"))["turnId"]
    await browser.wait_text(turn_id, pieces=2)

    started.send_signal(sent)

    whole = " ".join(f"w{i}" for i in range(20))
    assert await browser.completion(turn_id) == (turn_id, True, whole)
    assert started.poll() is None


async def test_a_drone_started_with_nohup_goes_on_through_a_hangup(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    browser: Browser,
) -> None:
    process = drone_process(Upstream("openai", openai_peer), server=relay.url, nohup=True)
    await goes_on_through(signal.SIGHUP, relay, openai_peer, process, browser)


def runs_its_code(pid: int) -> bool:
    """Whether a process started with SIGINT ignored runs the command's own code: it holds
    SIGINT back while it loads, or no longer ignores it (``/proc/PID/status``)."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    bit = 1 << (signal.SIGINT - 1)
    return bool(int(status["SigBlk"], 16) & bit or not int(status["SigIgn"], 16) & bit)


async def test_a_drone_a_script_started_in_the_background_stops_on_a_ctrl_c_whenever_it_comes(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """A shell script's background job starts with Ctrl-C ignored. The drone took one while it
    loaded its first modules (exit 130) and once its loop ran (exit 0), and ignored one that
    came in between: it ran on, for good."""
    for moment in (0.0, 0.15, 0.3, 0.45, 0.6, 0.9):
        process = drone_process(Upstream("openai", openai_peer), server=relay.url, background=True)
        # Before its own first line runs, the interpreter has only the ignore it was given.
        await eventually(partial(runs_its_code, process.pid), 10, "the drone's code to run")
        await asyncio.sleep(moment)  # a moment of its start (nothing is waited for)
        process.send_signal(signal.SIGINT)
        try:
            code = await asyncio.to_thread(process.wait, 15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a Ctrl-C {moment} s after the start was ignored") from None
        assert code in (0, 130), (moment, code)


async def test_ctrl_c_twice_exits_at_once(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    process = drone_process(Upstream("openai", openai_peer), server=relay.url)
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")

    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)

    assert await asyncio.to_thread(process.wait, 10) in (0, 130)


async def test_the_drone_draws_a_live_status_line_in_a_terminal(
    relay: RelayHandle, openai_peer: OpenAIPeer, tmp_path: Path
) -> None:
    leader, follower = pty.openpty()
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "drone", "--server", relay.url,
        "--token", DRONE_TOKEN, "--name", "tty-drone", "--workdir", str(tmp_path),
        "--base-url", openai_peer.base_url + "/v1", "--api-key", "k",
        cwd=ROOT, stdin=follower, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    screen = b""
    try:
        while b"chunks streamed" not in screen:
            chunk = await asyncio.wait_for(asyncio.to_thread(os.read, leader, 4096), 15)
            screen += chunk
    finally:
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 10)
        os.close(leader)
    line = screen.decode(errors="replace").split("\r\x1b[K")[-1]
    assert line.startswith(f"hangar drone · connected to {relay.url} · 0 running")


async def test_the_drone_logs_plain_lines_when_not_in_a_terminal(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    process = drone_process(Upstream("openai", openai_peer), server=relay.url, name="plain")
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    process.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(process.wait, 10) == 0

    output = (tmp_path / "plain-0.log").read_text()
    assert "INFO hangar.drone connected to relay" in output
    assert "\x1b[K" not in output and "chunks streamed" not in output


async def test_a_drone_logging_everything_leaves_its_token_out(
    relay: RelayHandle,
    openai_peer: OpenAIPeer,
    drone_process: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    """At --log-level debug the transport's lines held the connect packet, token and all: one
    pasted log gave the drone away."""
    token = await relay.relay.accounts.create_drone_token("talky")
    process = drone_process(
        Upstream("openai", openai_peer),
        server=relay.url,
        name="talky",
        token=token,
        env={"HANGAR_LOG_LEVEL": "debug"},
    )
    await eventually(lambda: relay.relay.directory.local, timeout=15, what="the drone")
    process.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(process.wait, 10) == 0

    output = (tmp_path / "talky-0.log").read_text()
    assert "DEBUG engineio.client" in output and '"token":"hgd.talky.***"' in output
    assert token.rsplit(".", 1)[1] not in output


@pytest.mark.parametrize(
    ("arguments", "line", "code"),
    [
        (
            ["--provider", "bogus", "--token", "t"],
            "hangar drone: --provider: expected one of openai, ollama, got 'bogus'.",
            2,
        ),
        (
            [],
            "hangar drone: a drone token is required (--token or HANGAR_DRONE_TOKEN).",
            2,
        ),
    ],
    ids=["unknown-provider", "no-token"],
)
async def test_drone_start_errors_are_one_clear_line(
    arguments: list[str], line: str, code: int
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGAR_")}
    process = await asyncio.create_subprocess_exec(
        *HANGAR, "drone", *arguments,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)

    assert process.returncode == code
    assert stdout == b""
    assert stderr.decode().splitlines() == [line]


async def test_an_abort_asked_as_the_relay_stops_is_answered_before_it_closes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopping relay closed every connection at once: an abort on its way to the drone was
    carried out, but its person was never answered (the page said the relay did not answer)."""
    caplog.set_level(logging.DEBUG, logger="hangar.relay")
    database = str(relay_folder(tmp_path) / "relay.db")
    runner, port = await start_relay(
        RelayConfig(port=0, database=database, drone_token=DRONE_TOKEN)
    )
    url, stopping = f"http://127.0.0.1:{port}", None
    try:
        token = await People(runner.app[RELAY].accounts).token("ada")
        browser = await Browser(url, token).connect()
        async with HandDrone(url, "slow") as drone:
            drone.answer_aborts.clear()
            turn_id = (await browser.submit("Stop me"))["turnId"]
            assert await drone.next_order() == turn_id
            abort = asyncio.ensure_future(browser.abort(turn_id))
            await asyncio.wait_for(drone.abort_asked.wait(), 5)
            stopping = asyncio.ensure_future(runner.cleanup())
            await eventually(lambda: "stopping: no new connections" in caplog.text, 5, "a stop")
            drone.answer_aborts.set()

            assert await abort == (True, ABORT_SIGNALED)
    finally:
        await (stopping or runner.cleanup())
