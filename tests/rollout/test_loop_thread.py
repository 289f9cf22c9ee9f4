"""``LoopThread``: the one event-loop owner of the engine adapters and the trainer's context —
inline until started, then a daemon thread; every blocking wait ends (result, deadline or a
dead thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from postrl.rollout.loop_thread import LoopThread
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
        polls: list[int] = []

        async def slow() -> int:
            await asyncio.sleep(0.5)
            return 7

        assert lt.run_sync(slow(), poll=lambda: polls.append(1)) == 7 and polls
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
        lt.run_sync(asyncio.sleep(10), poll=lambda: None)  # 0.2 s waits: finds it sooner
    lt.close()
    assert lt.closed
