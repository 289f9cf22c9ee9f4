"""DAPO pieces (Yu et al. 2025, arXiv 2503.14476): overlong reward shaping, dynamic sampling."""

from __future__ import annotations

from typing import Any

import torch

from postrl.algos.utils import group_count_mean_std, group_ids, valid_rows

__all__ = ["overlong_reward_penalty", "filter_groups"]


def overlong_reward_penalty(
    response_length: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Eq. 13), to be *added* to the sequence score.

    With ``L_max = max_response_length``, buffer ``L_c = overlong_buffer_len`` and
    ``L_exp = L_max - L_c``::

        penalty(|y|) = 0                                    if |y| <= L_exp
                     = -(|y| - L_exp) / L_c * factor        if L_exp < |y| <= L_max
                     = -factor                              if |y| > L_max

    Args:
        response_length: (B,) valid response lengths.

    Returns:
        (B,) penalties <= 0 (same float dtype as a float input, else float32).
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    length = response_length.to(
        torch.float32 if not response_length.is_floating_point() else response_length.dtype
    )
    expected = max_response_length - overlong_buffer_len
    exceed = (length - expected).clamp(min=0.0, max=float(overlong_buffer_len))
    return -exceed / overlong_buffer_len * penalty_factor


def filter_groups(
    scores: torch.Tensor, index: Any, sample_mask: Any = None
) -> tuple[torch.Tensor, dict[str, int]]:
    """DAPO dynamic sampling: drop whole groups whose valid scores are all equal.

    Such groups give zero group-relative advantage and only dilute the batch. A group is kept
    iff it has at least two valid samples (``sample_mask`` and finite score) whose scores
    differ (unbiased std > 0). Failed samples inside a kept group stay (they get zero
    advantage via ``sample_mask``), so ``keep_mask`` is constant within a group.

    Args:
        scores: (B,) sequence scores (metric to filter on).
        index: length-B group ids.
        sample_mask: optional (B,) bool, False = failed reward.

    Returns:
        ``(keep_mask (B,) bool, metrics)`` with ``num_groups``, ``num_kept_groups``,
        ``num_dropped_groups``, ``num_kept_samples``, ``num_dropped_samples`` (ints, for the
        driver's decision to sample more).
    """
    scores = scores.reshape(-1)
    valid = valid_rows(scores, sample_mask)
    s = torch.where(valid, scores, torch.zeros_like(scores)).to(torch.float64)
    inv, g = group_ids(index, scores.device)
    count, _, std = group_count_mean_std(s, inv, g, valid)
    keep = (count > 1) & (std > 0)  # (B,), constant within a group
    kept_groups = torch.zeros(g, dtype=torch.bool, device=scores.device)
    kept_groups[inv[keep]] = True
    n_kept_groups = int(kept_groups.sum())
    n_kept = int(keep.sum())
    return keep, {
        "num_groups": g,
        "num_kept_groups": n_kept_groups,
        "num_dropped_groups": g - n_kept_groups,
        "num_kept_samples": n_kept,
        "num_dropped_samples": int(scores.numel()) - n_kept,
    }
