"""Advantage estimators beyond the classic set: pass@k GRPO, GDPO, optimal token baseline.

Same calling convention as :mod:`postrl.algos.advantages` (keyword-only, ``sample_mask``
exclusion, unknown keywords ignored, groups with < 2 valid samples -> zero advantage).
"""

from __future__ import annotations

from typing import Any

import torch

from postrl.algos.advantages import _broadcast, _require, _scores_and_valid, register_adv_est
from postrl.algos.utils import group_count_mean_std, group_ids, masked_whiten, valid_rows

__all__ = [
    "compute_grpo_passk_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
]


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al. 2025, arXiv 2503.19595): only the group's best sample learns.

    ``A_best = (r_max - r_second) / (std_g + epsilon)`` (no division when
    ``norm_adv_by_std_in_grpo=False``), every other sample 0. Ties for the max give 0. The best
    sample is found with one stable two-key sort (group, then score descending).
    """
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    inv, g = group_ids(index, scores.device)
    count, _, std = group_count_mean_std(scores, inv, g, valid)
    key = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    order = torch.argsort(key, descending=True, stable=True)  # (B,) by score
    order = order[torch.argsort(inv[order], stable=True)]  # (B,) by group, score desc within
    sorted_inv = inv[order]
    first = torch.ones_like(sorted_inv, dtype=torch.bool)
    first[1:] = sorted_inv[1:] != sorted_inv[:-1]  # first row of each group = its best
    second_score = torch.zeros_like(scores)
    nxt = torch.zeros_like(first)
    nxt[:-1] = first[:-1] & (sorted_inv[1:] == sorted_inv[:-1])
    second_score[order[:-1]] = key[order[1:]]  # score of the next row in sorted order
    adv_sorted = torch.zeros_like(scores)
    best = order[first & nxt]
    gap = scores[best] - second_score[best]
    if norm_adv_by_std_in_grpo:
        gap = gap / (std[best] + epsilon)
    adv_sorted[best] = gap
    adv = torch.where(valid & (count > 1), adv_sorted, torch.zeros_like(scores))
    adv = torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0)
    out = _broadcast(adv, response_mask)
    return out, out


@register_adv_est("gdpo", needs=(), optional=("reward_components",))
def compute_gdpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    reward_components: torch.Tensor | None = None,
    reward_weights: torch.Tensor | list[float] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: group reward-decoupled normalisation (Liu et al. 2026, arXiv 2601.05242).

    Each reward component k is normalised within its group *separately*,
    ``a_ik = (c_ik - mean_g(c_k)) / (std_g(c_k) + epsilon)``, then combined
    ``a_i = sum_k w_k a_ik`` and whitened over the batch's valid tokens. Normalising the sum
    instead (plain GRPO) lets components with large variance drown the others.

    Args:
        reward_components: (B, K) per-component scores. If ``None`` the sequence score is the
            single component (then GDPO = GRPO followed by batch whitening).
        reward_weights: (K,) weights ``w_k`` (default all ones).
        A row with any non-finite component counts as failed.
    """
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    comps = scores.unsqueeze(-1) if reward_components is None else reward_components
    comps = comps.to(scores.dtype).reshape(scores.shape[0], -1)  # (B, K)
    valid = valid & torch.isfinite(comps).all(dim=-1)
    comps = torch.where(valid.unsqueeze(-1), comps, torch.zeros_like(comps))
    inv, g = group_ids(index, scores.device)
    k = comps.shape[1]
    w = torch.ones(k, dtype=scores.dtype, device=scores.device)
    if reward_weights is not None:
        w = torch.as_tensor(reward_weights, dtype=scores.dtype, device=scores.device).reshape(-1)
        if w.numel() != k:
            raise ValueError(f"reward_weights has {w.numel()} entries, reward_components has {k}")
    total = torch.zeros_like(scores)
    count = torch.zeros_like(scores)
    for j in range(k):  # loop over reward components (K is small), vectorised over samples
        count, mean, std = group_count_mean_std(comps[:, j], inv, g, valid)
        a = comps[:, j] - mean
        if norm_adv_by_std_in_grpo:
            a = a / (std + epsilon)
        total = total + w[j] * a
    use = valid & (count > 1)
    tok = (
        torch.where(use, total, torch.zeros_like(total))
        .unsqueeze(-1)
        .expand_as(token_level_rewards)
    )
    adv = masked_whiten(tok, response_mask.bool() & use.unsqueeze(-1))
    return adv, adv


