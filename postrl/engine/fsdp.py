"""FSDP2 sharding of the training modules over the data-parallel process group.

``actor.strategy`` / ``critic.strategy`` select how dp > 1 ranks (Ray backend, ``init_dist``)
share the model:

* ``fsdp2`` (default): :func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to
  every decoder layer (the classes HF lists in ``_no_split_modules``) and then to a *root*
  module, over a one-dimensional ``DeviceMesh`` built from the dp group (gloo on CPU, nccl on
  GPU). Each rank keeps a dim-0 shard (``1/dp``) of every parameter, gradient and AdamW moment;
  a unit's parameters are all-gathered just before its forward and again in backward, and its
  gradients are reduce-scattered after backward.
* ``ddp``: every rank keeps a full replica and :func:`postrl.engine.optim.allreduce_grads` sums
  the gradients after accumulation.

**SUM, not mean.** Every micro-batch loss is already an additive share of the mini-batch loss
(global token/sequence denominators, ``postrl.algos.aggregation``), so the gradient of the
mini-batch is the *sum* of the ranks' gradients. FSDP2 divides by the dp size by default;
:func:`shard_model` sets ``set_gradient_divide_factor(1.0)`` on every unit, and
``set_force_sum_reduction_for_comms(True)`` so the collective is a plain ``ReduceOp.SUM`` (with
factor 1.0 FSDP2 would otherwise pick ``PREMUL_SUM``, which gloo does not implement).

**Why a root module that computes the whole log-prob.** The padding-free path calls the decoder
submodule and then reads ``lm_head.weight`` directly
(:func:`postrl.engine.logprob.chunked_token_logprobs`
projects chunk by chunk and recomputes each chunk in backward) — the causal LM's own forward
never runs. FSDP2 unshards a unit in the forward pre-hook of the module it was applied to, so
the parameters outside the decoder layers (embeddings, final norm, LM head — tied or not; the
value head of a critic) must belong to a module whose forward encloses *all* their uses. The
root is therefore the module whose ``forward`` is the whole computation
(:class:`postrl.engine.model.PolicyLogProbs`, :class:`postrl.engine.model.CriticModel`):

* forward: the root pre-hook all-gathers embeddings/norm/head before the decoder runs; every use
  of ``head.weight`` (every chunk) happens inside that forward;
* backward: the root's pre-backward hook (registered on its outputs) all-gathers the root unit
  again before the head's gradient is computed — including the chunk recomputation of the
  checkpointed head, which reuses the same unsharded parameter tensors — and the root's
  post-backward (FSDP2's final callback) reduce-scatters the head/embedding gradients (tied
  weights accumulate both uses into one gradient first).

The root is created with ``reshard_after_forward=True`` (FSDP2's default keeps the root unsharded
after forward), so between calls every parameter is a sharded ``DTensor``: weight streaming and
checkpoints always see the same state, and ``no_grad`` log-prob passes do not leave full copies
of the embeddings behind.

**Same number of passes on every rank.** Each forward/backward of a sharded module issues
collectives, so all ranks must run the same number of micro-batch passes. Token-budget
micro-batching gives ranks different counts; :func:`align_micro_batches` agrees on the maximum
(all-reduce MAX) and splits the largest micro-batches until every rank has it. A rank with fewer
rows than that (a mini-batch whose rows were all masked) runs the missing passes as zero-weight
dummy passes on a 2-token input (loss × 0: no contribution to any gradient).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from postrl.protocol.balance import karmarkar_karp

logger = logging.getLogger(__name__)

__all__ = [
    "STRATEGIES",
    "dp_mesh",
    "transformer_layers",
    "shard_model",
    "is_sharded",
    "full_tensor",
    "shard_like",
    "param_numel",
    "align_micro_batches",
]

STRATEGIES = ("fsdp2", "ddp")
"""Values of ``actor.strategy`` / ``critic.strategy``."""


def dp_mesh(group: dist.ProcessGroup, device: torch.device | str) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over ``group`` on ``device``'s type (``cpu`` → gloo, ``cuda`` →
    nccl)."""
    return DeviceMesh.from_group(group, torch.device(device).type)


