"""Masked statistics, group ids and denominators shared by the algorithm modules.

Symbols: ``B`` batch (samples), ``T`` response length, ``G`` number of groups (prompts).
Everything here is vectorised; the only host sync is turning a non-tensor ``index`` into
integer group ids (which needs numpy anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "compute_response_mask",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "group_ids",
    "group_count_mean_std",
    "valid_rows",
    "local_denominators",
]


def compute_response_mask(attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """Response part of an ``attention_mask`` laid out as ``[prompt | response]``.

    Args:
        attention_mask: (B, P + T) 1 on real tokens.
        response_length: T, the (padded) response width.

    Returns:
        (B, T) mask of the response tokens (same dtype as ``attention_mask``).
    """
    if response_length <= 0:
        return attention_mask[:, :0]
    return attention_mask[:, -response_length:]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)``; masked entries never propagate NaN/inf (they are selected out)."""
    vals = torch.where(mask.bool(), values, torch.zeros_like(values))
    return vals.sum() if dim is None else vals.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)``: 0 (not NaN) when nothing is selected."""
    num = masked_sum(values, mask, dim)
    den = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return num / den.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected entries (Bessel-corrected when ``unbiased`` and count > 1)."""
    mean = masked_mean(values, mask)
    centered = torch.where(mask.bool(), values - mean, torch.zeros_like(values))
    n = mask.to(values.dtype).sum()
    sq = (centered**2).sum()
    if unbiased:
        return sq / (n - 1).clamp(min=1.0)
    return sq / n.clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the selected entries; masked entries become 0.

    With fewer than two selected entries the variance is 0, so the output is ``x - mean``
    scaled by ``1/sqrt(eps)`` of zero, i.e. 0 — never NaN.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - mean) if shift_mean else values
    out = out * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def group_ids(index: Any, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group labels to dense ids ``0..G-1``.

    Args:
        index: length-B group labels (numpy array, list, or tensor; any hashable values).
        device: device for the returned tensor.

    Returns:
        ``(inv, G)``: (B,) long tensor of dense group ids, and the number of groups.
    """
    if isinstance(index, torch.Tensor):
        uniq, inv = torch.unique(index.reshape(-1), return_inverse=True)
        return inv.to(device=device, dtype=torch.long), int(uniq.numel())
    arr = np.asarray(index) if not isinstance(index, np.ndarray) else index
    try:
        uniq_np, inv_np = np.unique(arr, return_inverse=True)
        n = len(uniq_np)
    except TypeError:  # unorderable mixed labels: fall back to first-seen order
        seen: dict[Any, int] = {}
        inv_np = np.fromiter((seen.setdefault(x, len(seen)) for x in arr), dtype=np.int64)
        n = len(seen)
    return torch.as_tensor(inv_np.reshape(-1), dtype=torch.long, device=device), int(n)


def valid_rows(
    scores: torch.Tensor, sample_mask: torch.Tensor | Sequence[bool] | None
) -> torch.Tensor:
    """(B,) bool: rows whose reward may be used — ``sample_mask`` and a finite score.

    A non-finite score (NaN/inf from a crashed reward function) is treated as a failed sample
    even when ``sample_mask`` says otherwise, so it can never leak into group statistics.
    """
    valid = torch.isfinite(scores)
    if sample_mask is not None:
        sm = torch.as_tensor(sample_mask, device=scores.device).reshape(-1).bool()
        if sm.numel() != scores.shape[0]:
            raise ValueError(
                f"sample_mask has {sm.numel()} entries but the batch has {scores.shape[0]} rows"
            )
        valid = valid & sm
    return valid


def group_count_mean_std(
    scores: torch.Tensor, inv: torch.Tensor, num_groups: int, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group count, mean and unbiased std of the valid scores, gathered back per sample.

    One ``index_add`` per statistic (no loop over samples). Invalid rows contribute nothing.

    Args:
        scores: (B,) float.
        inv: (B,) dense group ids.
        num_groups: G.
        valid: (B,) bool.

    Returns:
        ``(count, mean, std)`` each (B,): the statistics of the sample's own group.
        ``std`` is 0 for groups with fewer than two valid members.
    """
    vf = valid.to(scores.dtype)
    s = torch.where(valid, scores, torch.zeros_like(scores))
    count_g = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, vf
    )  # (G,)
    sum_g = torch.zeros_like(count_g).index_add_(0, inv, s)  # (G,)
    mean_g = sum_g / count_g.clamp(min=1.0)
    dev = torch.where(valid, s - mean_g[inv], torch.zeros_like(s))  # (B,)
    sq_g = torch.zeros_like(count_g).index_add_(0, inv, dev**2)
    std_g = torch.sqrt(sq_g / (count_g - 1.0).clamp(min=1.0))
    return count_g[inv], mean_g[inv], std_g[inv]


def local_denominators(loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """This shard's share of the global loss denominators.

    Sum these over every micro-batch and dp rank of one optimizer step (an all-reduce SUM) and
    pass the totals to :func:`postrl.algos.agg_loss` as ``global_num_tokens`` /
    ``global_num_seqs``. A sequence counts only if it has at least one valid token, which is
    the convention ``agg_loss`` uses when no denominator is given.

    Returns:
        ``{"global_num_tokens": 0-d, "global_num_seqs": 0-d}`` float tensors.
    """
    m = loss_mask.to(torch.float32)
    return {
        "global_num_tokens": m.sum(),
        "global_num_seqs": (m.sum(dim=-1) > 0).to(torch.float32).sum(),
    }
