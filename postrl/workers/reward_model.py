"""``RewardModelWorker``: a learned reward model scoring finished trajectories."""

from __future__ import annotations

import torch

from postrl.controller import Dispatch, Worker, register
from postrl.engine.fsdp import param_numel
from postrl.engine.reward_model import RewardModel
from postrl.protocol import DataProto
from postrl.workers.common import model_spec, setup

__all__ = ["RewardModelWorker"]


class RewardModelWorker(Worker):
    """A learned reward model (``reward.model``) scoring finished trajectories.

    Each rank scores its share of the rows (``DP_COMPUTE_PROTO``). With dp > 1 and
    ``actor.strategy=fsdp2`` the frozen model is FSDP2-sharded like the reference model (each rank
    keeps 1/dp of it); otherwise every rank holds a full copy. The compute dtype follows
    ``model.compute_dtype`` (fp32 on CPU, bf16 on GPU by default).
    """

    def __init__(self, cfg, total_steps: int = 0) -> None:
        from transformers import AutoTokenizer

        from postrl.engine.model import resolve_dtypes

        self.cfg = cfg
        self.dev, self.group = setup(cfg)
        rcfg = cfg.reward.model
        _, compute = resolve_dtypes(model_spec(cfg.model), self.dev, trainable=False)
        self.rm = RewardModel(rcfg.path, self.dev, compute, rcfg.max_length, rcfg.micro_batch_size)
        if self.group is not None and cfg.actor.strategy == "fsdp2" and self.rm.root is not None:
            self.rm.shard(
                self.group, self.dev
            )  # like the reference model: 1/dp of the weights per rank
        self.policy_tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.register_dp_info("reward_model", dp_rank=self.rank, dp_size=self.world_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shard_stats(self) -> dict[str, int]:
        """Parameter elements on this rank / in the full reward model, FSDP2 dummy passes."""
        root = self.rm.root if self.rm.root is not None else self.rm.model
        return {**param_numel(root), "dummy_passes": getattr(root, "dummy_passes", 0)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B,) float32 and ``rm_truncated`` (B,) bool for rows of ``data``.

        Needs ``responses``, ``attention_mask`` and the prompt chat ``messages`` (non-tensor)."""
        if "messages" not in data.non_tensor_batch:
            raise KeyError(
                "compute_rm_score needs the prompts' chat messages (non_tensor_batch['messages'])"
            )
        R = data.batch["responses"].shape[1]
        valid = data.batch["attention_mask"][:, -R:].bool()
        texts = self.policy_tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(data.batch["responses"], valid, strict=True)],
            skip_special_tokens=True,
        )
        scores, cut = self.rm.score_rows(
            [list(m) for m in data.non_tensor_batch["messages"]], texts
        )
        return DataProto.from_dict(
            {"rm_scores": scores, "rm_truncated": torch.tensor(cut, dtype=torch.bool)}
        )
