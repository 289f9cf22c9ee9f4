"""The health watchdog of out-of-process rollout replicas: hung or dead replicas are declared
dead (their waiting requests fail at once and the client re-issues them to a live replica).

:class:`ReplicaWatchdog` pings each replica's ``/health``; :func:`process_cpu_ticks` reads a
local process's CPU time, so a replica that is silent but working (a loaded machine) is told
from a hung one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["ReplicaWatchdog", "process_cpu_ticks"]

logger = logging.getLogger(__name__)


class ReplicaWatchdog:
    """Pings every live replica's ``/health`` every ``interval_s`` and declares dead (its
    waiting requests fail at once and are re-issued by the client) a replica

    - whose process is gone (exited, or Ray reported the actor dead): at once;
    - that has not answered for ``timeout_s`` **and** whose process made no CPU progress in
      the last ``timeout_s`` (a stopped or deadlocked process: a hang);
    - that has not answered for ``busy_timeout_s`` although its process kept running (a
      livelock, or a machine so loaded that the replica is useless).

    A replica that misses pings while its process keeps working is *slow*, not dead: on a
    loaded machine a busy replica can be silent for seconds (its event loop starved of CPU),
    and declaring it dead would throw away its work and spend a restart on it. Each such
    missed ping is counted in :attr:`busy_pings`. CPU progress is read from ``/proc`` for a
    process on this machine (``local_pid`` of the handle); elsewhere silence alone decides.
    Run :meth:`run` as a task on the loop the agent loops use.

    Args:
        replicas: out-of-process replica handles (:class:`HTTPRolloutReplica`,
            :class:`~postrl.rollout.ray_replica.RayRolloutReplica`: ``dead``, async ``health``,
            ``process_gone``, ``mark_dead``, ``busy_s``, ``local_pid``; ``core_wait_s`` is
            set from the answer too), read afresh each round
            (a restarted replica joins).
        interval_s: time between two rounds of pings.
        timeout_s: silence (with no CPU progress) after which a replica is hung.
        busy_timeout_s: silence after which a replica is dead even though its process runs
            (default ``max(10 × timeout_s, 60)``).
    """

    def __init__(
        self,
        replicas: list[Any],
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
        busy_timeout_s: float | None = None,
    ) -> None:
        self.replicas = replicas
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.busy_timeout_s = (
            max(10.0 * timeout_s, 60.0) if busy_timeout_s is None else busy_timeout_s
        )
        self.failures = 0
        self.busy_pings = 0
        """Pings missed by a replica whose process kept working (not declared dead)."""
        self._last_ok: dict[int, float] = {}  # id(handle) -> monotonic time of its last answer
        self._cpu: dict[int, tuple[int, float]] = {}  # id(handle) -> (CPU ticks, when they moved)

    async def check(self) -> None:
        """One round of pings (concurrent)."""
        live = [r for r in self.replicas if not r.dead]
        results = await asyncio.gather(
            *(r.health(self.timeout_s) for r in live), return_exceptions=True
        )
        now = time.monotonic()
        for r, res in zip(live, results, strict=True):
            last = self._last_ok.setdefault(id(r), now)  # a restarted replica: a new handle
            progress = self._cpu_progress(r, now)
            if isinstance(res, dict):
                r.busy_s = float(res.get("busy_s", r.busy_s))
                r.busy_at = time.perf_counter()  # when busy_s was read (the pings' clock)
                r.core_wait_s = float(res.get("core_wait_s", getattr(r, "core_wait_s", 0.0)))
                self._last_ok[id(r)] = now
                continue
            if isinstance(res, asyncio.CancelledError):
                continue
            gone = r.process_gone()
            silent = now - last
            if gone is None and silent < self.timeout_s:
                continue  # one failed ping (e.g. a connection closed under us) is not death
            working = progress is not None and now - progress < self.timeout_s
            if gone is None and working and silent < self.busy_timeout_s:
                self.busy_pings += 1  # silent but working: slow (a loaded machine), not hung
                logger.info(
                    "rollout replica %d: no /health answer for %.1fs but its process is "
                    "working; not declared dead before %.0fs of silence",
                    r.replica_id,
                    silent,
                    self.busy_timeout_s,
                )
                continue
            if gone is None:
                gone = f"no /health answer for {silent:.1f}s"
                if working:
                    gone += " although its process kept running"
                elif progress is not None:
                    gone += f" and no CPU progress for {now - progress:.1f}s"
                gone += f" ({type(res).__name__}: {res})"
            r.mark_dead(gone)
            self.failures += 1

    def _cpu_progress(self, r: Any, now: float) -> float | None:
        """When the replica's process last used CPU (monotonic time; None: not readable)."""
        ticks = process_cpu_ticks(r.local_pid)
        if ticks is None:
            return None
        seen = self._cpu.get(id(r))
        if seen is None or seen[0] != ticks:
            seen = (ticks, now)
            self._cpu[id(r)] = seen
        return seen[1]

    async def run(self) -> None:
        """Ping until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)


def process_cpu_ticks(pid: int | None) -> int | None:
    """User + system CPU time of process ``pid`` on this machine, in clock ticks (all its
    threads; ``/proc/PID/stat``), or None when it cannot be read (no pid, not Linux, gone)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    try:
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (IndexError, ValueError):
        return None
