"""Off-policy health of a batch: how far the behaviour policy ``mu`` is from ``pi_prox``.

``mu`` is the policy that sampled the tokens (the rollout engine's log-probs, possibly several
policy versions old in async modes); ``pi_prox`` is the proximal policy, the training engine's
log-probs recomputed just before the update (``old_log_probs``). On the N valid tokens, with
per-token weights ``w_t = pi_prox_t / mu_t = exp(log pi_prox_t - log mu_t)``:

* ``ess_ratio = (sum_t w_t)^2 / (N sum_t w_t^2)``: the effective sample size of the
  importance weights over N (Kong 1992, "A note on importance sampling using standardized
  weights"; the staleness diagnostic of AReaL, Fu et al. 2025, arXiv 2505.24298). In (0, 1]:
  1 when ``mu = pi_prox`` on every token, ``1/N`` when one token carries all the weight.
* ``chi2 = E_mu[w^2] - 1``, estimated by ``mean_t(w_t^2) - 1``: the chi-square divergence
  ``chi^2(pi_prox || mu)``, i.e. the variance of the weights (the importance-sampling estimate's
  variance inflation). 0 without mismatch.
* ``kl_behav_prox = mean_t(log mu_t - log pi_prox_t)``: the k1 (unbiased, can be negative on a
  finite sample) estimate of ``KL(mu || pi_prox)`` under the sampling distribution ``mu``.

Token level, on the untruncated weights; log-weights are clamped to ``[-20, 20]`` (NaN → 0) so
the numbers stay finite, as in :mod:`postrl.algos.rollout_correction`. A batch without valid
tokens has no evidence of mismatch: ``ess_ratio = 1``, ``chi2 = 0``, ``kl_behav_prox = 0``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["off_policy_health"]

_LOG_W_CLAMP = 20.0


@torch.no_grad()
def off_policy_health(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """ESS/N, chi-square and KL(mu || pi_prox) of the token-level weights ``pi_prox / mu``.

    Args:
        old_log_prob: (B, R) ``log pi_prox`` of the sampled tokens (``batch["old_log_probs"]``).
        rollout_log_prob: (B, R) ``log mu`` of the same tokens (``batch["rollout_log_probs"]``).
        response_mask: (B, R) valid response tokens (nonzero = valid).

    Returns:
        ``{"ess_ratio", "chi2", "kl_behav_prox"}`` as Python floats (formulas in the module
        docstring).
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"off_policy_health: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} "
            "must have the same shape"
        )
    mask = response_mask.bool()
    log_w = (old_log_prob.double() - rollout_log_prob.double())[mask]  # (N,), float64
    log_w = torch.nan_to_num(log_w, nan=0.0).clamp(-_LOG_W_CLAMP, _LOG_W_CLAMP)
    n = log_w.numel()
    if n == 0:
        return {"ess_ratio": 1.0, "chi2": 0.0, "kl_behav_prox": 0.0}
    # (sum w)^2 / (N sum w^2) in log space: 2 logsumexp(l) - log N - logsumexp(2 l)
    log_ess = 2 * torch.logsumexp(log_w, 0) - math.log(n) - torch.logsumexp(2 * log_w, 0)
    ess_ratio = min(float(torch.exp(log_ess)), 1.0)  # <= 1 by Cauchy-Schwarz; clamp rounding
    chi2 = float(torch.exp(2 * log_w).mean()) - 1.0
    kl = float((-log_w).mean())
    return {"ess_ratio": ess_ratio, "chi2": chi2, "kl_behav_prox": kl}
