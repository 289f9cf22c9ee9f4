"""``Signal``: wake async waiters from any thread when a state they wait on may have changed.

The rollout layer's waits (a paused replica, a replica draining its aborted requests, requests
waiting for a restarted replica) are conditions on plain attributes that other threads change
(the trainer's thread pauses a replica; the restart thread installs one). Polling them costs a
busy loop's time and a latency of its period; a :class:`Signal` instead wakes the waiter at
once: whoever changes the state calls :meth:`Signal.notify`, and :meth:`Signal.wait_for`
re-checks its predicate then, or at its deadline. A thread that is not on an event loop (the
trainer's, blocked on the loop thread) hears it through a listener
(:meth:`Signal.add_listener`, e.g. a ``threading.Event``'s ``set``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

__all__ = ["Signal"]


class Signal:
    """A thread-safe, event-loop-agnostic notification (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[None]] = []
        self._listeners: list[Callable[[], None]] = []

    def notify(self) -> None:
        """Wake every current waiter and call every listener (safe from any thread, any
        loop; listeners run on the notifying thread and must be quick and thread-safe)."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
            listeners = list(self._listeners)
        for f in waiters:
            loop = f.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_done, f)
        for fn in listeners:
            fn()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at every :meth:`notify` until :meth:`remove_listener`."""
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        """Stop calling ``fn`` (a no-op if it is not listening)."""
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Return True as soon as ``predicate()`` holds (checked now and at each
        :meth:`notify`), False if it still does not after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fut = loop.create_future()
            with self._lock:
                self._waiters.append(fut)
            if predicate():  # changed between the check and the registration
                return True
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return predicate()
            finally:
                with self._lock:
                    if fut in self._waiters:
                        self._waiters.remove(fut)
        return True


def _set_done(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)
