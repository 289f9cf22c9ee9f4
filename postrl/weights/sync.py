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
from postrl.weights.buckets import Bucket, decode_frame, pack_buckets, unpack_bucket

__all__ = [
    "WEIGHT_SYNC_BACKENDS",
    "register_weight_sync",
    "create_weight_sync",
    "WeightReceiver",
    "WeightSync",
    "WeightSource",
    "FrameStream",
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

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load HF-named tensors; ``version`` is the policy version they make (None: + 1)."""
        ...


class FrameStream:
    """A weight source that arrives as encoded bucket frames, pulled one at a time.

    The actor lives in other processes (Ray): ``frames`` yields one raw-byte frame (JSON header +
    tensor bytes, never pickled) per call to the remote actor, so only one bucket is in flight.
    Backends that deliver buckets forward the frames as they are; the others unpack them lazily.
    """

    def __init__(self, frames: Iterable[bytes]) -> None:
        self.frames = iter(frames)

    @classmethod
    def from_actor(
        cls, actor: Any, bucket_bytes: int = 64 << 20, version: int | None = None
    ) -> FrameStream:
        """Frames pulled from an actor worker group (``open_weight_stream`` once, then one
        ``next_weight_frame`` call per bucket until it returns None)."""
        actor.open_weight_stream(bucket_bytes, version)

        def pull() -> Iterator[bytes]:
            while (frame := actor.next_weight_frame()) is not None:
                yield frame

        return cls(pull())

    def tensors(self, stats: SyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The frames' tensors, decoded lazily (one bucket in memory at a time)."""
        for frame in self.frames:
            bucket = decode_frame(frame)
            if stats is not None:
                _count_bucket(stats, bucket)
            yield from unpack_bucket(bucket)


WeightSource = Iterable[tuple[str, torch.Tensor]] | FrameStream
"""What a sync reads: the actor's in-process per-tensor stream, or a :class:`FrameStream`."""


@dataclass
class SyncStats:
    """What one sync moved; :meth:`metrics` gives them as ``weights/*`` metrics."""

    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    max_bucket_bytes: int = 0
    seconds: float = 0.0
    version: int = 0

    def metrics(self) -> dict[str, float]:
        """``weights/{tensors,bytes,buckets,max_bucket_bytes,version}`` (the wall time is the
        step's ``timing_s/sync_weights``)."""
        return {
            "weights/tensors": float(self.num_tensors),
            "weights/bytes": float(self.num_bytes),
            "weights/buckets": float(self.num_buckets),
            "weights/max_bucket_bytes": float(self.max_bucket_bytes),
            "weights/version": float(self.version),
        }


class WeightSync(Protocol):
    """Push a weight source into receivers (rollout replicas)."""

    def sync_weights(
        self, source: WeightSource, receivers: list[Any], version: int | None = None
    ) -> SyncStats:
        """Deliver every tensor of ``source`` to every receiver, as policy ``version``."""
        ...


def _counted(
    weights: Iterable[tuple[str, torch.Tensor]], stats: SyncStats
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        stats.num_tensors += 1
        stats.num_bytes += t.numel() * t.element_size()
        yield name, t


def _count_bucket(stats: SyncStats, bucket: Bucket) -> None:
    stats.num_buckets += 1
    stats.num_tensors += len(bucket.header.get("tensors", ()))
    stats.num_bytes += bucket.nbytes
    stats.max_bucket_bytes = max(stats.max_bucket_bytes, bucket.nbytes)


@register_weight_sync("naive", colocated=True)
class NaiveSync:
    """In-process sync: each receiver reads the actor's tensors directly (one receiver streams;
    with several receivers the stream is materialised once as a list of references, no copies).
    A :class:`FrameStream` source is unpacked lazily, bucket by bucket."""

    def sync_weights(
        self, source: WeightSource, receivers: list[Any], version: int | None = None
    ) -> SyncStats:
        """See ``WeightSync.sync_weights``."""
        stats, t0 = SyncStats(version=version or 0), time.perf_counter()
        if isinstance(source, FrameStream):
            stream: Iterable[tuple[str, torch.Tensor]] = source.tensors(stats)
        else:
            stream = _counted(source, stats)
        if len(receivers) == 1:
            receivers[0].update_weights(stream, version=version)
        else:
            items = list(stream)
            for r in receivers:
                r.update_weights(iter(items), version=version)
        stats.seconds = time.perf_counter() - t0
        return stats


@register_weight_sync("bucketed", colocated=False)
class BucketedSync:
    """Stream buckets of ``bucket_bytes`` through ``transport`` (default: in-process unpack).

    A :class:`FrameStream` source is already bucketed by the actor: each frame is forwarded to
    every receiver as it arrives (``receive_bucket`` where the receiver has it), never re-packed.

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

    def sync_weights(
        self, source: WeightSource, receivers: list[Any], version: int | None = None
    ) -> SyncStats:
        """See ``WeightSync.sync_weights``; each bucket is delivered to every receiver before
        the next is produced."""
        stats, t0 = SyncStats(version=version or 0), time.perf_counter()
        if isinstance(source, FrameStream):
            for frame in source.frames:
                bucket = decode_frame(frame)
                _count_bucket(stats, bucket)
                for r in receivers:
                    if hasattr(r, "receive_bucket"):
                        r.receive_bucket(frame)
                    else:
                        r.update_weights(unpack_bucket(bucket), version=version)
        else:
            for bucket in pack_buckets(source, self.bucket_bytes, version=version):
                _count_bucket(stats, bucket)
                for r in receivers:
                    if self.transport is not None:
                        self.transport(bucket, r)
                    else:
                        r.update_weights(unpack_bucket(bucket), version=version)
        stats.seconds = time.perf_counter() - t0
        return stats


WEIGHT_SYNC_BACKENDS.add_lazy(
    "nccl", "postrl.weights.nccl:NCCLSync", colocated=False, device="cuda"
)
