"""An event loop owned by one object, run inline or in a daemon thread of its own.

Two owners use it:

* engine adapters whose APIs are coroutines bound to one loop (vLLM's ``AsyncLLM``, SGLang's
  ``Engine``): the loop runs in its thread from construction, and the adapter offers postrl's
  interface — async ``generate`` from any loop (:meth:`LoopThread.run`), plain blocking
  ``update_weights`` / ``sleep`` / ``wake_up`` (:meth:`LoopThread.call`, with a deadline);
* the trainer's context (``postrl.trainer.context.TrainerContext``): agent loops, tool calls,
  reward scoring and HTTP traffic to the replicas run on this loop — inline
  (``run_until_complete``) in synchronous modes, in the loop's thread once a mode calls
  :meth:`LoopThread.start` (``fully_async``: rollout goes on while the main thread trains).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from postrl.rollout.signal import Signal
from postrl.rollout.types import RolloutTimeoutError

logger = logging.getLogger(__name__)

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One asyncio loop and, once started, the daemon thread that runs it.

    Args:
        name: the loop thread's name.
        start: start the thread now (engine adapters); False: the loop runs inline in
            :meth:`run_sync` until :meth:`start` (the trainer's context).
        thread_init: called first in the loop's thread and in every thread of the loop's
            default executor (the trainer passes one that makes torch single-threaded there).
        executor_name: thread-name prefix of that default executor (with ``thread_init`` only).
    """

    def __init__(
        self,
        name: str = "postrl-engine-loop",
        *,
        start: bool = True,
        thread_init: Callable[[], None] | None = None,
        executor_name: str = "postrl-loop-exec",
    ) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._init = thread_init
        if thread_init is not None:
            self.loop.set_default_executor(
                ThreadPoolExecutor(thread_name_prefix=executor_name, initializer=thread_init)
            )
        self._thread: threading.Thread | None = None
        self._exited = Signal()  # the loop's thread ended (wakes run_sync's waiters)
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Run the loop in its own daemon thread from now on (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run_forever, name=self.name, daemon=True)
        self._thread.start()

    def _run_forever(self) -> None:
        try:
            if self._init is not None:
                self._init()
            self.loop.run_forever()
        finally:
            self._exited.notify()

    @property
    def started(self) -> bool:
        """Whether the loop runs in its own thread (:meth:`start`)."""
        return self._thread is not None

    @property
    def alive(self) -> bool:
        """Whether work can still be submitted: the thread is alive (started), or the inline
        loop is not running already (not re-entered)."""
        if self._thread is not None:
            return self._thread.is_alive()
        return not self.loop.is_running()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` closed the loop."""
        return self.loop.is_closed()

    def close(self, join_timeout_s: float = 30.0) -> None:
        """Stop the loop (and join its thread for up to ``join_timeout_s``), then close it."""
        if self._thread is not None:
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=join_timeout_s)
            if self._thread.is_alive():  # inside a callback: leave the loop open, say so
                logger.warning(
                    "event-loop thread %r did not stop within %.0fs; its loop stays open",
                    self.name,
                    join_timeout_s,
                )
                return
            self._thread = None
        if not self.loop.is_closed():
            self.loop.close()

    # ------------------------------------------------------------------ running coroutines
    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600.0) -> T:
        """Run ``coro`` on the loop thread and block for its result (raises on deadline)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError as e:
            fut.cancel()
            raise RolloutTimeoutError(f"engine call did not finish within {timeout_s}s") from e

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop thread and return at once with its future (the caller
        collects the result or the error later, e.g. by awaiting ``asyncio.wrap_future`` on the
        loop). Coroutines submitted from one thread start in submission order. Before
        :meth:`start` it runs inline and the future comes back done."""
        if self._thread is None:
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            try:
                fut.set_result(self.loop.run_until_complete(coro))
            except Exception as e:  # noqa: BLE001 (delivered through the future)
                fut.set_exception(e)
            return fut
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (executed on the loop thread) from any other event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def run_sync(
        self,
        coro: Coroutine[Any, Any, T],
        wake: Signal | None = None,
        on_wake: Callable[[], None] | None = None,
    ) -> T:
        """Run ``coro`` to its result: inline before :meth:`start`, else on the loop thread
        while this thread blocks — woken by the result, by the loop thread's end (then
        ``RuntimeError`` instead of hanging the caller) and, with ``wake``, by each of its
        notifications, on which ``on_wake()`` runs on this thread (started loop only; once at
        the start too, so a change just before the call is not missed). The coroutine's own
        waits carry the deadlines; nothing here polls."""
        if self._thread is None:
            return self.loop.run_until_complete(coro)
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                f"run_sync called from the loop thread {self.name!r} itself; await instead"
            )
        woke = threading.Event()
        set_woke = woke.set
        signals = [self._exited] if wake is None else [self._exited, wake]
        for s in signals:  # listening before the coroutine runs: no notification is missed
            s.add_listener(set_woke)
        if wake is not None:
            woke.set()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            fut.add_done_callback(lambda _: set_woke())
            while True:
                if fut.done():
                    return fut.result()
                if not self._thread.is_alive():
                    raise RuntimeError(f"the event-loop thread {self.name!r} died")
                woke.wait()  # (no deadline of its own: see the docstring)
                woke.clear()
                if not fut.done() and on_wake is not None and self._thread.is_alive():
                    on_wake()
        finally:
            for s in signals:
                s.remove_listener(set_woke)

    def create_task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Schedule ``coro`` on the loop: it runs whenever the loop next runs (inline: during
        :meth:`run_sync`; started: at once, and then this must be called from the loop's
        thread)."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            coro.close()
            raise RuntimeError(
                f"create_task from outside the loop thread {self.name!r}; run it via run_sync"
            )
        return self.loop.create_task(coro)
