"""Rollout correction: importance weights, rejection sampling and their health metrics.

The rollout engine samples from a behaviour policy ``mu`` (different kernels, precision,
stale weights in async modes); training recomputes ``pi_old``. With per-token log-ratio
``l_t = log pi_old - log mu`` on valid tokens:

* **truncated IS** (``rollout_is``): ``"token"`` ``w_t = min(exp(l_t), C)``; ``"sequence"``
  ``w_i = min(exp(sum_t l_t), C)`` broadcast over tokens (Ionides 2008, truncated IS; the
  token form is "TIS", Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"). The weights multiply the policy loss and carry no gradient.
* **rejection sampling** (``rollout_rs``): mask out whole sequences whose ratio leaves
  ``[lower, upper]``: ``"sequence"`` uses ``exp(sum_t l_t)``, ``"geometric"`` the per-token
  geometric mean ``exp(mean_t l_t)`` (length-independent). ``lower`` defaults to
  ``1 / upper``.

Health metrics (0-d tensors, computed on the *untruncated* weights of the valid sequences
before rejection; the IS level is ``rollout_is``, sequence level when ``rollout_is`` is None):

* ``rollout_corr/ess`` normalised effective sample size ``(sum w)^2 / (N sum w^2)`` in
  (0, 1] — 1 means no mismatch (Kong 1992), computed in log space;
* ``rollout_corr/chi2`` ``E[w^2] - 1`` (chi-square divergence estimate; log-weights clamped
  at 20 to stay finite);
* ``rollout_corr/kl_k1`` ``mean_t(log mu - log pi_old)`` and ``rollout_corr/kl_k3``
  ``mean_t(exp(l) - 1 - l)``: KL(mu || pi_old) estimates over valid tokens;
* ``rollout_corr/ppl_rollout`` / ``ppl_train``: mean over sequences of ``exp(-mean_t log p)``;
* ``rollout_corr/is_clip_frac``: share of weights above the threshold (0 without IS);
* ``rollout_corr/rejection_rate``: share of non-empty sequences rejected (0 without RS).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["compute_rollout_correction", "rollout_correction_with_health"]

_IS_MODES = (None, "token", "sequence")
_RS_MODES = (None, "sequence", "geometric")


def _ess(log_w: torch.Tensor) -> torch.Tensor:
    """Normalised ESS of weights ``exp(log_w)`` (1-D), stable in log space."""
    if log_w.numel() == 0:
        return log_w.new_ones(())
    n = math.log(log_w.numel())
    return torch.exp(2 * torch.logsumexp(log_w, 0) - n - torch.logsumexp(2 * log_w, 0)).clamp(
        max=1.0
    )


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights, rejection mask and health metrics for rollout/training mismatch.

    Args:
        old_log_prob: (B, T) training-engine log-probs of the sampled tokens.
        rollout_log_prob: (B, T) rollout-engine log-probs of the same tokens.
        response_mask: (B, T).
        rollout_is: None | "token" | "sequence"
            (config ``algorithm.rollout_correction.rollout_is``).
        rollout_is_threshold: truncation C of the weights.
        rollout_rs: None | "sequence" | "geometric".
        rollout_rs_threshold / rollout_rs_threshold_lower: accepted ratio range.

    Returns:
        ``(is_weights (B, T) or None, new_response_mask (B, T), metrics)``; weights are 0
        outside the new mask; the new mask has the dtype of ``response_mask``.
    """
    if rollout_is not in _IS_MODES:
        raise ValueError(f"rollout_is must be one of {_IS_MODES}, got {rollout_is!r}")
    if rollout_rs not in _RS_MODES:
        raise ValueError(f"rollout_rs must be one of {_RS_MODES}, got {rollout_rs!r}")
    mask = response_mask.bool()
    mf = mask.to(torch.float32)
    lr = torch.where(mask, old_log_prob.float() - rollout_log_prob.float(), torch.zeros_like(mf))
    lr = torch.nan_to_num(lr, nan=0.0).clamp(-20.0, 20.0)  # (B, T)
    n_tok = mf.sum(-1)  # (B,)
    nonempty = n_tok > 0  # (B,)
    seq_lr = lr.sum(-1)  # (B,)

    # --- health metrics on untruncated weights
    level_lr = lr[mask] if rollout_is == "token" else seq_lr[nonempty]  # (N,)
    metrics = {
        "rollout_corr/ess": _ess(level_lr),
        "rollout_corr/chi2": (torch.exp(2 * level_lr.clamp(max=20.0)).mean() - 1.0)
        if level_lr.numel()
        else mf.new_zeros(()),
        "rollout_corr/kl_k1": (-lr * mf).sum() / mf.sum().clamp(min=1.0),
        "rollout_corr/kl_k3": ((torch.exp(lr) - 1.0 - lr) * mf).sum() / mf.sum().clamp(min=1.0),
    }
    nseq = nonempty.float().sum().clamp(min=1.0)
    for name, lp in (("ppl_rollout", rollout_log_prob), ("ppl_train", old_log_prob)):
        lp = torch.where(mask, lp.float(), torch.zeros_like(mf))
        ppl = torch.exp(-lp.sum(-1) / n_tok.clamp(min=1.0))
        metrics[f"rollout_corr/{name}"] = (
            torch.where(nonempty, ppl, torch.zeros_like(ppl)).sum() / nseq
        )

    # --- rejection sampling (whole sequences)
    keep = nonempty.clone()
    if rollout_rs is not None:
        upper = float(rollout_rs_threshold)
        lower = (
            1.0 / upper if rollout_rs_threshold_lower is None else float(rollout_rs_threshold_lower)
        )
        stat = seq_lr if rollout_rs == "sequence" else seq_lr / n_tok.clamp(min=1.0)  # log ratio
        inside = (stat <= math.log(upper)) & (stat >= math.log(max(lower, 1e-30)))
        keep = keep & inside
    metrics["rollout_corr/rejection_rate"] = (nonempty & ~keep).float().sum() / nseq
    new_mask = mask & keep.unsqueeze(-1)

    # --- truncated importance weights
    weights = None
    thr = float(rollout_is_threshold)
    if rollout_is is None:
        metrics["rollout_corr/is_clip_frac"] = mf.new_zeros(())
    else:
        raw = (
            torch.exp(lr)
            if rollout_is == "token"
            else torch.exp(seq_lr).unsqueeze(-1).expand_as(lr)
        )
        weights = torch.clamp(raw, max=thr) * new_mask.to(torch.float32)
        weights = weights.to(old_log_prob.dtype)
        if rollout_is == "token":
            metrics["rollout_corr/is_clip_frac"] = (
                (raw > thr).float() * mf
            ).sum() / mf.sum().clamp(min=1.0)
        else:
            metrics["rollout_corr/is_clip_frac"] = (
                (torch.exp(seq_lr) > thr) & nonempty
            ).float().sum() / nseq
    return weights, new_mask.to(response_mask.dtype), metrics


def rollout_correction_with_health(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    **correction: Any,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """:func:`compute_rollout_correction` plus the token-level off-policy health of
    :func:`~postrl.algos.health.off_policy_health` (ESS/N, χ², KL(μ‖π_prox)), measured before
    any rejection. ``correction``: ``compute_rollout_correction``'s keyword arguments
    (``rollout_is``, thresholds, ``rollout_rs`` …).

    Returns ``(is_weights or None, response_mask after rejection, metrics)`` with the health
    numbers under ``health/*``. One call serves the trainer's stage and the training workers of
    the object-store data plane, so both report the same numbers.
    """
    from postrl.algos.health import off_policy_health

    health = off_policy_health(old_log_probs, rollout_log_probs, response_mask)
    weights, mask, m = compute_rollout_correction(
        old_log_probs, rollout_log_probs, response_mask, **correction
    )
    metrics = {k: float(v) for k, v in m.items()}
    metrics.update({f"health/{k}": float(v) for k, v in health.items()})
    return weights, mask.to(response_mask.dtype), metrics
