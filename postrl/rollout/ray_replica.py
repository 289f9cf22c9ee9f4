"""Ray actor variant of ``RolloutReplica`` (the ``ray`` controller backend).

``RayRolloutReplica.create(backend, model_path, **options)`` starts one actor that owns a
backend; the returned handle has the same surface as ``RolloutReplica`` (``load``,
``policy_version``, async ``generate``, ``abort``, ``pause``/``resume``, ``update_weights``,
``receive_bucket``, ``sleep``/``wake_up``), so ``LoadBalancer`` and ``RolloutClient`` work
unchanged. Weights cross the process boundary as ``postrl.weights`` bucket frames (raw bytes +
JSON header), never as pickled tensors. Ray is imported only when this module is used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from postrl.rollout.types import SamplingParams, TokenOutput, WeightItem

__all__ = ["RayRolloutReplica"]


class _ReplicaActor:
    """Body of the Ray actor: a ``RolloutReplica`` around a freshly created backend."""

    def __init__(self, backend: str, model_path: str, replica_id: int, options: dict) -> None:
        from postrl.rollout.base import create_rollout_backend
        from postrl.rollout.client import RolloutReplica

        self.replica = RolloutReplica(
            create_rollout_backend(backend, model_path, **options), replica_id
        )

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        return await self.replica.generate(prompt_ids, sampling, request_id)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.replica, method)(*args)

    def policy_version(self) -> int:
        return self.replica.policy_version


class RayRolloutReplica:
    """Handle to a replica running in a Ray actor (see module docstring).

    Args:
        actor: the Ray actor handle; use ``create`` to build one.
        timeout_s: deadline of blocking control calls.
    """

    def __init__(self, actor: Any, replica_id: int = 0, timeout_s: float = 600.0) -> None:
        self.actor = actor
        self.replica_id = replica_id
        self.timeout_s = timeout_s
        self.policy_version = 0
        self._inflight = 0

    @classmethod
    def create(
        cls,
        backend: str,
        model_path: str,
        replica_id: int = 0,
        num_cpus: float = 1,
        num_gpus: float = 0,
        **options: Any,
    ) -> RayRolloutReplica:
        """Start the actor (``ray.init`` must have been called)."""
        import ray

        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1024)(
            _ReplicaActor
        )
        return cls(actor_cls.remote(backend, model_path, replica_id, options), replica_id)

    @property
    def load(self) -> int:
        """In-flight requests sent through this handle."""
        return self._inflight

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Run one request in the actor."""
        self._inflight += 1
        try:
            return await self.actor.generate.remote(list(prompt_ids), sampling, request_id)
        finally:
            self._inflight -= 1

    def abort(self, request_id: str) -> None:
        """Abort one request."""
        self._get(self.actor.call.remote("abort", request_id))

    def pause(self) -> None:
        """Abort in-flight requests and hold new ones."""
        self._get(self.actor.call.remote("pause"))

    def resume(self) -> None:
        """Serve again."""
        self._get(self.actor.call.remote("resume"))

    def update_weights(
        self,
        weights: Iterable[WeightItem],
        version: int | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """Stream weights as bucket frames (raw bytes), one bucket in flight at a time."""
        from postrl.weights import encode_frame, pack_buckets

        for bucket in pack_buckets(weights, bucket_bytes, version=version):
            self.receive_bucket(encode_frame(bucket))

    def receive_bucket(self, frame: bytes) -> None:
        """Forward one bucket frame to the actor."""
        self._get(self.actor.call.remote("receive_bucket", frame))
        self.policy_version = self._get(self.actor.policy_version.remote())

    def sleep(self) -> None:
        """Release the backend's KV cache."""
        self._get(self.actor.call.remote("sleep"))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released."""
        self._get(self.actor.call.remote("wake_up", tags))
