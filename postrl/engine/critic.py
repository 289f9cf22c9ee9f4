"""The critic engine: padding-free values and the clipped value-loss update.

``V(s_t)`` is read at the hidden state that predicts response token ``t`` (verl's convention).
Update: ``ppo_epochs`` × mini-batches × micro-batches with the clipped value loss of
``postrl.algos.value.compute_value_loss`` aggregated with the mini-batch's global denominators,
gradients summed over dp ranks (FSDP2 reduce-scatter or the ddp all-reduce, see
:mod:`postrl.engine.optim`), clipped, and a non-finite norm skips the step.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
import torch.distributed as dist

from postrl.algos.value import compute_value_loss
from postrl.engine.microbatch import make_micro_batches, restore_order
from postrl.engine.minibatch import split_mini_batches
from postrl.engine.model import CriticModel
from postrl.engine.optim import (
    allreduce_grads,
    allreduce_sum,
    build_optimizer,
    build_scheduler,
    guarded_step,
)
from postrl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["Critic"]


class Critic:
    """Value-function engine over a :class:`CriticModel`.

    Args:
        model: backbone + value head.
        cfg: ``CriticConfig``.
        rollout_n: responses per prompt (mini-batch = ``ppo_mini_batch_size × rollout_n``).
        device: compute device.
        group: data-parallel process group (None: single process).
        total_steps: optimizer steps of the run (cosine schedule).
    """

    def __init__(
        self,
        model: CriticModel,
        cfg,
        *,
        rollout_n: int = 1,
        device: str | torch.device = "cpu",
        group: dist.ProcessGroup | None = None,
        total_steps: int = 0,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.rollout_n = rollout_n
        self.device = torch.device(device)
        self.group = group
        self.dp_size = dist.get_world_size(group) if group is not None else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, total_steps)
        self.nonfinite_skips = 0

    def _micro(self, data: DataProto) -> list[list[int]]:
        seqlens = data.batch["attention_mask"].sum(1)
        micro = make_micro_batches(
            seqlens,
            use_dynamic_bsz=self.cfg.use_dynamic_bsz,
            max_tokens=self.cfg.ppo_max_token_len_per_gpu,
            micro_batch_size=self.cfg.ppo_micro_batch_size_per_gpu,
        )
        return self.model.align_micro_batches(micro, seqlens)  # FSDP2: same count on every rank

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        # through the module's forward: with FSDP2 it is the root that unshards the value head
        return self.model(mb["input_ids"], mb["attention_mask"], mb["responses"].shape[1])

    def _to_dev(self, data: DataProto, idx: list[int], keys: list[str]) -> dict[str, torch.Tensor]:
        ix = torch.tensor(idx, dtype=torch.long)
        return {k: data.batch[k][ix].to(self.device) for k in keys if k in data.batch}

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R) of the responses (0 on padding)."""
        micro = self._micro(data)
        outs = [
            self._values(
                self._to_dev(data, idx, ["input_ids", "attention_mask", "responses"])
            ).cpu()
            for idx in micro
        ]
        return DataProto.from_dict({"values": restore_order(outs, micro)})

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """One critic update; needs ``values`` (rollout-time), ``returns``, ``response_mask``.

        Returns ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
        ``critic/grad_norm``, ``critic/lr``, ``critic/grad_norm_nonfinite_skips``.
        """
        keys = ["input_ids", "attention_mask", "responses", "response_mask", "values", "returns"]
        size = max(1, self.cfg.ppo_mini_batch_size * self.rollout_n // self.dp_size)
        sums: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.model.train()
        for _ in range(self.cfg.ppo_epochs):
            for mini in split_mini_batches(
                data, size, group=self.group
            ):  # same count on every dp rank
                rm = mini.batch["response_mask"].float()
                counts = allreduce_sum(
                    torch.stack([rm.sum(), (rm.sum(-1) > 0).float().sum()]), self.group
                )
                if not bool(counts[0] > 0):  # no valid token on any rank: no step
                    continue
                den = dict(
                    global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=self.dp_size
                )
                step = {k: torch.zeros(()) for k in ("vf_loss", "vf_clipfrac", "vpred_mean")}
                for idx in self._micro(mini):
                    mb = self._to_dev(mini, idx, keys)
                    mask = mb["response_mask"].float()
                    vpred = self._values(mb)
                    loss, m = compute_value_loss(
                        vpred,
                        mb["returns"],
                        mb["values"],
                        mask,
                        cliprange_value=self.cfg.cliprange_value,
                        loss_agg_mode=self.cfg.loss_agg_mode,
                        **den,
                    )
                    loss.backward()
                    w = mask.sum().cpu() / counts[0].clamp(min=1)
                    step["vf_loss"] += loss.detach().cpu()
                    step["vf_clipfrac"] += m["vf_clipfrac"].cpu() * w
                    step["vpred_mean"] += (vpred.detach() * mask).sum().cpu() / counts[0].clamp(
                        min=1
                    )
                allreduce_grads(self.params, self.group)
                lr = self.optimizer.param_groups[0]["lr"]
                norm, ok = guarded_step(
                    self.params, self.optimizer, self.scheduler, self.cfg.optim.grad_clip
                )
                self.nonfinite_skips += int(not ok)
                for k in sorted(step):
                    sums[k].append(allreduce_sum(step[k], self.group))
                sums["grad_norm"].append(norm.cpu())
                sums["lr"].append(torch.tensor(lr))
        out = {f"critic/{k}": float(torch.stack(v).mean()) for k, v in sums.items()}
        out["critic/grad_norm_nonfinite_skips"] = float(self.nonfinite_skips)
        return out
