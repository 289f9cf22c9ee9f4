"""Optimizer, LR schedule, gradient synchronisation and the guarded optimizer step.

Schedule (:class:`OptimSpec`): linear warmup ``lr · (s+1)/W`` for the first ``W`` optimizer steps,
then ``constant`` or ``cosine``: ``lr · (m + (1 − m) · ½(1 + cos(π · p)))`` with ``m`` =
``min_lr_ratio`` and ``p`` the post-warmup progress in [0, 1] over ``total_steps − W`` steps.

Data parallelism (``actor.strategy`` / ``critic.strategy``, see docs/engine.md):

* ``fsdp2`` — parameters, gradients and AdamW state are dim-0 shards (``DTensor``) of an FSDP2
  module (:mod:`postrl.engine.fsdp`); FSDP2 reduce-scatters each gradient with a SUM during
  backward, so :func:`allreduce_grads` leaves those parameters alone. ``clip_grad_norm_`` computes
  the global norm over the shards (one all-reduce) and returns it as a ``DTensor``;
  :func:`guarded_step` materialises it so every rank sees the same value and skips a non-finite
  step together. AdamW updates each rank's shard.
* ``ddp`` — every rank holds the full model; after gradient accumulation :func:`allreduce_grads`
  SUMS the gradients over the process group in one flat bucket (DDP semantics without
  compute/communication overlap).

Either way the reduction is a SUM: every micro-batch loss is already an additive share of the
global loss (global denominators, see ``postrl.algos.aggregation``), so the summed gradient is
exactly the gradient of the whole mini-batch — no ``× dp_size`` correction is needed (a mean
reduction, DDP's and FSDP2's default, would need one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from postrl.engine.specs import OptimSpec

__all__ = [
    "OptimSpec",
    "build_optimizer",
    "build_scheduler",
    "allreduce_grads",
    "allreduce_sum",
    "guarded_step",
]


def build_optimizer(params: Iterable[nn.Parameter], spec: OptimSpec) -> torch.optim.AdamW:
    """AdamW from an :class:`OptimSpec` (lr, betas, eps, weight_decay).

    Plain floating-point tensors use the fused kernel (one op for all parameters: ~9× faster
    than the per-parameter loop on a 2.4M-parameter model on CPU); sharded (DTensor) parameters
    use the multi-tensor ``foreach`` path.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (all requires_grad=False)")
    betas = tuple(float(b) for b in spec.betas)
    if len(betas) != 2:
        raise ValueError(f"optim.betas must have two values, got {spec.betas}")
    plain = all(type(p) is nn.Parameter and p.is_floating_point() for p in params)
    impl = {"fused": True} if plain else {"foreach": True}
    return torch.optim.AdamW(
        params,
        lr=spec.lr,
        betas=betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        **impl,
    )


def build_scheduler(
    opt: torch.optim.Optimizer, spec: OptimSpec, total_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + constant/cosine ``LambdaLR``; cosine needs ``total_steps`` > warmup."""
    warm = int(spec.warmup_steps)
    kind = spec.lr_scheduler
    floor = float(spec.min_lr_ratio)
    if kind not in ("constant", "cosine"):
        raise ValueError(f"optim.lr_scheduler={kind!r}; use 'constant' or 'cosine'")
    if kind == "cosine" and total_steps <= warm:
        raise ValueError(
            f"optim.lr_scheduler='cosine' needs the total optimizer steps "
            f"(> warmup_steps={warm}), got {total_steps}; "
            "set trainer.total_steps or use lr_scheduler=constant"
        )

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        prog = min(1.0, (step - warm) / max(1, total_steps - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * prog))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum gradients over ``group`` in one flat bucket (no-op without a group).

    FSDP2-sharded parameters (``DTensor``) are skipped: their gradients were already
    reduce-scattered (summed) by FSDP2 during backward.
    """
    params = [p for p in params if not isinstance(p, DTensor)]
    if group is None or dist.get_world_size(group) == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    off = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[off : off + n].view_as(p).clone()
        off += n


def allreduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum a tensor over ``group`` (returns ``t`` without a group)."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def guarded_step(
    params: list[nn.Parameter],
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
) -> tuple[torch.Tensor, bool]:
    """Clip the global grad norm and step, unless the norm is non-finite (then skip).

    With FSDP2 the norm is computed over the gradient shards of all ranks, so every rank takes
    (or skips) the step alike.

    Returns:
        (grad norm before clipping, whether the step was taken). A skipped step zeroes the
        gradients and advances neither optimizer nor scheduler.
    """
    clip = grad_clip if grad_clip and grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, clip, error_if_nonfinite=False)
    if isinstance(norm, DTensor):  # sharded grads: the global norm, identical on every rank
        norm = norm.full_tensor()
    ok = bool(torch.isfinite(norm))
    if ok:
        opt.step()
        sched.step()
    opt.zero_grad(set_to_none=True)
    return norm.detach(), ok
