"""The one update loop shared by the actor and the critic.

    for epoch in range(epochs):
        for mini-batch (``mini_batches(data, epoch)``: the same count on every dp rank):
            N_tok, N_seq = Σ_ranks valid tokens / non-empty rows of the mini-batch
                           (one all-reduce, with the same two counts over the rows to train:
                           all, or ``trained_rows(mini)``, e.g. without zero-advantage rows)
            if N_tok == 0: skip (nothing to learn on any rank, no optimizer step)
            for micro-batch (``micro_batches(mini[, rows])``, token budget, Karmarkar–Karp
                             balanced):
                out = micro_loss(mb, denominators)     # the varying part: policy or value loss
                out.loss.backward()                    # an additive share of the mini-batch loss
            all-reduce(SUM) grads; clip; step unless the norm is non-finite (counted)

Metrics: a micro-batch reports ``sums`` (values already normalised by the global denominators,
so they add up to the mini-batch value) and ``means`` (per-micro-batch averages, weighted by the
micro-batch's share of the mini-batch's trained tokens); both are summed over dp ranks, then
averaged over mini-batches and epochs. ``grad_norm`` and ``lr`` are added per optimizer step.

Engine-owned settings (:class:`~postrl.engine.specs.BatchSpec`,
:class:`~postrl.engine.specs.OptimSpec`) are plain dataclasses in :mod:`postrl.engine.specs`: the
role workers (:mod:`postrl.workers`) fill them from the run's config.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from postrl.engine.optim import (
    allreduce_grads,
    allreduce_sum,
    build_optimizer,
    build_scheduler,
    guarded_step,
)
from postrl.engine.specs import BatchSpec, OptimSpec
from postrl.protocol import DataProto

__all__ = ["BatchSpec", "MicroLoss", "UpdateLoop", "rows_to_device"]


@dataclass
class MicroLoss:
    """What a micro-batch's loss function returns to :class:`UpdateLoop`."""

    loss: torch.Tensor
    """Scalar to backpropagate: this micro-batch's additive share of the mini-batch loss."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Metrics that are additive shares already (normalised by the global denominators)."""
    means: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-micro-batch means, weighted by the micro-batch's share of the mini-batch's tokens."""


def rows_to_device(
    data: DataProto, idx: list[int], keys: Iterable[str], device: torch.device
) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of the tensors ``keys`` of ``data`` (those present) on ``device``."""
    ix = torch.tensor(idx, dtype=torch.long)
    return {k: data.batch[k][ix].to(device) for k in keys if k in data.batch}


def _masked_first_row(mini: DataProto) -> DataProto:
    """``mini`` with its first row's ``response_mask`` all zero (a row that trains nothing)."""
    b = dict(mini.batch)
    b["response_mask"] = b["response_mask"].clone()
    b["response_mask"][0] = 0
    return DataProto(b, mini.non_tensor_batch, mini.meta_info)


