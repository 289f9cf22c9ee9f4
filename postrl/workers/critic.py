"""``CriticWorker``: the value function on the single controller (values, clipped value-loss
update, checkpoints)."""

from __future__ import annotations

from pathlib import Path

import torch

from postrl.controller import Dispatch, Worker, register
from postrl.engine.checkpoint import load_engine_checkpoint, save_engine_checkpoint
from postrl.engine.critic import Critic
from postrl.engine.fsdp import param_numel
from postrl.engine.model import load_critic
from postrl.protocol import DataProto
from postrl.workers.common import (
    LendsCores,
    barrier,
    batch_spec,
    metrics_proto,
    model_spec,
    optim_spec,
    setup,
    shard_if,
)

__all__ = ["CriticWorker"]


class CriticWorker(LendsCores, Worker):
    """The value function: values and the clipped value-loss update."""

    def __init__(self, cfg, total_steps: int = 0) -> None:
        self.cfg = cfg
        self.dev, self.group = setup(cfg)
        mspec = model_spec(cfg.model, path=cfg.critic.model_path or cfg.model.path)
        self.model = load_critic(mspec, self.dev)
        shard_if(cfg.critic.strategy, self.model, self.group, self.dev)
        self.critic = Critic(
            self.model,
            batch=batch_spec(cfg.critic),
            optim=optim_spec(cfg.critic.optim),
            cliprange_value=cfg.critic.cliprange_value,
            loss_agg_mode=cfg.critic.loss_agg_mode,
            rollout_n=cfg.train_group_size,
            device=self.dev,
            group=self.group,
            total_steps=total_steps,
        )
        self.register_dp_info("critic", dp_rank=self.rank, dp_size=self.world_size)

    def _lending_model(self) -> torch.nn.Module:
        return self.model

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R)."""
        with self._compute():
            return self.critic.compute_values(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One critic update; metrics in ``meta_info['metrics']``."""
        lent: dict[str, float] = {}
        with self._compute(lent, "critic/cores_borrowed_s"):
            metrics = self.critic.update_critic(data)
        return metrics_proto({**metrics, **lent})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shard_stats(self) -> dict[str, int]:
        """Parameter elements on this rank / in the full model, FSDP2 dummy passes (see
        ActorWorker)."""
        return {**param_numel(self.model), "dummy_passes": self.model.dummy_passes}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Rank 0 writes the critic checkpoint atomically (every rank gathers when sharded)."""
        save_engine_checkpoint(
            path,
            self.model,
            self.critic.loop.optimizer,
            self.critic.loop.scheduler,
            write=self.rank == 0,
            sharded=self.cfg.trainer.checkpoint_format == "sharded",
            extra={"nonfinite_skips": self.critic.loop.nonfinite_skips},
        )
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
        barrier(self.group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the critic from ``path``."""
        extra = load_engine_checkpoint(
            path, self.model, self.critic.loop.optimizer, self.critic.loop.scheduler
        )
        self.critic.loop.nonfinite_skips = int(extra.get("nonfinite_skips", 0))
