"""``ReplicaRestarter``: dead rollout replicas started again and put back in the fleet.

A replica declared dead (its process exited, Ray reported the actor dead, or the
:class:`~postrl.rollout.watchdog.ReplicaWatchdog` found it hung) keeps its slot in the
:class:`~postrl.rollout.fleet.RolloutFleet` as a dead handle, which no call uses. The restarter
kills it (a hung process holds its cores) and starts a replacement in a background thread, within
a budget of restarts per run; the replacement joins the fleet right after a weight push, with
exactly that push's weights (:meth:`RolloutFleet.install`).

Nothing fails quietly: a replacement that does not come up, or dies before it joins, is counted
(:attr:`ReplicaRestarter.failed`) and the slot is tried again while the budget lasts; when it is
spent, the next :meth:`ReplicaRestarter.begin` raises :class:`ReplicaRestartError` naming the
slot and the cause. :meth:`ReplicaRestarter.wait_started` lets a caller (a test, an operator's
hook) wait for the replacements on an event, with a deadline, instead of polling.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from postrl.rollout.types import ReplicaDeadError, ReplicaRestartError

__all__ = ["ReplicaRestarter"]

logger = logging.getLogger(__name__)


class ReplicaRestarter:
    """Starts dead rollout replicas again and puts them back in service at weight pushes.

    :meth:`begin` (any time, on the trainer's thread) kills each newly dead replica and starts
    its replacement in a background thread, ``budget`` times per run at most; :meth:`install`
    (right after a weight push, when the actor's weights are exactly the fleet's version)
    delivers those weights to every replacement that came up and routes to it.

    Args:
        fleet: the :class:`~postrl.rollout.fleet.RolloutFleet`.
        spawn: ``spawn(slot) -> replica`` (e.g.
            :meth:`~postrl.rollout.dedicated.DedicatedReplicas.spawn`).
        budget: restarts allowed over the run (failed ones count).
    """

    def __init__(self, fleet: Any, spawn: Callable[[int], Any], budget: int) -> None:
        self.fleet = fleet
        self.spawn = spawn
        self.left = budget
        self.failed = 0
        """Restarts that did not come up (or died before joining)."""
        self._pending: dict[int, Future[Any]] = {}
        self._last_failure: dict[int, str] = {}  # slot -> why its last restart failed
        # one long-lived thread: a replica process dies with the thread that started it
        # (PR_SET_PDEATHSIG), so the starter must outlive the replicas it started
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-restart")
        if fleet.balancer is not None:  # with none live, requests wait for a replacement
            fleet.balancer.restart_expected = self.expected

    @property
    def pending(self) -> int:
        """Replacements starting or up and not yet installed."""
        return len(self._pending)

    def begin(self) -> None:
        """Start a replacement for every dead replica not being replaced yet (budget
        permitting). Raises :class:`ReplicaRestartError` when a slot whose restart failed is
        still dead and no restart is left."""
        for slot, rep in enumerate(self.fleet.replicas):
            if not rep.dead or slot in self._pending:
                continue
            if self.left <= 0:
                if slot in self._last_failure:
                    raise ReplicaRestartError(slot, self._last_failure[slot])
                continue
            # pending before the budget drops: requests waiting on another thread read
            # expected() (budget left or a replacement pending) and must never see neither
            fut = self._pool.submit(self._replace, slot, rep)
            self._pending[slot] = fut
            self.left -= 1
            logger.warning(
                "restarting rollout replica %d (%s); %d restart(s) left",
                slot,
                rep.dead_reason,
                self.left,
            )
            fut.add_done_callback(self._started)

    def _started(self, _fut: Future[Any]) -> None:
        self.fleet.changed.notify()  # a replacement is up (or failed): the trainer may rescue

    def _replace(self, slot: int, dead: Any) -> Any:
        dead.kill()  # a hung process or actor holds its cores (and its Ray bundle)
        return self.spawn(slot)

    def expected(self) -> bool:
        """Whether a replacement may still come (budget left, or one starting)."""
        return self.left > 0 or bool(self._pending)

    def ready(self) -> bool:
        """Whether a replacement has finished starting (successfully or not)."""
        return any(f.done() for f in self._pending.values())

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until some replacement has finished starting (True), or ``timeout_s`` passed
        or none is starting (False)."""
        if not self._pending:
            return False
        done, _ = concurrent.futures.wait(
            list(self._pending.values()), timeout=timeout_s, return_when="FIRST_COMPLETED"
        )
        return bool(done)

    def wait_started(self, timeout_s: float) -> None:
        """Block until every replacement begun so far has finished starting (successfully or
        not); ``TimeoutError`` naming the slots still starting after ``timeout_s``."""
        pending = dict(self._pending)
        _, not_done = concurrent.futures.wait(pending.values(), timeout=timeout_s)
        if not_done:
            slots = sorted(s for s, f in pending.items() if f in not_done)
            raise TimeoutError(f"rollout replica(s) {slots} still starting after {timeout_s}s")

    def install(self, open_source: Callable[[int], Any]) -> int:
        """Install every replacement that is up (call right after a push); returns how many.
        A replacement that failed to start, or died during its first push, is counted and
        logged, and its slot is tried again at the next :meth:`begin` (budget permitting)."""
        n = 0
        for slot, fut in list(self._pending.items()):
            if not fut.done():
                continue
            try:  # (it stays pending until it serves: requests waiting for it keep waiting)
                rep = fut.result()
            except Exception as e:  # noqa: BLE001 (counted, logged, retried or raised by begin)
                self._failed(slot, f"did not start: {type(e).__name__}: {e}")
                continue
            try:
                self.fleet.install(slot, rep, open_source)
            except ReplicaDeadError as e:
                self._failed(slot, f"died before joining: {e}")
                rep.kill()
                continue
            del self._pending[slot]
            self._last_failure.pop(slot, None)
            logger.info(
                "rollout replica %d restarted and serving version %d", slot, self.fleet.version
            )
            n += 1
        return n

    def _failed(self, slot: int, why: str) -> None:
        self.failed += 1
        del self._pending[slot]
        self._last_failure[slot] = why
        if self.fleet.balancer is not None:  # requests waiting for it re-check expected()
            self.fleet.balancer.changed.notify()
        logger.error(
            "rollout replica %d: its restart failed (%s); %d restart(s) left", slot, why, self.left
        )

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait for replacements still starting and close them (they never joined)."""
        for fut in self._pending.values():
            try:
                fut.result(timeout=timeout_s).close()
            except Exception:  # noqa: BLE001 (closing: a replacement that failed is gone)
                logger.debug("closing a pending replica restart failed", exc_info=True)
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
