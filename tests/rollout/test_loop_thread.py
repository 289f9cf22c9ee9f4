"""``LoopThread``: the one event-loop owner of the engine adapters and the trainer's context —
inline until started, then a daemon thread; every blocking wait ends (result, deadline or a
dead thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from postrl.rollout.loop_thread import LoopThread
from postrl.rollout.signal import Signal
from postrl.rollout.types import RolloutTimeoutError


async def _where() -> str:
    return threading.current_thread().name


def test_inline_until_started_then_in_its_thread():
    inits: list[str] = []
    lt = LoopThread(
        "t-loop", start=False, thread_init=lambda: inits.append(threading.current_thread().name)
    )
    try:
        assert not lt.started and lt.alive
        assert lt.run_sync(_where()) == threading.current_thread().name  # inline
        # the default executor's threads run thread_init too (the trainer: torch single-threaded)
        lt.run_sync(asyncio.to_thread(lambda: None))
        assert any(n.startswith("postrl-loop-exec") for n in inits)
        lt.start()
        lt.start()  # idempotent
        assert lt.started and lt.run_sync(_where()) == "t-loop"
        assert "t-loop" in inits
        # a notification wakes the blocked caller, which runs on_wake on its own thread
        changed, heard = Signal(), threading.Event()
        woken: list[str] = []

        def on_wake() -> None:
            woken.append(threading.current_thread().name)
            heard.set()

        async def notifying() -> int:
            changed.notify()  # (from the loop thread)
            await asyncio.to_thread(heard.wait, 60)
            return 7

        assert lt.run_sync(notifying(), changed, on_wake) == 7
        assert woken and set(woken) == {threading.current_thread().name}
        with pytest.raises(RuntimeError, match="from outside the loop thread 't-loop'"):
            lt.create_task(_where())
        with pytest.raises(RolloutTimeoutError, match="within 0.05s"):
            lt.call(asyncio.sleep(5), timeout_s=0.05)
    finally:
        lt.close()
    assert lt.closed and not lt.started


@pytest.mark.filterwarnings("ignore:coroutine 'sleep' was never awaited")  # its loop is dead
def test_a_dead_loop_thread_raises_instead_of_hanging():
    lt = LoopThread("t-dead")
    fut = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), lt.loop)
    fut.result(timeout=5)
    lt.loop.call_soon_threadsafe(lt.loop.stop)  # the thread ends, the loop is left open
    lt._thread.join(timeout=5)
    with pytest.raises(RuntimeError, match="event-loop thread 't-dead' died"):
        lt.run_sync(asyncio.sleep(10))
    lt.close()
    assert lt.closed


def test_a_loop_thread_that_ends_during_a_wait_wakes_the_caller():
    """No poll: the thread's end itself wakes the blocked caller (a 60 s sleep would hang it)."""
    lt = LoopThread("t-ends")

    async def stop_then_sleep() -> None:
        asyncio.get_running_loop().call_soon(lt.loop.stop)
        await asyncio.sleep(60)

    with pytest.raises(RuntimeError, match="event-loop thread 't-ends' died"):
        lt.run_sync(stop_then_sleep())
    pending = asyncio.all_tasks(lt.loop)  # the stopped loop's sleeper: cancelled, not leaked
    for task in pending:
        task.cancel()
    lt.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    lt.close()


def test_submit_returns_at_once_and_runs_in_submission_order():
    """``submit``: inline (done on return) before ``start``; on the thread, coroutines submitted
    from one thread start in order, and an error comes back through the future."""
    lt = LoopThread("t-submit", start=False)
    try:
        assert lt.submit(_where()).result(timeout=0) == threading.current_thread().name
        lt.start()
        order: list[int] = []
        gate = threading.Event()

        async def first() -> None:
            gate.wait(5)  # holds the loop: the caller got its future back before this ran
            order.append(1)

        async def second() -> None:
            order.append(2)

        async def fails() -> None:
            raise ValueError("from the loop")

        f1, f2, f3 = lt.submit(first()), lt.submit(second()), lt.submit(fails())
        assert not f1.done()
        gate.set()
        f2.result(timeout=5)
        assert order == [1, 2]
        with pytest.raises(ValueError, match="from the loop"):
            f3.result(timeout=5)
    finally:
        lt.close()
