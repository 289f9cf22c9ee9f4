"""``RolloutFleet``: every rollout replica of a run, driven together (wake, sleep, weights).

The fleet owns the policy version: each :meth:`RolloutFleet.sync_weights` bumps it and hands the
weight source to the configured weight-sync backend (``rollout.weight_sync``, any entry of
``postrl.weights.WEIGHT_SYNC_BACKENDS``), which delivers it to every replica as that version.
The backend is passed in (built by the trainer), so this layer does not import ``weights/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["RolloutFleet"]


class RolloutFleet:
    """The replicas of a run plus their weight-sync backend.

    Args:
        replicas: :class:`~postrl.rollout.client.RolloutReplica` (or Ray replica) objects.
        weight_sync: a weight-sync backend (``sync_weights(source, receivers, version)``
            returning stats with ``metrics()``).
        balancer: the ``LoadBalancer`` routing to ``replicas`` (told when :meth:`install`
            puts a restarted replica in a slot).
        on_close: callables run after :meth:`close` closed the replicas (e.g. releasing their
            placement group).
    """

    def __init__(
        self,
        replicas: list[Any],
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
        self._on_close = on_close

    @property
    def live(self) -> list[Any]:
        """The replicas not declared dead (a remote replica whose process died is skipped by
        every fleet call)."""
        return [r for r in self.replicas if not getattr(r, "dead", False)]

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
                if not any(getattr(r, "dead", False) for r in live):
                    raise

    def install(self, slot: int, replica: Any, open_source: Callable[[int], Any]) -> None:
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

    def close(self) -> None:
        """Close every replica (a remote one: its process) or its backend (idempotent for
        backends that allow it), then run the ``on_close`` callables."""
        try:
            for r in self.replicas:
                if hasattr(r, "close"):
                    r.close()
                elif hasattr(r.backend, "close"):
                    r.backend.close()
        finally:
            for fn in self._on_close:
                fn()
