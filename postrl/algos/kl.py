"""KL estimators, KL-in-reward, KL loss term and KL coefficient controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman 2020, "Approximating
KL divergence", http://joschu.net/blog/kl-approx.html), with ``d = log pi - log pi_ref`` and
``rho = pi_ref / pi = exp(-d)``:

=====================  ====================================  =======================================
name                   value                                 notes
=====================  ====================================  =======================================
``k1`` / ``kl``        ``d``                                 unbiased, high variance, can be < 0
``abs``                ``|d|``
``k2`` / ``mse``       ``d^2 / 2``                           biased; its gradient is the true
                                                             KL gradient in expectation
``k3`` / ``low_var_kl`` ``rho - 1 - log rho``                 unbiased, >= 0; ``-d`` clamped to
                       = ``e^{-d} - 1 + d``                  [-20, 20] and the value to [-10, 10]
                                                             (as verl)
``k1+``, ``k3+``       value of k1/k3, gradient of k2        straight-through (verl's ``+`` suffix):
                                                             ``k2 - sg(k2) + sg(k)``
=====================  ====================================  =======================================

The ``+`` variants exist because k1 and k3 have the right *expected value* but the wrong
*expected gradient* as a loss; k2's gradient is right (see verl ``core_algos.kl_penalty``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from postrl.algos.aggregation import agg_loss
from postrl.algos.utils import masked_mean
from postrl.registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "register_kl_estimator",
    "kl_penalty",
    "compute_rewards",
    "apply_kl_penalty",
    "compute_kl_loss",
    "FixedKLController",
    "AdaptiveKLController",
]

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def register_kl_estimator(name: str, **meta: Any) -> Callable[[KLFn], KLFn]:
    """Register ``fn(log_prob, ref_log_prob) -> (B, T)`` (config ``actor.kl_loss_type`` /
    ``algorithm.kl_penalty``)."""
    return KL_ESTIMATORS.register(name, **meta)


def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1: ``log pi - log pi_ref``."""
    return log_prob - ref_log_prob


def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|``."""
    return (log_prob - ref_log_prob).abs()


def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2: ``(log pi - log pi_ref)^2 / 2``."""
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 (low-variance KL): ``exp(ref - lp) - (ref - lp) - 1``, clamped as in verl."""
    kl = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)


def _straight_through(value_fn: KLFn) -> KLFn:
    def fn(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        grad_part = _k2(log_prob, ref_log_prob)
        return grad_part - grad_part.detach() + value_fn(log_prob, ref_log_prob).detach()

    fn.__doc__ = f"Straight-through: value of {value_fn.__name__}, gradient of k2."
    return fn


for _names, _fn in (
    (("k1", "kl"), _k1),
    (("abs",), _abs),
    (("k2", "mse"), _k2),
    (("k3", "low_var_kl"), _k3),
):
    for _n in _names:
        KL_ESTIMATORS.add(_n, _fn)
KL_ESTIMATORS.add("k1+", _straight_through(_k1))
KL_ESTIMATORS.add("k3+", _straight_through(_k3))
KL_ESTIMATORS.add("low_var_kl+", _straight_through(_k3))


def kl_penalty(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate (B, T) with the estimator registered as ``kl_penalty``."""
    return KL_ESTIMATORS.get(kl_penalty)(log_prob, ref_log_prob)


def compute_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kl_ratio: float,
) -> torch.Tensor:
    """verl's ``compute_rewards``: ``scores - kl_ratio * (old_log_prob - ref_log_prob)`` (k1)."""
    return token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a reward penalty (Ziegler et al. 2019, arXiv 1909.08593; InstructGPT).

    ``r_t = score_t - beta * KL_t`` on response tokens (``beta = kl_coef``). Update the
    controller afterwards with ``ctrl.update(metrics["actor/reward_kl_penalty"], batch_size)``.

    Returns:
        ``(token_level_rewards (B, T), metrics)``; metrics ``actor/reward_kl_penalty`` (mean over
        sequences of the per-sequence token-mean KL) and ``actor/reward_kl_penalty_coeff``.
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = KL_ESTIMATORS.get(kl_penalty)(log_prob, ref_log_prob).detach() * mask  # (B, T)
    rewards = token_level_scores - kl_coef * kld
    current = masked_mean(kld, mask, dim=-1).mean()
    return rewards, {
        "actor/reward_kl_penalty": current.detach(),
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Any = None,
    global_num_seqs: Any = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (GRPO, arXiv 2402.03300): ``agg(KL_t)``; add ``kl_loss_coef * loss``.

    Returns ``(loss, {"kl_loss": loss.detach()})``; denominators as in :func:`agg_loss`.
    """
    kld = KL_ESTIMATORS.get(kl_loss_type)(log_prob, ref_log_prob)
    loss = agg_loss(
        kld,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        norm_length=norm_length,
    )
    return loss, {"kl_loss": loss.detach()}


class FixedKLController:
    """Constant KL coefficient ``beta``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593, §2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move ``value`` towards the target KL (``n_steps`` = samples seen since last update)."""
        err = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state."""
        return {"value": self.value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))
