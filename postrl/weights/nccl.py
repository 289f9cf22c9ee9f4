"""NCCL weight sync (GPU only): broadcast fixed-size buckets from the trainer rank to rollout ranks.

The trainer (``src_rank``) packs its per-tensor stream into GPU buckets and broadcasts each over
a ``torch.distributed`` NCCL process group that includes the rollout workers; receivers run
``receive(header_stream, receiver)`` with the same headers (sent on the control plane) and unpack
views of their broadcast buffer. Requires CUDA and an initialised NCCL group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from postrl.weights.buckets import Bucket, pack_buckets, unpack_bucket
from postrl.weights.sync import SyncStats, register_weight_sync

__all__ = ["NCCLSync"]


@register_weight_sync("nccl", colocated=False, device="cuda")
class NCCLSync:
    """Bucketed broadcast over NCCL. ``group``: the process group; ``src_rank``: trainer rank."""

    def __init__(self, bucket_bytes: int = 256 << 20, group: Any = None, src_rank: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "weight sync 'nccl' needs CUDA GPUs; use 'bucketed' or 'naive' on CPU"
            )
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "weight sync 'nccl' needs torch.distributed initialised with backend='nccl'"
            )
        self.dist, self.group, self.src = dist, group, src_rank
        self.bucket_bytes = int(bucket_bytes)

    def sync_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        receivers: list[Any],
        version: int | None = None,
    ) -> SyncStats:
        """Sender side: broadcast each bucket's payload (headers travel via ``receivers``'
        ``receive_header`` callables on the control plane) and return stats."""
        stats = SyncStats(version=version or 0)
        for bucket in pack_buckets(weights, self.bucket_bytes, version=version):
            payload = bucket.payload.cuda()
            for r in receivers:
                r.receive_header(bucket.header, payload.numel())
            self.dist.broadcast(payload, src=self.src, group=self.group)
            stats.num_buckets += 1
            stats.num_bytes += payload.numel()
            stats.num_tensors += len(bucket.header["tensors"])
        return stats

    def receive(self, header: dict, nbytes: int, receiver: Any) -> None:
        """Receiver side: join the broadcast of one bucket and load it into ``receiver``."""
        payload = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dist.broadcast(payload, src=self.src, group=self.group)
        receiver.update_weights(unpack_bucket(Bucket(header, payload)))
