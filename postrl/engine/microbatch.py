"""Micro-batching by token budget, balanced with Karmarkar–Karp.

``make_micro_batches`` turns a (mini-)batch into lists of row indices:

* ``use_dynamic_bsz=False``: consecutive chunks of ``micro_batch_size`` rows;
* ``use_dynamic_bsz=True``: the fewest ``k`` micro-batches such that the Karmarkar–Karp
  *largest differencing method* (Karmarkar & Karp 1982; k-way version of Korf 1998) packs the
  units into ``k`` sets of at most ``max_tokens`` tokens each. A unit is one row, or — with
  prefix sharing — all rows of a prompt group, whose cost is the shared prompt plus every response.

Callers restore the original order with :func:`restore_order`.
"""

from __future__ import annotations

import torch

from postrl.protocol.balance import karmarkar_karp as _kk

__all__ = ["karmarkar_karp", "make_micro_batches", "restore_order"]


def karmarkar_karp(costs: list[int], k: int) -> list[list[int]]:
    """``k`` parts of free size with near-equal cost sums (the one KK partitioner in
    :mod:`postrl.protocol.balance`)."""
    return _kk(costs, k, equal_size=False)


def make_micro_batches(
    seqlens: torch.Tensor,
    *,
    use_dynamic_bsz: bool,
    max_tokens: int,
    micro_batch_size: int,
    unit_ids: torch.Tensor | None = None,
    unit_extra: torch.Tensor | None = None,
) -> list[list[int]]:
    """Row indices of each micro-batch.

    Args:
        seqlens: (B,) tokens per row.
        use_dynamic_bsz: token budget (True) or fixed row count (False).
        max_tokens: token budget per micro-batch.
        micro_batch_size: rows per micro-batch when not dynamic.
        unit_ids: (B,) rows with the same id must share a micro-batch (prefix sharing groups).
        unit_extra: (U,) tokens to subtract per unit (a group's duplicated prompt tokens), so a
            unit costs what the packed forward really computes.

    Returns:
        Non-empty lists of row indices; every row appears exactly once.
    """
    b = int(seqlens.shape[0])
    if b == 0:
        return []
    if not use_dynamic_bsz:
        if micro_batch_size < 1:
            raise ValueError(f"ppo_micro_batch_size_per_gpu must be >= 1, got {micro_batch_size}")
        return [list(range(s, min(s + micro_batch_size, b))) for s in range(0, b, micro_batch_size)]
    if unit_ids is None:
        unit_ids = torch.arange(b)
    _, inv = torch.unique(unit_ids, return_inverse=True)
    n_units = int(inv.max()) + 1
    cost = torch.zeros(n_units, dtype=torch.long).index_add_(0, inv.cpu(), seqlens.cpu().long())
    if unit_extra is not None:
        cost = cost - unit_extra.cpu().long()
    biggest = int(cost.max())
    if biggest > max_tokens:
        raise ValueError(
            f"a sequence (or prompt group) has {biggest} tokens > "
            f"ppo_max_token_len_per_gpu={max_tokens}; "
            "raise the token budget to at least the longest prompt+response"
        )
    members: list[list[int]] = [[] for _ in range(n_units)]
    for row, u in enumerate(inv.tolist()):
        members[u].append(row)
    costs = cost.tolist()
    k = max(1, -(-sum(costs) // max_tokens))
    while True:
        parts = [p for p in karmarkar_karp(costs, k) if p]
        if all(sum(costs[u] for u in p) <= max_tokens for p in parts):
            break
        k += 1
    return [sorted(r for u in p for r in members[u]) for p in parts]


def restore_order(chunks: list[torch.Tensor], micro: list[list[int]]) -> torch.Tensor:
    """Concatenate per-micro-batch results and put rows back in their original order."""
    idx = torch.tensor([i for m in micro for i in m], dtype=torch.long)
    cat = torch.cat(chunks, dim=0)
    out = torch.empty_like(cat)
    out[idx.to(cat.device)] = cat
    return out
