"""Decoupled PPO: the clip and the off-policy correction act on different policies.

Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy optimization"
(arXiv 2110.00641), §3; used for asynchronous RL by AReaL (Fu et al. 2025, arXiv 2505.24298,
§5.2). Three policies per token:

* ``mu``      behaviour policy: the log-probs the rollout engine sampled with
  (``rollout_log_probs``; in async modes older weights, possibly several versions per
  trajectory);
* ``pi_prox`` proximal policy: the log-probs recomputed with the weights at the start of this
  update (``old_log_probs``, stage 4);
* ``pi``      the current policy being optimised.

With ``r = pi / pi_prox`` and the truncated weight ``w = sg(min(pi_prox / mu, C))``::

    L_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_l, 1 + eps_h))      (+ dual clip, A < 0)

The trust region is measured against ``pi_prox`` (recent weights), not against the stale
``mu``, so staleness does not shrink the step; the weight corrects the sampling distribution.
Truncation follows ``algorithm.rollout_correction``'s semantics: ``rollout_is="token"``
``w_t = min(exp(log pi_prox_t - log mu_t), C)``; ``"sequence"``
``w_i = min(exp(sum_t (log pi_prox_t - log mu_t)), C)`` broadcast over the sequence's tokens.

Deviations from the paper: the paper uses the untruncated ratio ``pi_prox / mu`` and a
proximal policy that is an EWMA of past weights; like AReaL we take the weights at the start of
the update as ``pi_prox`` and, like verl's TIS, truncate the weight at ``C`` (variance bound).
When ``mu == pi_prox`` (sync training, identical kernels) ``w = 1`` and the loss is exactly
vanilla PPO's.
"""

from __future__ import annotations

import dataclasses

import torch

from postrl.algos.policy_losses import (
    LossInputs,
    _agg,
    _clips,
    _log_ratio,
    _metrics,
    _ppo_clip_matrix,
    register_policy_loss,
)
from postrl.algos.utils import masked_mean

__all__ = ["proximal_is_weights", "compute_policy_loss_decoupled"]

_LEVELS = ("token", "sequence")


@torch.no_grad()
def proximal_is_weights(
    prox_log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights ``min(pi_prox / mu, C)`` and the untruncated log-ratio.

    Args:
        prox_log_prob: (B, T) log pi_prox of the sampled tokens.
        behav_log_prob: (B, T) log mu of the same tokens (the rollout's).
        response_mask: (B, T); tokens outside it get weight 0 and log-ratio 0.
        level: ``"token"`` (per-token ratio) or ``"sequence"`` (product over the sequence,
            broadcast over its tokens).
        threshold: truncation ``C`` > 0.

    Returns:
        ``(weights (B, T), log_ratio (B, T))`` — ``log_ratio`` is the untruncated log weight
        at ``level`` (the sequence sum broadcast for ``"sequence"``); no gradient.
    """
    if level not in _LEVELS:
        raise ValueError(f"rollout_is must be one of {_LEVELS}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    mask = response_mask.bool()
    lr = torch.where(mask, prox_log_prob - behav_log_prob, torch.zeros_like(prox_log_prob))
    lr = torch.nan_to_num(lr, nan=0.0).clamp(-20.0, 20.0)  # (B, T)
    if level == "sequence":
        lr = lr.sum(-1, keepdim=True).clamp(-20.0, 20.0).expand_as(lr)  # (B, T)
    w = torch.clamp(torch.exp(lr), max=float(threshold)) * mask.to(lr.dtype)  # (B, T)
    return w, lr


@register_policy_loss(
    "decoupled",
    needs=("rollout_log_prob", "proximal_log_prob"),
    zero_advantage_rows_free=True,
)
def compute_policy_loss_decoupled(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2021, arXiv 2110.00641; AReaL, arXiv 2505.24298).

    ``L_t = sg(min(pi_prox_t / mu_t, C)) * max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))`` with
    ``r = pi / pi_prox`` (dual clip for ``A < 0`` as :func:`compute_policy_loss_vanilla`);
    ``x.old_log_prob`` is ``log pi_prox`` (recomputed at the start of the update),
    ``x.rollout_log_prob`` is ``log mu``. hparams ``rollout_is`` (``"token"`` | ``"sequence"``)
    and ``rollout_is_threshold`` (``C``, default 2.0) truncate the weight exactly as
    ``algorithm.rollout_correction.rollout_is`` / ``rollout_is_threshold`` do.

    The loss computes its own weight: ``x.rollout_is_weights`` must be None (stage-6 weights
    would weight the loss a second time). Extra metrics: ``decoupled_is_mean`` (mean truncated
    weight), ``decoupled_is_clipfrac`` (share of tokens whose weight hit ``C``),
    ``decoupled_kl_behav`` (``mean(log mu - log pi_prox)``, a k1 estimate of
    KL(mu || pi_prox)); ``ppo_kl`` is ``mean(log pi_prox - log pi)``.
    """
    old_log_prob, rollout_log_prob, response_mask = (
        x.old_log_prob,
        x.rollout_log_prob,
        x.response_mask,
    )
    if rollout_log_prob is None:
        raise ValueError(
            "policy loss 'decoupled' needs rollout_log_prob (log mu, the rollout engine's "
            "log-probs; batch['rollout_log_probs'])"
        )
    if x.rollout_is_weights is not None:
        raise ValueError(
            "policy loss 'decoupled' weights the loss by pi_prox/mu itself; rollout_is_weights "
            "would apply a second weight: unset algorithm.rollout_correction.rollout_is and set "
            "actor.policy_loss_kwargs.rollout_is / rollout_is_threshold instead"
        )
    w, log_w = proximal_is_weights(
        old_log_prob.detach(),
        rollout_log_prob.detach(),
        response_mask,
        level=rollout_is,
        threshold=rollout_is_threshold,
    )
    lr = _log_ratio(old_log_prob, x.log_prob)
    eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
    loss_mat, clipfrac, lower = _ppo_clip_matrix(
        lr, x.advantages, response_mask, eps_l, eps_h, clip_ratio_c
    )
    weighted = dataclasses.replace(x, rollout_is_weights=w.to(loss_mat.dtype))
    loss = _agg(weighted, loss_mat, norm_length)
    metrics = _metrics(clipfrac, lower, masked_mean(-lr, response_mask))
    hit = (log_w > torch.log(torch.tensor(float(rollout_is_threshold)))).to(w.dtype)
    metrics["decoupled_is_mean"] = masked_mean(w, response_mask).detach()
    metrics["decoupled_is_clipfrac"] = masked_mean(hit, response_mask).detach()
    metrics["decoupled_kl_behav"] = masked_mean(
        (rollout_log_prob - old_log_prob).detach(), response_mask
    )
    return loss, metrics
