"""Pieces shared by the role workers: device/seed setup, FSDP2 sharding, the rank-0-output
dispatch mode."""

from __future__ import annotations

import torch
import torch.distributed as dist

from postrl.controller.dispatch import DispatchMode
from postrl.protocol import DataProto

__all__ = ["ALL_RANKS_RANK0_OUT", "barrier", "metrics_proto", "setup", "shard_if"]


ALL_RANKS_RANK0_OUT = DispatchMode(
    "all_ranks_rank0_out",
    dispatch_fn=lambda ctx, args, kwargs: [(args, kwargs)] * ctx.world_size,
    collect_fn=lambda ctx, outputs: outputs[0],
)
"""Same call on every rank (a collective inside, e.g. gathering FSDP2 shards); rank 0's output."""


def shard_if(strategy: str, model, group, dev) -> None:
    """FSDP2-shard ``model`` (a ``PolicyModel`` or ``CriticModel``) when dp > 1 and
    ``strategy`` is ``fsdp2``."""
    if group is not None and strategy == "fsdp2":
        model.shard(group, dev)


def setup(cfg) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Thread count and seed from ``cfg.trainer``; the device and the dp group (None on dp=1)."""
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    torch.manual_seed(cfg.trainer.seed)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return torch.device(cfg.trainer.device), group


def metrics_proto(m: dict[str, float]) -> DataProto:
    """An empty DataProto carrying ``m`` in ``meta_info['metrics']``."""
    return DataProto(meta_info={"metrics": m})


def barrier(group) -> None:
    """``dist.barrier`` on ``group`` when dp > 1."""
    if group is not None:
        dist.barrier(group)
