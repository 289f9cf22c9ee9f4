"""The critic engine: padding-free values and the clipped value-loss update.

``V(s_t)`` is read at the hidden state that predicts response token ``t`` (verl's convention).
Update: the shared :class:`~postrl.engine.update.UpdateLoop` (``ppo_epochs`` × mini-batches ×
micro-batches, global denominators, gradients summed over dp ranks, clipped, a non-finite norm
skips the step) with the clipped value loss of ``postrl.algos.value.compute_value_loss`` as its
micro-batch loss.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from postrl.algos.value import compute_value_loss
from postrl.engine.microbatch import make_micro_batches, restore_order
from postrl.engine.minibatch import split_mini_batches
from postrl.engine.model import CriticModel
from postrl.engine.specs import BatchSpec, OptimSpec
from postrl.engine.update import MicroLoss, UpdateLoop, rows_to_device
from postrl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["Critic"]

_KEYS = ["input_ids", "attention_mask", "responses", "response_mask", "values", "returns"]


class Critic:
    """Value-function engine over a :class:`CriticModel`.

    Args:
        model: backbone + value head.
        batch: mini/micro-batching and epochs.
        optim: AdamW and schedule.
        cliprange_value: value clipping range around the rollout-time values.
        loss_agg_mode: aggregation of the token losses.
        rollout_n: responses per prompt (mini-batch = ``ppo_mini_batch_size × rollout_n``).
        device: compute device.
        group: data-parallel process group (None: single process).
        total_steps: optimizer steps of the run (cosine schedule).
    """

    def __init__(
        self,
        model: CriticModel,
        *,
        batch: BatchSpec,
        optim: OptimSpec,
        cliprange_value: float = 0.5,
        loss_agg_mode: str = "token-mean",
        rollout_n: int = 1,
        device: str | torch.device = "cpu",
        group: dist.ProcessGroup | None = None,
        total_steps: int = 0,
    ) -> None:
        self.model = model
        self.batch = batch
        self.cliprange_value = cliprange_value
        self.loss_agg_mode = loss_agg_mode
        self.rollout_n = rollout_n
        self.device = torch.device(device)
        self.group = group
        self.loop = UpdateLoop(
            model.parameters(), optim, total_steps=total_steps, group=group, device=device
        )

    def _micro(self, data: DataProto) -> list[list[int]]:
        seqlens = data.batch["attention_mask"].sum(1)
        micro = make_micro_batches(
            seqlens,
            use_dynamic_bsz=self.batch.use_dynamic_bsz,
            max_tokens=self.batch.ppo_max_token_len_per_gpu,
            micro_batch_size=self.batch.ppo_micro_batch_size_per_gpu,
        )
        return self.model.align_micro_batches(micro, seqlens)  # FSDP2: same count on every rank

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        # through the module's forward: with FSDP2 it is the root that unshards the value head
        return self.model(mb["input_ids"], mb["attention_mask"], mb["responses"].shape[1])

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R) of the responses (0 on padding)."""
        micro = self._micro(data)
        keys = ["input_ids", "attention_mask", "responses"]
        outs = [self._values(rows_to_device(data, idx, keys, self.device)).cpu() for idx in micro]
        return DataProto.from_dict({"values": restore_order(outs, micro)})

    def _mini_batches(self, data: DataProto, epoch: int) -> list[DataProto]:
        size = max(1, self.batch.ppo_mini_batch_size * self.rollout_n // self.loop.dp_size)
        return split_mini_batches(data, size, group=self.group)  # same count on every dp rank

    def _micro_loss(self, mb: dict[str, torch.Tensor], denoms: dict) -> MicroLoss:
        mask = mb["response_mask"].float()
        vpred = self._values(mb)
        loss, m = compute_value_loss(
            vpred,
            mb["returns"],
            mb["values"],
            mask,
            cliprange_value=self.cliprange_value,
            loss_agg_mode=self.loss_agg_mode,
            **denoms,
        )
        n_tok = denoms["global_num_tokens"].clamp(min=1)
        vpred_share = (vpred.detach() * mask).sum().cpu() / n_tok
        return MicroLoss(
            loss,
            sums={"vf_loss": loss.detach(), "vpred_mean": vpred_share},
            means={"vf_clipfrac": m["vf_clipfrac"]},
        )

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """One critic update; needs ``values`` (rollout-time), ``returns``, ``response_mask``.

        Returns ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
        ``critic/grad_norm``, ``critic/lr``, ``critic/grad_norm_nonfinite_skips``.
        """
        self.model.train()
        return self.loop.run(
            data,
            epochs=self.batch.ppo_epochs,
            mini_batches=self._mini_batches,
            micro_batches=self._micro,
            keys=_KEYS,
            micro_loss=self._micro_loss,
            prefix="critic",
        )
