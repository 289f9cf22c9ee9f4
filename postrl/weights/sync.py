"""Weight-sync backends ("checkpoint engine"): move an actor's per-tensor parameter stream into
rollout engines.

- ``naive``: in-process (colocated). The engine consumes the actor's tensors directly — no
  intermediate copy; the engine copies each tensor once into its own layout.
- ``bucketed``: the stream is packed into fixed-size byte buckets (``buckets.pack_buckets``),
  handed to a transport (in-process by default; a Ray actor call or an HTTP POST for remote
  replicas), and unpacked on the receiving side. Everything is lazy, so peak memory is bounded
  by the bucket size, not the model size.
- ``nccl``: GPU broadcast of buckets over a torch.distributed NCCL group (lazy; GPU only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from postrl.registry import Registry
from postrl.weights.buckets import Bucket, pack_buckets, unpack_bucket

__all__ = [
    "WEIGHT_SYNC_BACKENDS",
    "register_weight_sync",
    "create_weight_sync",
    "WeightReceiver",
    "WeightSync",
    "SyncStats",
    "NaiveSync",
    "BucketedSync",
]

WEIGHT_SYNC_BACKENDS: Registry[Any] = Registry("weight-sync backend")


def register_weight_sync(name: str, **meta: Any):
    """Class decorator registering a weight-sync backend (constructor ``cls(**options)``)."""
    return WEIGHT_SYNC_BACKENDS.register(name, override=name == "nccl", **meta)


def create_weight_sync(name: str, **options: Any) -> WeightSync:
    """Instantiate the weight-sync backend registered as ``name``."""
    return WEIGHT_SYNC_BACKENDS.get(name)(**options)


@runtime_checkable
class WeightReceiver(Protocol):
    """Anything that accepts a per-tensor stream (every rollout backend and replica)."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors."""
        ...


@dataclass
class SyncStats:
    """What one sync moved."""

    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    max_bucket_bytes: int = 0
    seconds: float = 0.0


class WeightSync(Protocol):
    """Push a per-tensor stream into receivers."""

    def sync(
        self, weights: Iterable[tuple[str, torch.Tensor]], receivers: list[WeightReceiver]
    ) -> SyncStats:
        """Deliver every tensor of ``weights`` to every receiver."""
        ...


def _counted(
    weights: Iterable[tuple[str, torch.Tensor]], stats: SyncStats
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        stats.num_tensors += 1
        stats.num_bytes += t.numel() * t.element_size()
        yield name, t


@register_weight_sync("naive", colocated=True)
class NaiveSync:
    """In-process sync: each receiver reads the actor's tensors directly (one receiver streams;
    with several receivers the stream is materialised once as a list of references, no copies)."""

    def sync(
        self, weights: Iterable[tuple[str, torch.Tensor]], receivers: list[WeightReceiver]
    ) -> SyncStats:
        """See ``WeightSync.sync``."""
        stats, t0 = SyncStats(), time.perf_counter()
        stream = _counted(weights, stats)
        if len(receivers) == 1:
            receivers[0].update_weights(stream)
        else:
            items = list(stream)
            for r in receivers:
                r.update_weights(iter(items))
        stats.seconds = time.perf_counter() - t0
        return stats


@register_weight_sync("bucketed", colocated=False)
class BucketedSync:
    """Stream buckets of ``bucket_bytes`` through ``transport`` (default: in-process unpack).

    Args:
        bucket_bytes: payload size per bucket.
        transport: ``transport(bucket, receiver)`` delivers one bucket; default unpacks in
            process. Remote replicas pass e.g. ``RolloutReplica.receive_bucket``-style callables
            that send ``encode_frame(bucket)``.
    """

    def __init__(
        self, bucket_bytes: int = 64 << 20, transport: Callable[[Bucket, Any], None] | None = None
    ) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.transport = transport

    def sync(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        receivers: list[WeightReceiver],
        version: int | None = None,
    ) -> SyncStats:
        """See ``WeightSync.sync``; buckets are produced lazily and each is delivered to every
        receiver before the next is packed."""
        stats, t0 = SyncStats(), time.perf_counter()
        for bucket in pack_buckets(_counted(weights, stats), self.bucket_bytes, version=version):
            stats.num_buckets += 1
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, bucket.nbytes)
            for r in receivers:
                if self.transport is None:
                    r.update_weights(unpack_bucket(bucket))
                else:
                    self.transport(bucket, r)
        stats.seconds = time.perf_counter() - t0
        return stats


WEIGHT_SYNC_BACKENDS.add_lazy(
    "nccl", "postrl.weights.nccl:NCCLSync", colocated=False, device="cuda"
)