class UpdateLoop:
    """Optimizer, schedule and the epochs × mini-batches × micro-batches loop of one engine.

    Args:
        params: the trainable parameters.
        optim: optimizer and schedule settings.
        total_steps: optimizer steps of the run (cosine schedule).
        group: data-parallel process group (None: single process).
        device: where micro-batches are moved.

    Attributes ``optimizer`` and ``scheduler`` may be replaced (tests swap in SGD);
    ``nonfinite_skips`` counts the steps skipped for a non-finite gradient norm (checkpointed).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optim: OptimSpec,
        *,
        total_steps: int = 0,
        group: dist.ProcessGroup | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = build_optimizer(self.params, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        self.grad_clip = optim.grad_clip
        self.group = group
        self.dp_size = dist.get_world_size(group) if group is not None else 1
        self.device = torch.device(device)
        self.nonfinite_skips = 0

    def run(
        self,
        data: DataProto,
        *,
        epochs: int,
        mini_batches: Callable[[DataProto, int], list[DataProto]],
        micro_batches: Callable[[DataProto], list[list[int]]],
        keys: list[str],
        micro_loss: Callable[[dict[str, torch.Tensor], dict], MicroLoss],
        prefix: str,
        trained_rows: Callable[[DataProto], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One update over ``data`` (this rank's shard); returns ``{prefix}/<name>`` metrics.

        Args:
            data: needs ``response_mask`` and whatever ``micro_loss`` reads.
            epochs: passes over ``data``.
            mini_batches: ``(data, epoch) -> mini-batches`` (the same count on every rank).
            micro_batches: ``mini -> row indices per micro-batch`` (the same count on every
                rank); with ``trained_rows``, ``(mini, rows) ->`` those of ``rows`` only.
            keys: tensors moved to the device for each micro-batch.
            micro_loss: ``(micro-batch tensors, denominators) -> MicroLoss``; the denominators
                are ``global_num_tokens``, ``global_num_seqs`` and ``dp_size`` (keyword arguments
                of :func:`postrl.algos.aggregation.agg_loss`) over the whole mini-batch.
            prefix: metric namespace (``actor``, ``critic``).
            trained_rows: ``mini -> row indices`` to run (rows that cannot move the loss, e.g.
                the actor's zero-advantage rows, left out): the denominators still count every
                row, and ``denominators["trained"]`` holds the same three over these rows (for
                a term that averages over the trained rows only). ``means`` are weighted by the
                trained tokens.
        """
        sums: dict[str, list[torch.Tensor]] = defaultdict(list)
        for epoch in range(epochs):
            for mini in mini_batches(data, epoch):
                rm = mini.batch["response_mask"].float()
                rows = trained_rows(mini) if trained_rows is not None else None
                rt = rm if rows is None else rm[rows]
                both = allreduce_sum(  # the mini-batch's and its trained rows' counts
                    torch.stack(
                        [
                            rm.sum(),
                            (rm.sum(-1) > 0).float().sum(),
                            rt.sum(),
                            (rt.sum(-1) > 0).float().sum(),
                        ]
                    ),
                    self.group,
                )
                counts, trained = both[:2], both[2:]
                if not bool(counts[0] > 0):  # no valid token on any rank: nothing to learn
                    continue
                if rows is not None and len(rows) == 0 and len(mini) > 0:
                    # nothing to train on this rank: one row, its mask zeroed (it adds exactly
                    # 0), keeps its passes and its metrics' all-reduces in step with the ranks'
                    mini, rows = _masked_first_row(mini), torch.zeros(1, dtype=torch.long)
                # (after the counts: aligning FSDP2 ranks may run dummy passes now, whose
                # collectives must meet the other ranks' passes, not another all-reduce)
                micro = micro_batches(mini) if rows is None else micro_batches(mini, rows)
                denoms: dict = dict(
                    global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=self.dp_size
                )
                if trained_rows is not None:
                    denoms["trained"] = dict(
                        global_num_tokens=trained[0],
                        global_num_seqs=trained[1],
                        dp_size=self.dp_size,
                    )
                step: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
                for idx in micro:
                    mb = rows_to_device(mini, idx, keys, self.device)
                    out = micro_loss(mb, denoms)
                    out.loss.backward()
                    # token share of the mini-batch's trained tokens
                    w = mb["response_mask"].sum().float().cpu() / trained[0].clamp(min=1)
                    for k, v in out.sums.items():
                        step[k] = step[k] + v.cpu()
                    for k, v in out.means.items():
                        step[k] = step[k] + v.cpu() * w
                if not micro:  # no row of this rank trains: a step on zero gradients, as when
                    for p in self.params:  # its rows' loss was computed and was 0
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                allreduce_grads(self.params, self.group)
                lr = self.optimizer.param_groups[0]["lr"]
                norm, ok = guarded_step(self.params, self.optimizer, self.scheduler, self.grad_clip)
                self.nonfinite_skips += int(not ok)
                for k in sorted(step):  # every value is an additive share: sum over ranks
                    sums[k].append(allreduce_sum(step[k], self.group))
                sums["grad_norm"].append(norm.cpu())
                sums["lr"].append(torch.tensor(lr))
        out = {f"{prefix}/{k}": float(torch.stack(v).mean()) for k, v in sums.items()}
        out[f"{prefix}/grad_norm_nonfinite_skips"] = float(self.nonfinite_skips)
        return out
