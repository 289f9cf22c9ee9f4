"""Covariance-based entropy-preserving losses: Clip-Cov and KL-Cov.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models" (arXiv 2505.22617): entropy collapse is driven by tokens with a large covariance
``Cov(log pi, A)``. Centering over the valid tokens of the (micro-)batch,
``c_t = (A_t - mean A) * (log pi_t - mean log pi)``:

* **Clip-Cov** detaches the gradient of a random ``clip_cov_ratio`` share of tokens whose
  covariance lies in ``(clip_cov_lb, clip_cov_ub)`` (tokens already clipped by PPO excluded);
* **KL-Cov** adds ``ppo_kl_coef * |log pi - log pi_old|`` to the PPO loss of the top
  ``kl_cov_ratio`` share of tokens by covariance (the unclipped surrogate ``-A r`` elsewhere).

Statistics are taken over this shard's tokens (as in verl); the random choice of Clip-Cov uses
the global torch RNG (bind ``generator=`` for reproducibility).
"""

from __future__ import annotations

import torch

from postrl.algos.policy_losses import (
    LossInputs,
    _agg,
    _clips,
    _log_ratio,
    _metrics,
    register_policy_loss,
)
from postrl.algos.utils import masked_mean

__all__ = ["compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov"]


def _token_cov(
    advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(B, T) centred product of advantage and (detached) log-prob over valid tokens."""
    lp = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO clip, plus gradient detachment of a few high-covariance tokens.

    Hyperparameters: ``clip_cov_ratio`` (share of tokens detached), ``clip_cov_lb`` /
    ``clip_cov_ub`` (covariance window), the PPO clip ratios, ``generator`` (CPU RNG of the
    random choice). ``pg_clipfrac`` = share of detached tokens.
    """
    eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
    ratio_k, lb, ub = float(clip_cov_ratio), float(clip_cov_lb), float(clip_cov_ub)
    advantages, response_mask = x.advantages, x.response_mask
    mask = response_mask.bool()
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    ratio = torch.exp(lr)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h)
    cov = _token_cov(advantages, x.log_prob, response_mask)
    candidates = mask & ~(l2 > l1) & (cov > lb) & (cov < ub)  # (B, T)
    flat = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0]
    n_clip = max(int(ratio_k * float(mask.sum())), 1)
    keep = torch.ones_like(lr).reshape(-1)
    if flat.numel() > 0:
        perm = torch.randperm(flat.numel(), generator=generator, device="cpu")
        keep[flat[perm[:n_clip].to(flat.device)]] = 0.0
    keep = keep.reshape_as(lr)  # 0 = gradient detached
    loss_mat = torch.maximum(l1, l2) * keep
    loss = _agg(x, loss_mat, norm_length)
    clipfrac = masked_mean((keep == 0).to(lr.dtype), response_mask)
    return loss, _metrics(clipfrac, lr.new_zeros(()), masked_mean(-lr, response_mask))


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    x: LossInputs,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: ``-A r`` everywhere, plus ``ppo_kl_coef * |lr|`` on the top-covariance tokens.

    Hyperparameters: ``kl_cov_ratio`` (share of tokens penalised), ``ppo_kl_coef``. ``ppo_kl``
    reports ``mean |log pi - log pi_old|`` (as verl); ``pg_clipfrac`` = share of penalised tokens.
    """
    ratio_k, coef = float(kl_cov_ratio), float(ppo_kl_coef)
    advantages, response_mask = x.advantages, x.response_mask
    mask = response_mask.bool()
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    ratio = torch.exp(lr)
    base = -advantages * ratio
    cov = _token_cov(advantages, x.log_prob, response_mask)
    n_valid = int(mask.sum())
    penal = torch.zeros_like(mask)
    if n_valid > 0 and ratio_k > 0:
        k = max(1, int(n_valid * ratio_k))
        score = torch.where(mask, cov, torch.full_like(cov, float("-inf"))).reshape(-1)
        top = torch.topk(score, k).indices
        penal = penal.reshape(-1).index_fill(0, top, True).reshape_as(mask)
    loss_mat = torch.where(penal, base + coef * lr.abs(), base)
    loss = _agg(x, loss_mat, norm_length)
    frac = masked_mean(penal.to(lr.dtype), response_mask)
    return loss, _metrics(frac, lr.new_zeros(()), masked_mean(lr.abs(), response_mask))
