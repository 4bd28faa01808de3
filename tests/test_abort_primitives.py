"""The abort primitives every layer takes as ``signal``."""

import asyncio

import pytest

from shared.abort import (
    AbortController,
    AbortError,
    AbortTimeoutError,
    any_of,
    linked_controller,
    timeout,
)


async def test_a_fresh_signal_is_not_aborted_and_does_not_throw() -> None:
    signal = AbortController().signal
    assert not signal.aborted
    assert signal.reason is None
    signal.throw_if_aborted()


async def test_abort_sets_reason_and_throw_if_aborted_raises_it() -> None:
    controller = AbortController()
    assert controller.abort() is True
    assert controller.signal.aborted
    with pytest.raises(AbortError, match="aborted"):
        controller.signal.throw_if_aborted()


async def test_abort_is_idempotent_and_keeps_the_first_reason() -> None:
    controller = AbortController()
    first = AbortError("first")
    controller.abort(first)
    assert controller.abort(AbortError("second")) is False
    assert controller.signal.reason is first


async def test_wait_returns_when_the_signal_fires() -> None:
    controller = AbortController()
    waiter = asyncio.ensure_future(controller.signal.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    controller.abort()
    reason = await asyncio.wait_for(waiter, 1)
    assert isinstance(reason, AbortError)


async def test_callbacks_run_once_and_can_be_removed() -> None:
    controller = AbortController()
    calls: list[str] = []
    controller.signal.add_callback(lambda: calls.append("kept"))
    remove = controller.signal.add_callback(lambda: calls.append("removed"))
    remove()
    controller.abort()
    controller.abort()
    assert calls == ["kept"]
    controller.signal.add_callback(lambda: calls.append("late"))
    assert calls == ["kept", "late"]


async def test_race_returns_the_result_when_work_finishes_first() -> None:
    controller = AbortController()
    assert await controller.signal.race(asyncio.sleep(0, result=42)) == 42


async def test_race_cancels_pending_work_at_once_on_abort() -> None:
    controller = AbortController()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def stalled_read() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    racing = asyncio.ensure_future(controller.signal.race(stalled_read()))
    await asyncio.wait_for(started.wait(), 1)
    controller.abort()
    with pytest.raises(AbortError):
        await asyncio.wait_for(racing, 1)
    assert cancelled.is_set()


async def test_race_refuses_to_start_on_an_aborted_signal() -> None:
    controller = AbortController()
    controller.abort()
    started = False

    async def work() -> None:
        nonlocal started
        started = True

    with pytest.raises(AbortError):
        await controller.signal.race(work())
    assert not started


async def test_any_of_fires_with_the_reason_of_the_first_source() -> None:
    person, other = AbortController(), AbortController()
    combined = any_of(person.signal, other.signal)
    reason = AbortError("person")
    person.abort(reason)
    assert combined.aborted and combined.reason is reason
    other.abort(AbortError("later"))
    assert combined.reason is reason


async def test_any_of_an_already_aborted_signal_is_aborted() -> None:
    done = AbortController()
    done.abort()
    assert any_of(AbortController().signal, done.signal).aborted


async def test_timeout_fires_with_a_timeout_reason() -> None:
    signal = timeout(0.01)
    reason = await asyncio.wait_for(signal.wait(), 1)
    assert isinstance(reason, AbortTimeoutError)
    assert str(reason) == "Timed out after 0.01 s"


async def test_a_deadline_composed_with_an_abort_tells_which_fired() -> None:
    person = AbortController()
    combined = any_of(person.signal, timeout(60))
    person.abort()
    assert combined.aborted
    assert not isinstance(combined.reason, AbortTimeoutError)


async def test_aborting_a_parent_aborts_every_linked_descendant() -> None:
    root = AbortController()
    child = linked_controller(root.signal)
    grandchild = linked_controller(child.signal)
    root.abort()
    assert child.signal.aborted and grandchild.signal.aborted


async def test_aborting_a_child_leaves_the_parent_running() -> None:
    root = AbortController()
    child = linked_controller(root.signal)
    child.abort()
    assert child.signal.aborted
    assert not root.signal.aborted
