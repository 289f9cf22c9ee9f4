"""``RolloutFleet``: every rollout replica of a run, driven together (wake, sleep, weights).

The fleet is the only writer of the policy version: :meth:`RolloutFleet.sync_weights` bumps it
and hands the weight source to the configured weight-sync backend (``rollout.weight_sync``, any
entry of ``postrl.weights.WEIGHT_SYNC_BACKENDS``), which delivers it to every replica as that
version; :meth:`~RolloutFleet.rescue` puts a restarted replica in service as a version of its
own when none is live; :meth:`~RolloutFleet.restore_version` sets it from a checkpoint. The
backend is passed in (built by the trainer), so this layer does not import ``weights/``.

Its other verbs change which replicas serve: :meth:`~RolloutFleet.restart_dead` and
:meth:`~RolloutFleet.install_restarted` (through the
:class:`~postrl.rollout.restart.ReplicaRestarter` given by :meth:`~RolloutFleet.enable_restarts`),
:meth:`~RolloutFleet.add_standby` (a replica routed to only while it is not on standby, e.g. the
trainer's idle-switch replica). Replicas are :class:`~postrl.rollout.replica.Replica` objects.
Once restarts are on, :attr:`RolloutFleet.changed` is notified whenever a replica is declared
dead or a replacement finished starting: the trainer waits on it instead of polling the fleet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from postrl.rollout.replica import RemoteReplica, Replica
from postrl.rollout.signal import Signal

__all__ = ["RolloutFleet"]


class RolloutFleet:
    """The replicas of a run plus their weight-sync backend.

    Args:
        replicas: :class:`~postrl.rollout.replica.Replica` objects (in-process, subprocess or
            Ray).
        weight_sync: a weight-sync backend (``sync_weights(source, receivers, version)``
            returning stats with ``metrics()``).
        balancer: the ``LoadBalancer`` routing to ``replicas`` (told when :meth:`install`
            puts a restarted replica in a slot).
        on_close: callables run after :meth:`close` closed the replicas (e.g. releasing their
            placement group).
    """

    def __init__(
        self,
        replicas: list[Replica],
        weight_sync: Any,
        balancer: Any = None,
        on_close: tuple[Callable[[], None], ...] = (),
    ) -> None:
        self.replicas = replicas
        self.weight_sync = weight_sync
        self.balancer = balancer
        self.version = 0
        self.paused = False
        self.restarts = 0
        """Replicas put back by :meth:`install` so far."""
        self.restarter: Any = None
        """The :class:`~postrl.rollout.restart.ReplicaRestarter` (:meth:`enable_restarts`)."""
        self.changed = Signal()
        """Notified (from any thread) when a watched replica is declared dead or a replacement
        finished starting, successfully or not (:meth:`enable_restarts`)."""
        self._on_close = on_close

    @property
    def live(self) -> list[Any]:
        """The replicas not declared dead (a remote replica whose process died is skipped by
        every fleet call)."""
        return [r for r in self.replicas if not r.dead]

    def wake_up(self) -> None:
        """Restore every replica's KV cache (before generation)."""
        for r in self.live:
            r.wake_up()

    def sleep(self) -> None:
        """Release every replica's KV cache (while the actor trains)."""
        for r in self.live:
            r.sleep()

    def pause(self) -> None:
        """Abort every in-flight request and hold new ones (clients resume the interrupted
        requests on the weights loaded before :meth:`resume`: partial rollout)."""
        self.paused = True
        for r in self.live:
            r.pause()

    def resume(self) -> None:
        """Serve again after :meth:`pause`."""
        self.paused = False
        for r in self.live:
            r.resume()

    def sync_weights(self, open_source: Callable[[int], Any]) -> dict[str, float]:
        """Deliver the actor's weights to every replica as the next policy version.

        ``open_source(version)`` opens the weight source (a per-tensor stream, or a
        ``FrameStream`` whose frames carry the version); returns the ``weights/*`` metrics.
        A replica declared dead (``dead``: a remote one whose process died) is skipped; one
        that dies during the push is marked dead and the push starts again for the others.
        """
        from postrl.rollout.types import ReplicaDeadError

        self.version += 1
        while True:
            live = self.live
            if not live:
                raise ReplicaDeadError(-1, "no rollout replica is left to receive the weights")
            try:
                stats = self.weight_sync.sync_weights(
                    open_source(self.version), live, version=self.version
                )
                return stats.metrics()
            except ReplicaDeadError:
                if not any(r.dead for r in live):
                    raise

    def resend(self, open_source: Callable[[int], Any]) -> dict[str, float]:
        """Push the current version again to every live replica (a sync that failed its
        verification, ``trainer/weight_check.py``); the ``weights/*`` metrics."""
        stats = self.weight_sync.sync_weights(
            open_source(self.version), self.live, version=self.version
        )
        return stats.metrics()

    def install(self, slot: int, replica: Replica, open_source: Callable[[int], Any]) -> None:
        """Put ``replica`` (a restart of the dead one in ``slot``) in service: deliver the
        current version's weights to it first (``open_source`` as for :meth:`sync_weights`;
        the source must hold exactly that version's weights, i.e. call this right after a
        push), then route to it. ``ReplicaDeadError`` if it dies during the push (the slot
        stays dead)."""
        if self.version:
            self.weight_sync.sync_weights(
                open_source(self.version), [replica], version=self.version
            )
        self.replicas[slot] = replica
        if self.balancer is not None:
            self.balancer.replace(slot, replica)
        self.restarts += 1
        if self.restarter is not None:
            self._watch(replica)

    # ------------------------------------------------------------------ restarts
    def enable_restarts(self, spawn: Callable[[int], Replica], budget: int) -> None:
        """Start dead replicas again from now on: ``spawn(slot)`` builds a replacement,
        ``budget`` restarts per run (:class:`~postrl.rollout.restart.ReplicaRestarter`)."""
        from postrl.rollout.restart import ReplicaRestarter

        for r in self.replicas:
            self._watch(r)
        self.restarter = ReplicaRestarter(self, spawn, budget)

    def _watch(self, replica: Replica) -> None:
        """Notify :attr:`changed` when ``replica`` is declared dead."""
        if not isinstance(replica, RemoteReplica):
            raise TypeError(
                f"rollout replica {replica.replica_id} ({type(replica).__name__}) is not a "
                "RemoteReplica: only replicas in processes of their own are restarted"
            )
        replica.on_dead(self.changed.notify)

    def restart_dead(self) -> None:
        """Begin a replacement for every dead replica not being replaced (budget permitting;
        ``ReplicaRestartError`` when a failed restart left no budget). No-op without
        :meth:`enable_restarts`."""
        if self.restarter is not None:
            self.restarter.begin()

    def install_restarted(self, open_source: Callable[[int], Any]) -> int:
        """Put every replacement that came up in service with the current version's weights
        (call right after a push); returns how many joined."""
        return 0 if self.restarter is None else self.restarter.install(open_source)

    def rescue(self, open_source: Callable[[int], Any]) -> bool:
        """No replica is live: put a replacement that came up in service at once, with the
        actor's current weights (``open_source``) as a new policy version. Returns whether one
        joined (the version is unchanged when none did)."""
        if self.live or self.restarter is None or not self.restarter.ready():
            return False
        self.version += 1
        if not self.restarter.install(open_source):
            self.version -= 1  # the replacement failed: nothing was pushed
            return False
        return True

    def restore_version(self, version: int) -> None:
        """Set the policy version the next push follows (a resumed checkpoint's)."""
        self.version = int(version)

    def add_standby(self, replica: Replica) -> None:
        """Add a replica on standby: routed to once ``replica.standby`` is cleared (the
        trainer's idle-switch replica); it does not take part in pushes or restarts."""
        replica.standby = True
        if self.balancer is not None:
            self.balancer.add(replica)

    def close(self) -> None:
        """Stop restarting, close every replica (a remote one: its process; an in-process
        one: its backend), then run the ``on_close`` callables."""
        try:
            if self.restarter is not None:
                self.restarter.close()
            for r in self.replicas:
                r.close()
        finally:
            for fn in self._on_close:
                fn()