def transformer_layers(module: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF model: modules whose class is in some ``_no_split_modules``.

    Raises:
        ValueError: when the model declares no such classes (then per-layer sharding is unknown).
    """
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(module).__name__} declares no decoder-layer classes "
            f"(_no_split_modules={sorted(names)}); "
            "FSDP2 needs them to shard layer by layer: use strategy=ddp for this model"
        )
    return layers


def shard_model(
    root: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device | str,
    compute_dtype: torch.dtype | None = None,
) -> list[FSDPModule]:
    """Apply FSDP2 to each decoder layer under ``root`` and to ``root``; gradients are SUMMED.

    ``root`` must be the module whose forward encloses every use of the non-layer parameters
    (see the module docstring). Parameters are replaced by sharded ``DTensor`` s: build the
    optimizer afterwards.

    Args:
        compute_dtype: mixed precision (``model.compute_dtype`` narrower than the stored
            parameters): every unit all-gathers its parameters in this dtype, runs in it, and
            reduce-scatters gradients in the parameters' own dtype (``MixedPrecisionPolicy``), so
            the shards, gradients and AdamW state stay in full precision. None: no casting.

    Returns:
        The FSDP units, layers first, root last.
    """
    if isinstance(root, FSDPModule):
        raise RuntimeError(f"{type(root).__name__} is already sharded with FSDP2")
    mesh = dp_mesh(group, device)
    kw = {}
    if compute_dtype is not None:
        store = next(root.parameters()).dtype
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=store)
    for layer in reversed(
        transformer_layers(root)
    ):  # innermost first, should such layers ever nest
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, **kw)
    fully_shard(root, mesh=mesh, reshard_after_forward=True, **kw)
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for u in units:  # not recursive in torch: set on every unit
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    logger.info("FSDP2: %d units over %d ranks (%s)", len(units), mesh.size(), mesh.device_type)
    return units


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds FSDP2-sharded (``DTensor``) parameters."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full value of ``t``: all-gathers a ``DTensor`` (a collective: every rank must call it
    in the same order), returns a plain tensor unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``ref``: this rank's shard as a ``DTensor`` when ``ref`` is one
    (cut locally, no communication: every rank holds ``full``), else ``full`` unchanged."""
    if not isinstance(ref, DTensor):
        return full
    if tuple(full.shape) != tuple(ref.shape):
        raise ValueError(
            f"cannot shard a tensor of shape {tuple(full.shape)} like one of shape "
            f"{tuple(ref.shape)}"
        )
    local = full.to(device=ref.to_local().device, dtype=ref.dtype)
    return distribute_tensor(local, ref.device_mesh, ref.placements, src_data_rank=None)


def param_numel(module: nn.Module) -> dict[str, int]:
    """``{"local": elements stored on this rank, "full": elements of the unsharded model}``
    over ``module``'s parameters (equal without sharding)."""
    local = full = 0
    for p in module.parameters():
        full += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return {"local": local, "full": full}


def _split_in_two(
    rows: list[int], seqlens: list[int], unit_of: list[int] | None
) -> tuple[list[int], list[int]]:
    """Two token-balanced halves of a micro-batch, keeping prefix-sharing units together if
    possible."""
    units = sorted({unit_of[r] for r in rows}) if unit_of is not None else []
    if len(units) >= 2:
        pos = {u: i for i, u in enumerate(units)}
        cost = [0] * len(units)
        for r in rows:
            cost[pos[unit_of[r]]] += seqlens[r]
        a, _ = karmarkar_karp(cost, 2, equal_size=False)
        left = {units[i] for i in a}
        return [r for r in rows if unit_of[r] in left], [r for r in rows if unit_of[r] not in left]
    a, b = karmarkar_karp([seqlens[r] for r in rows], 2, equal_size=False)
    if not a or not b:  # cannot happen for >= 2 rows; keep both parts non-empty regardless
        return rows[: len(rows) // 2], rows[len(rows) // 2 :]
    return sorted(rows[i] for i in a), sorted(rows[i] for i in b)


def align_micro_batches(
    micro: list[list[int]],
    seqlens: torch.Tensor,
    group: dist.ProcessGroup | None,
    dummy_pass: Callable[[], None],
    unit_ids: torch.Tensor | None = None,
) -> list[list[int]]:
    """Give every rank of ``group`` the same number of micro-batches (FSDP2 needs equal passes).

    The count is agreed with an all-reduce MAX; this rank splits its largest micro-batch (by
    tokens, into two token-balanced parts, prompt groups kept together where possible) until it
    has that many. If it runs out of rows to split, it calls ``dummy_pass`` once per missing
    micro-batch *now* — a complete forward (+ backward under grad mode) that contributes nothing —
    so the collectives still pair up (their order across passes does not matter).

    Args:
        micro: row indices per micro-batch (non-empty lists).
        seqlens: (B,) tokens per row.
        group: the dp group of a sharded module (None: returned unchanged).
        dummy_pass: runs one zero-contribution pass of the sharded module.
        unit_ids: (B,) prefix-sharing unit of each row, or None.

    Returns:
        The (re-)split micro-batches; every row still appears exactly once.
    """
    if group is None or dist.get_world_size(group) == 1:
        return micro
    t = torch.tensor([len(micro)], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    target = int(t.item())
    lens = seqlens.cpu().long().tolist()
    unit_of = unit_ids.cpu().long().tolist() if unit_ids is not None else None
    out = [list(m) for m in micro]
    while len(out) < target:
        splittable = [i for i, m in enumerate(out) if len(m) >= 2]
        if not splittable:
            break
        i = max(splittable, key=lambda j: sum(lens[r] for r in out[j]))
        left, right = _split_in_two(out[i], lens, unit_of)
        out[i : i + 1] = [left, right]
    for _ in range(target - len(out)):
        dummy_pass()
    return out
