"""``Liveness``: the dead-or-alive state every out-of-process replica handle shares.

A handle to a replica in another process (``HTTPRolloutReplica``, ``RayRolloutReplica``) is
either live or **dead** — declared so by a failed call or by the
:class:`~postrl.rollout.watchdog.ReplicaWatchdog` — and a dead handle is never used again (a
restart builds a new one). :meth:`Liveness.race` runs one request so that declaring the replica
dead fails it at once with :class:`ReplicaDeadError`, even while it waits on a process that
hangs; the rollout client answers that by re-issuing the request to a live replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from postrl.rollout.types import ReplicaDeadError

__all__ = ["Liveness"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Liveness:
    """Mixin: ``dead``, ``dead_reason``, :meth:`mark_dead`, :meth:`wait_dead`, :meth:`on_dead`
    and :meth:`race`. The class using it calls ``Liveness.__init__(self)`` and has a
    ``replica_id``."""

    replica_id: int

    def __init__(self) -> None:
        self.dead_reason: str | None = None
        self._dead_futs: list[asyncio.Future[None]] = []
        self._live_lock = threading.Lock()
        self._dead_event = threading.Event()
        self._on_dead: list[Callable[[], None]] = []

    @property
    def dead(self) -> bool:
        """Whether the replica was declared dead (it is never used again)."""
        return self.dead_reason is not None

    def mark_dead(self, reason: str) -> None:
        """Declare the replica dead: requests waiting on it fail with :class:`ReplicaDeadError`
        (thread-safe; the first reason is kept)."""
        with self._live_lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            futs, self._dead_futs = self._dead_futs, []
            hooks, self._on_dead = self._on_dead, []
        self._dead_event.set()
        logger.warning("rollout replica %d declared dead: %s", self.replica_id, reason)
        for f in futs:
            loop = f.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_done, f)
        for fn in hooks:
            fn()

    def on_dead(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once when the replica is declared dead (at once if it already is), on
        the declaring thread: it must be quick and thread-safe (e.g. a signal's ``notify``)."""
        with self._live_lock:
            if self.dead_reason is None:
                self._on_dead.append(fn)
                return
        fn()

    def wait_dead(self, timeout_s: float) -> bool:
        """Block until the replica is declared dead (True) or ``timeout_s`` passed (False)."""
        return self._dead_event.wait(timeout_s)

    def check_alive(self) -> None:
        """Raise :class:`ReplicaDeadError` if the replica was declared dead."""
        if self.dead_reason is not None:
            raise ReplicaDeadError(self.replica_id, self.dead_reason)

    async def race(self, call: Coroutine[Any, Any, T]) -> T:
        """Await ``call`` unless the replica is declared dead first: then ``call`` is cancelled
        and :class:`ReplicaDeadError` raised (a cancelled caller cancels ``call`` too)."""
        if self.dead_reason is not None:
            call.close()
            raise ReplicaDeadError(self.replica_id, self.dead_reason)
        loop = asyncio.get_running_loop()
        dead = loop.create_future()
        with self._live_lock:
            self._dead_futs.append(dead)
        if self.dead_reason is not None:  # declared dead between the check and the append
            dead.set_result(None)
        req = loop.create_task(call)
        try:
            await asyncio.wait({req, dead}, return_when=asyncio.FIRST_COMPLETED)
            if req.done():
                return req.result()
            req.cancel()
            raise ReplicaDeadError(self.replica_id, self.dead_reason or "declared dead")
        except asyncio.CancelledError:
            req.cancel()
            raise
        finally:
            with self._live_lock:
                if dead in self._dead_futs:
                    self._dead_futs.remove(dead)


def _set_done(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)
