"""The abort primitives every layer takes as ``signal``."""

import asyncio

import pytest

from hangar.shared.abort import (
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


async def test_a_scope_keeps_the_result_of_work_that_finishes_first() -> None:
    controller = AbortController()
    async with controller.signal.scope():
        result = await asyncio.sleep(0, result=42)
    assert result == 42


async def test_a_scope_cancels_pending_work_at_once_on_abort() -> None:
    controller = AbortController()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def stalled_read() -> None:
        async with controller.signal.scope():
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

    reading = asyncio.ensure_future(stalled_read())
    await asyncio.wait_for(started.wait(), 1)
    controller.abort()
    with pytest.raises(AbortError):
        await asyncio.wait_for(reading, 1)
    assert cancelled.is_set()


async def test_a_scope_refuses_to_start_on_an_aborted_signal() -> None:
    controller = AbortController()
    controller.abort()
    started = False

    async def work() -> None:
        nonlocal started
        started = True

    with pytest.raises(AbortError):
        async with controller.signal.scope():
            await work()
    assert not started


async def test_the_aborted_task_is_not_left_cancelling() -> None:
    controller = AbortController()
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_soon(controller.abort)

    with pytest.raises(AbortError):
        async with controller.signal.scope():
            await asyncio.sleep(10)

    assert task.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation is left over to land on the code after the scope


async def test_a_scope_deadline_raises_a_timeout_and_removes_its_timer() -> None:
    loop = asyncio.get_running_loop()
    signal = AbortController().signal
    with pytest.raises(AbortTimeoutError, match=r"Timed out after 0\.01 s"):
        async with signal.scope(0.01):
            await asyncio.sleep(10)
    async with signal.scope(60):
        await asyncio.sleep(0)
    assert signal.subscribers == 0
    assert not [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]


async def test_a_scope_leaves_nothing_subscribed_whether_it_fired_or_not() -> None:
    root = AbortController()
    for _ in range(3):
        async with root.signal.scope() as scope:
            await asyncio.sleep(0)
        assert scope.signal.aborted is False
    assert root.signal.subscribers == 0


async def test_nested_scopes_hand_the_abort_to_the_innermost() -> None:
    root = AbortController()
    caught: list[str] = []

    async def work() -> None:
        async with root.signal.scope() as outer:
            try:
                async with outer.signal.scope():
                    await asyncio.sleep(10)
            except AbortError:
                caught.append("inner")
                await asyncio.sleep(0)  # keeping what streamed is not interrupted
                caught.append("kept")
                raise

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    root.abort()
    with pytest.raises(AbortError):
        await task
    assert caught == ["inner", "kept"]


async def test_a_cancellation_from_elsewhere_passes_through_a_scope() -> None:
    root = AbortController()

    async def work() -> None:
        async with root.signal.scope():
            await asyncio.sleep(10)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert root.signal.subscribers == 0


async def test_a_failing_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = AbortController()
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    controller.signal.add_callback(broken)
    controller.signal.add_callback(lambda: calls.append("ran"))
    assert controller.abort() is True
    assert calls == ["ran"]
    assert "an abort callback failed" in caplog.text


async def test_any_of_fires_with_the_reason_of_the_first_source() -> None:
    person, other = AbortController(), AbortController()
    combined = any_of(person.signal, other.signal)
    reason = AbortError("person")
    person.abort(reason)
    assert combined.aborted and combined.reason is reason
    other.abort(AbortError("later"))
    assert combined.reason is reason


async def test_any_of_and_timeout_release_what_they_hold_when_done() -> None:
    loop = asyncio.get_running_loop()
    person = AbortController()
    with timeout(60) as deadline, any_of(person.signal, deadline) as combined:
        assert person.signal.subscribers == 1
    assert not combined.aborted
    assert person.signal.subscribers == 0 and deadline.subscribers == 0
    assert not [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]


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


async def test_a_closed_child_no_longer_follows_its_parent() -> None:
    root = AbortController()
    with linked_controller(root.signal) as child:
        assert root.signal.subscribers == 1
    root.abort()
    assert root.signal.subscribers == 0
    assert not child.signal.aborted


async def test_aborting_a_child_leaves_the_parent_running() -> None:
    root = AbortController()
    child = linked_controller(root.signal)
    child.abort()
    assert child.signal.aborted
    assert not root.signal.aborted
