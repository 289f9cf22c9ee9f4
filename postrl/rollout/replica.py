"""``Replica``: what every rollout replica is, wherever it runs.

One typed surface for the in-process :class:`~postrl.rollout.client.RolloutReplica`, the
subprocess :class:`~postrl.rollout.http_replica.HTTPRolloutReplica` (any backend, vLLM's included,
in a process and interpreter of its own) and the Ray actor
:class:`~postrl.rollout.ray_replica.RayRolloutReplica`.
The load balancer, the resuming client, the fleet and the weight-sync backends use only this
surface, so a new kind of replica is one class that implements it — nothing probes a replica
for what it has.

:class:`Replica` is what routing and generation need; :class:`RemoteReplica` adds what a
replica in another process needs to be watched and replaced (health pings, the process's
fate, kill). Weight delivery (``update_weights`` / ``receive_bucket``) is the weight-sync
backends' contract (``postrl.weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from postrl.rollout.types import SamplingParams, TokenOutput

__all__ = ["RemoteReplica", "Replica"]


@runtime_checkable
class Replica(Protocol):
    """A rollout replica: routing state plus token-in/token-out generation.

    Attributes every replica has: ``replica_id`` (its slot, in logs and errors),
    ``policy_version`` (the version of the weights it serves; written by weight delivery only),
    ``standby`` (out of service without being dead: nothing is routed to it), ``dead`` and
    ``dead_reason`` (declared dead: never used again; always False/None in-process), ``load``
    (requests in flight through it).
    """

    replica_id: int
    policy_version: int
    standby: bool

    @property
    def dead(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def load(self) -> int: ...

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Generate one completion (an aborted request returns its partial output)."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort one request; its caller gets the partial output."""
        ...

    def pause(self) -> None:
        """Abort every in-flight request and hold new ones (partial rollout)."""
        ...

    def resume(self) -> None:
        """Serve again after :meth:`pause`."""
        ...

    def close(self) -> None:
        """Release the replica (its process, its engine)."""
        ...


@runtime_checkable
class RemoteReplica(Replica, Protocol):
    """A replica in another process: watched by
    :class:`~postrl.rollout.watchdog.ReplicaWatchdog`, replaced by
    :class:`~postrl.rollout.restart.ReplicaRestarter`.

    Extra attributes: ``busy_s`` (the engine's seconds in steps, as of the last ping),
    ``busy_at`` (``time.perf_counter()`` when that ping's answer arrived; 0.0 before the first),
    ``local_pid`` (its process id when it runs on this machine, else None).
    """

    busy_s: float
    busy_at: float
    local_pid: int | None

    async def health(self, timeout_s: float) -> dict[str, Any]:
        """The replica's health answer within ``timeout_s`` (raises on failure)."""
        ...

    def process_gone(self) -> str | None:
        """Why its process is gone, or None while it may still run."""
        ...

    def mark_dead(self, reason: str) -> None:
        """Declare it dead: requests waiting on it fail at once."""
        ...

    def wait_dead(self, timeout_s: float) -> bool:
        """Block until it is declared dead (True) or ``timeout_s`` passed (False)."""
        ...

    def on_dead(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once when it is declared dead (at once if it already is)."""
        ...

    def kill(self) -> None:
        """Kill its process (a hung one holds its cores)."""
        ...