@register_adv_est(
    "optimal_token_baseline",
    needs=("old_log_probs", "sum_pi_squared"),
    optional=("rollout_is_weights",),
    outcome=False,
)
def compute_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (OTB, as implemented in verl ``core_algos``).

    Per group and time step, the variance-minimising baseline of the reward-to-go ``G_t``:
    ``B_t = sum_i G_it W_it / sum_i W_it`` with the cumulative path-variance proxy
    ``W_it = sum_{j <= t} w_ij``, ``w_ij = 1 - 2 pi_ij + sum_v pi_ijv^2`` (the squared norm of
    the score function of the softmax at step j; ``pi_ij = exp(old_log_probs)``). With
    ``rollout_is_weights`` rho, ``w`` is scaled by ``rho^2`` (MSE-optimal under truncated IS).
    ``A_t = G_t - B_t``. With ``handle_zero_tail``, the unique longest sample of a group gets
    ``B_t = 0`` beyond the second-longest length (no other sample informs those steps).

    Args:
        old_log_probs: (B, T) log-probs of the sampled tokens.
        sum_pi_squared: (B, T) ``sum_v pi_v^2`` of the full next-token distribution.
    """
    _require("optimal_token_baseline", old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared)
    assert old_log_probs is not None and sum_pi_squared is not None
    valid = valid_rows(token_level_rewards.sum(-1), sample_mask)
    mask = (response_mask.bool() & valid.unsqueeze(-1)).to(token_level_rewards.dtype)  # (B, T)
    rewards = torch.nan_to_num(token_level_rewards) * mask
    with torch.no_grad():
        returns = rewards.flip(-1).cumsum(-1).flip(-1)  # (B, T) reward-to-go
        w = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
        if rollout_is_weights is not None:
            w = w * rollout_is_weights**2
        w_cum = (w * mask).cumsum(-1) * mask  # (B, T)
        inv, g = group_ids(index, returns.device)
        t = returns.shape[1]
        num = returns.new_zeros(g, t).index_add_(0, inv, returns * w_cum)  # (G, T)
        den = returns.new_zeros(g, t).index_add_(0, inv, w_cum)  # (G, T)
        baseline = (num / (den + epsilon))[inv]  # (B, T)
        count, _, _ = group_count_mean_std(returns[:, 0], inv, g, valid)
        if handle_zero_tail:
            baseline = baseline * _not_zero_tail(mask, inv, g, valid)
        adv = torch.where((count > 1).unsqueeze(-1), returns - baseline, torch.zeros_like(returns))
    return adv * mask, returns * mask


def _not_zero_tail(
    mask: torch.Tensor, inv: torch.Tensor, g: int, valid: torch.Tensor
) -> torch.Tensor:
    """(B, T) 0 where a group's unique longest sample runs past the group's second length."""
    lengths = torch.where(valid, mask.sum(-1), torch.full_like(mask[:, 0], -1.0))  # (B,)
    max_g = torch.full((g,), -1.0, dtype=mask.dtype, device=mask.device).scatter_reduce(
        0, inv, lengths, reduce="amax"
    )
    is_max = valid & (lengths == max_g[inv])
    n_max = torch.zeros(g, dtype=mask.dtype, device=mask.device).index_add_(
        0, inv, is_max.to(mask.dtype)
    )
    others = torch.where(is_max, torch.full_like(lengths, -1.0), lengths)
    second_g = torch.full((g,), -1.0, dtype=mask.dtype, device=mask.device).scatter_reduce(
        0, inv, others, reduce="amax"
    )
    tail_row = is_max & (n_max[inv] == 1) & (second_g[inv] >= 0)  # (B,)
    pos = torch.arange(mask.shape[1], device=mask.device, dtype=mask.dtype)  # (T,)
    tail = tail_row.unsqueeze(-1) & (pos.unsqueeze(0) >= second_g[inv].unsqueeze(-1))
    return (~tail).to(mask.dtype)
