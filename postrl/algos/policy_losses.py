"""Policy losses: registry, their one input type, and the PPO family.

Every loss has one signature::

    fn(x: LossInputs, *, <hyperparameters>) -> (loss, metrics)

:class:`LossInputs` is the frozen set of per-batch tensors and aggregation settings the engine
supplies on every call: ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` and
``rollout_*`` are (B, T); ``loss_agg_mode`` and the global denominators ``global_num_tokens`` /
``global_num_seqs`` / ``dp_size``. The loss is aggregated with :func:`postrl.algos.agg_loss`
(denominators passed through, so it is this shard's additive contribution). ``metrics`` holds at
least ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` as detached 0-d tensors (local masked
means; no host sync). ``rollout_is_weights`` (B, T), when given, multiplies the per-token loss
(truncated IS correction from :func:`postrl.algos.compute_rollout_correction`).

Hyperparameters are typed keyword-only arguments of each loss (no ``**hparams``): the trainer
binds ``actor.policy_loss_kwargs`` once at startup with :func:`bind_policy_loss`, so an unknown
or misspelt name is an error with a did-you-mean, never silently ignored. Shared ones:
``clip_ratio_low`` / ``clip_ratio_high`` (default ``clip_ratio`` = 0.2; from
``actor.clip_ratio_low/high``), ``clip_ratio_c`` (dual-clip, 3.0; ``actor.clip_ratio_c``),
``norm_length`` (constant of ``seq-mean-token-sum-norm``; every loss takes it).

Notation: ``r = exp(log_prob - old_log_prob)`` (log-ratio clamped to [-20, 20]), ``A``
advantages, ``eps_l / eps_h`` the clip ratios.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from postrl.algos.aggregation import agg_loss
from postrl.algos.hparams import bind_hparams, hparam_errors
from postrl.algos.utils import masked_mean
from postrl.registry import Registry

__all__ = [
    "LossInputs",
    "POLICY_LOSSES",
    "POLICY_LOSS_INPUTS",
    "register_policy_loss",
    "get_policy_loss",
    "bind_policy_loss",
    "policy_loss_hparam_errors",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

_BT_FIELDS = ("log_prob", "advantages", "response_mask", "rollout_log_prob", "rollout_is_weights")


@dataclass(frozen=True)
class LossInputs:
    """What the engine hands every policy loss on every call (frozen: a loss never edits it).

    Tensors are (B, T) — B rows of this micro-batch, T response tokens — and share one shape
    (checked at construction; no host sync).
    """

    old_log_prob: torch.Tensor
    """(B, T) log-probs of the sampled tokens under the policy that the ratio is taken against
    (π_old; π_prox for ``decoupled``)."""
    log_prob: torch.Tensor
    """(B, T) log-probs under the policy being optimised (carries the gradient)."""
    advantages: torch.Tensor
    """(B, T) advantages ``A``."""
    response_mask: torch.Tensor
    """(B, T) 1 on trained tokens, 0 elsewhere."""
    loss_agg_mode: str = "token-mean"
    """Aggregation mode of :func:`postrl.algos.agg_loss` (``actor.loss_agg_mode``)."""
    global_num_tokens: torch.Tensor | float | None = None
    """Valid tokens of the whole optimizer step over all micro-batches and dp ranks (None: this
    micro-batch's own count)."""
    global_num_seqs: torch.Tensor | float | None = None
    """Valid sequences of the whole optimizer step (None: this micro-batch's own count)."""
    dp_size: int = 1
    """Data-parallel ranks whose gradients are summed (> 1 needs the global denominators)."""
    rollout_log_prob: torch.Tensor | None = None
    """(B, T) log-probs the rollout engine sampled with (the behaviour policy μ), if returned."""
    rollout_is_weights: torch.Tensor | None = None
    """(B, T) truncated importance weights multiplying the per-token loss (stage 6), if any."""

    def __post_init__(self) -> None:
        shape = self.old_log_prob.shape
        for name in _BT_FIELDS:
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(
                    f"LossInputs.{name} has shape {tuple(t.shape)}, old_log_prob has "
                    f"{tuple(shape)}: every (B, T) input of a policy loss must have the same shape"
                )

    @property
    def denominators(self) -> dict[str, Any]:
        """``global_num_tokens``, ``global_num_seqs``, ``dp_size`` as keywords of ``agg_loss``."""
        return {
            "global_num_tokens": self.global_num_tokens,
            "global_num_seqs": self.global_num_seqs,
            "dp_size": self.dp_size,
        }


def register_policy_loss(name: str, **meta: Any) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss (config ``actor.policy_loss``): ``fn(x: LossInputs, *,
    <hyperparameters>) -> (loss, metrics)``; a function with another shape is refused here.

    Meta: ``agg_mode=...`` when the loss always aggregates with one fixed mode (GSPO, GMPO),
    ``needs=("rollout_log_prob",)`` when it needs the rollout engine's log-probs,
    ``zero_advantage_rows_free=True`` when a row whose advantages are all 0 adds exactly 0 to
    the loss and its gradient and does not change any other row's term (every loss linear in
    the row's own advantage; not one that selects tokens by batch statistics): the update may
    then leave such rows out (``actor.skip_zero_advantage``).
    """
    meta.setdefault("needs", ())
    meta.setdefault("zero_advantage_rows_free", False)
    add = POLICY_LOSSES.register(name, **meta)

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        _check_signature(name, fn)
        return add(fn)

    return deco


def _check_signature(name: str, fn: Callable[..., Any]) -> None:
    """Exactly one required positional parameter (the :class:`LossInputs`); the rest keyword."""
    params = inspect.signature(fn).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) != 1 or len(positional) != 1:
        got = ", ".join(p.name for p in positional) or "none"
        raise TypeError(
            f"policy loss {name!r}: {fn.__qualname__} must take one positional parameter, the "
            f"postrl.algos.LossInputs, then keyword-only hyperparameters (positional: {got}); "
            "write it as fn(x: LossInputs, *, my_hparam: float = 1.0)"
        )


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; unknown names list the registered ones."""
    return POLICY_LOSSES.get(name)


POLICY_LOSS_INPUTS = tuple(f.name for f in dataclasses.fields(LossInputs))
"""Fields of :class:`LossInputs`, supplied by the engine on every call: never hyperparameters."""

_LOSS_FIELDS = {
    "clip_ratio": "actor.clip_ratio_low and actor.clip_ratio_high",
    "clip_ratio_low": "actor.clip_ratio_low",
    "clip_ratio_high": "actor.clip_ratio_high",
    "clip_ratio_c": "actor.clip_ratio_c",
}


def policy_loss_hparam_errors(
    name: str, hparams: dict[str, Any], field: str = "actor.policy_loss_kwargs"
) -> list[str]:
    """Problems of ``hparams`` as hyperparameters of loss ``name`` (unknown names with a
    did-you-mean, wrong types, names that have their own ``actor.*`` field); empty: fine."""
    return hparam_errors(
        get_policy_loss(name),
        hparams,
        inputs=POLICY_LOSS_INPUTS,
        owner=f"policy loss {name!r}",
        field=field,
        elsewhere=_LOSS_FIELDS,
    )


def bind_policy_loss(
    name: str, hparams: dict[str, Any] | None = None, *, common: dict[str, Any] | None = None
) -> PolicyLossFn:
    """Loss ``name`` with its hyperparameters bound (raises ``HParamError`` listing problems).

    Args:
        hparams: ``actor.policy_loss_kwargs``.
        common: shared settings (``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``),
            bound only where the loss declares them.
    """
    return bind_hparams(
        get_policy_loss(name),
        dict(hparams or {}),
        inputs=POLICY_LOSS_INPUTS,
        owner=f"policy loss {name!r}",
        field="actor.policy_loss_kwargs",
        common=common,
        elsewhere=_LOSS_FIELDS,
    )


# ---------------------------------------------------------------------------- helpers
def _clips(base: float, low: float | None, high: float | None) -> tuple[float, float]:
    """(eps_l, eps_h): the asymmetric ratios where given, else the symmetric ``clip_ratio``."""
    return float(base if low is None else low), float(base if high is None else high)


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def _agg(
    x: LossInputs, loss_mat: torch.Tensor, norm_length: float | None, mode: str | None = None
) -> torch.Tensor:
    """Aggregate the (B, T) per-token loss: times ``x.rollout_is_weights`` (detached) when set,
    then :func:`agg_loss` with ``mode`` (default ``x.loss_agg_mode``) and the denominators."""
    if x.rollout_is_weights is not None:
        loss_mat = loss_mat * x.rollout_is_weights.detach()
    return agg_loss(
        loss_mat,
        x.response_mask,
        x.loss_agg_mode if mode is None else mode,
        **x.denominators,
        norm_length=norm_length,
    )


def _metrics(
    clipfrac: torch.Tensor, lower: torch.Tensor, kl: torch.Tensor
) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": lower.detach(),
        "ppo_kl": kl.detach(),
    }


def _ppo_clip_matrix(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_l: float,
    eps_h: float,
    clip_c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token dual-clip PPO loss and its two clip fractions (shared by vanilla/bypass)."""
    clip_c = float(clip_c)
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {clip_c}")
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h)
    clipped = torch.maximum(l1, l2)
    l3 = -adv * clip_c
    dual = torch.minimum(l3, clipped)
    loss = torch.where(adv < 0, dual, clipped)
    clipfrac = masked_mean((l2 > l1).to(ratio.dtype), mask)
    lower = masked_mean(((clipped > l3) & (adv < 0)).to(ratio.dtype), mask)
    return loss, clipfrac, lower


# ---------------------------------------------------------------------------- losses
@register_policy_loss("vanilla", zero_advantage_rows_free=True)
def compute_policy_loss_vanilla(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip (Schulman et al. 2017, arXiv 1707.06347) with clip-higher and dual-clip.

    ``L = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))``; asymmetric ``eps_h > eps_l`` is DAPO's
    clip-higher (Yu et al. 2025, arXiv 2503.14476). For ``A < 0`` the dual clip
    (Ye et al. 2020, arXiv 1912.09729) bounds the loss: ``L = min(L, -A c)``, ``c`` =
    ``clip_ratio_c`` > 1. ``pg_clipfrac``: share of tokens where the clip is active;
    ``pg_clipfrac_lower``: share where the dual clip is active.
    """
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
    loss_mat, clipfrac, lower = _ppo_clip_matrix(
        lr, x.advantages, x.response_mask, eps_l, eps_h, clip_ratio_c
    )
    loss = _agg(x, loss_mat, norm_length)
    return loss, _metrics(clipfrac, lower, masked_mean(-lr, x.response_mask))


@register_policy_loss("reinforce", zero_advantage_rows_free=True)
def compute_policy_loss_reinforce(
    x: LossInputs, *, norm_length: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain REINFORCE (Williams 1992) for on-policy updates: ``L = -A log pi``.

    Its gradient ``-A grad log pi`` equals PPO's at ``r = 1``; use it only for a single update
    per batch (no trust region). ``ppo_kl`` still reports ``mean(old - new)``.
    """
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    loss = _agg(x, -x.advantages * x.log_prob, norm_length)
    zero = x.log_prob.new_zeros(())
    return loss, _metrics(zero, zero, masked_mean(-lr, x.response_mask))


@register_policy_loss("gpg", zero_advantage_rows_free=True)
def compute_policy_loss_gpg(
    x: LossInputs, *, norm_length: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient loss (Chu et al. 2025, arXiv 2504.02546): ``L = -A log pi``.

    GPG drops the surrogate and the clip; pair it with the ``gpg`` advantage estimator.
    """
    return compute_policy_loss_reinforce(x, norm_length=norm_length)


@register_policy_loss("gspo", agg_mode="seq-mean-token-mean", zero_advantage_rows_free=True)
def compute_policy_loss_gspo(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), token form "GSPO-token".

    Sequence ratio ``s_i = exp(mean_t (log pi - log pi_old))``; per token
    ``r_it = sg(s_i) * pi_it / sg(pi_it)`` (value ``s_i``, gradient of the token log-prob),
    ``L = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))``. Always aggregated with
    ``seq-mean-token-mean`` (as the paper and verl; ``loss_agg_mode`` is ignored). The paper
    uses tiny clip ranges (``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``).
    """
    eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_prob, adv, mask = x.log_prob, x.advantages, x.response_mask
    mask_f = mask.to(log_prob.dtype)
    neg_kl = log_prob - x.old_log_prob
    seq_lr = (neg_kl * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)  # (B,)
    log_r = seq_lr.detach().unsqueeze(-1) + log_prob - log_prob.detach()  # (B, T)
    ratio = torch.exp(torch.clamp(log_r, max=10.0))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h)
    loss = _agg(x, torch.maximum(l1, l2), norm_length, mode="seq-mean-token-mean")
    clipfrac = masked_mean((l2 > l1).to(ratio.dtype), mask)
    return loss, _metrics(clipfrac, log_prob.new_zeros(()), masked_mean(-neg_kl, mask))


@register_policy_loss("geo_mean", agg_mode="seq-mean-token-mean", zero_advantage_rows_free=True)
def compute_policy_loss_geo_mean(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673).

    Token log-ratios are clipped in log space, pessimistically per sign of A:
    ``l_t = sgn(A) * min(sgn(A) * lr_t, sgn(A) * clip(lr_t, -eps_l, eps_h))``; the sequence
    ratio is their geometric mean ``R_i = exp(mean_t l_t)`` and ``L_i = -mean_t(A) * R_i``,
    averaged over sequences (the loss is broadcast over tokens and aggregated with
    ``seq-mean-token-mean``; ``loss_agg_mode`` is ignored). The paper uses
    ``eps_l = eps_h = 0.4`` (log space). ``rollout_is_weights`` scale the token share.
    """
    eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
    adv, mask = x.advantages, x.response_mask
    mask_f = mask.to(x.log_prob.dtype)
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    sgn = torch.sign(adv)
    lr_clip = torch.clamp(lr, -eps_l, eps_h)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clip)  # (B, T)
    n = mask_f.sum(-1).clamp(min=1.0)  # (B,)
    seq_ratio = torch.exp((lr_min * mask_f).sum(-1) / n)  # (B,)
    seq_adv = (adv * mask_f).sum(-1) / n  # (B,)
    loss_mat = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(x.log_prob)  # (B, T)
    loss = _agg(x, loss_mat, norm_length, mode="seq-mean-token-mean")
    clipped = lr != lr_clip
    clipfrac = masked_mean((clipped & (lr > 0)).to(mask_f.dtype), mask)
    lower = masked_mean((clipped & (lr < 0)).to(mask_f.dtype), mask)
    return loss, _metrics(clipfrac, lower, masked_mean(-lr, mask))


@register_policy_loss("cispo", zero_advantage_rows_free=True)
def compute_policy_loss_cispo(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the IS weight, never the gradient.

    ``L = -sg(clip(r, 1 - eps_l, 1 + eps_h)) * A * log pi``: every token keeps a gradient
    (PPO's clip zeroes it), only its weight is bounded. MiniMax uses no lower bound in practice
    (set ``clip_ratio_low`` large, e.g. 1.0) and ``clip_ratio_high`` ~ 0.2–5 depending on setup.
    ``pg_clipfrac``/``pg_clipfrac_lower``: share of tokens with r above / below the bounds.
    """
    eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = x.response_mask
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    ratio = torch.exp(lr).detach()
    w = torch.clamp(ratio, 1.0 - eps_l, 1.0 + eps_h)
    loss = _agg(x, -w * x.advantages * x.log_prob, norm_length)
    upper = masked_mean((ratio > 1.0 + eps_h).to(ratio.dtype), mask)
    lower = masked_mean((ratio < 1.0 - eps_l).to(ratio.dtype), mask)
    return loss, _metrics(upper, lower, masked_mean(-lr, mask))


@register_policy_loss("sapo", zero_advantage_rows_free=True)
def compute_policy_loss_sapo(
    x: LossInputs,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, arXiv 2511.20347).

    A smooth gate replaces the hard clip: ``f(r) = (4 / tau) * sigmoid(tau (r - 1))``,
    ``L = -f(r) A`` with ``tau = tau_pos`` (default 1.0) for ``A > 0`` and ``tau_neg``
    (default 1.05) otherwise. ``f'(1) = 1`` so at ``r = 1`` the gradient is REINFORCE's; it
    decays smoothly as r leaves 1. SAPO has no hard clip: ``pg_clipfrac`` is 0.
    """
    tau_pos, tau_neg = float(tau_pos), float(tau_neg)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO needs tau_pos, tau_neg > 0, got {tau_pos}, {tau_neg}")
    adv = x.advantages
    lr = _log_ratio(x.old_log_prob, x.log_prob)
    ratio = torch.exp(lr)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _agg(x, -gate * adv, norm_length)
    zero = x.log_prob.new_zeros(())
    return loss, _metrics(zero, zero, masked_mean(-lr, x.response_mask))


@register_policy_loss("bypass_mode", needs=("rollout_log_prob",), zero_advantage_rows_free=True)
def compute_policy_loss_bypass_mode(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    bypass_loss: str = "ppo_clip",
    rollout_is_threshold: float = 2.0,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode: the rollout engine's log-probs serve as the old policy.

    Skips the old-log-prob recomputation; the ratio is taken against the behaviour policy
    ``mu``: ``r = pi / mu``. hparam ``bypass_loss``:

    * ``"ppo_clip"`` (default): dual-clip PPO of :func:`compute_policy_loss_vanilla` with
      ``old_log_prob := rollout_log_prob`` — the clip is the off-policy correction;
    * ``"reinforce"``: ``L = -sg(min(r, rollout_is_threshold)) * A * log pi`` — truncated IS
      REINFORCE (threshold default 2.0).

    ``x.old_log_prob`` is ignored (may be the rollout log-probs or anything). Pass
    ``rollout_is_weights=None`` here (they would be ~1 anyway since old == rollout).
    """
    if x.rollout_log_prob is None:
        raise ValueError(
            "policy loss 'bypass_mode' needs rollout_log_prob: enable returning log-probs from "
            "the rollout engine (rollout_log_probs in the batch)"
        )
    log_prob, adv, mask = x.log_prob, x.advantages, x.response_mask
    lr = _log_ratio(x.rollout_log_prob, log_prob)
    kind = bypass_loss
    if kind == "ppo_clip":
        eps_l, eps_h = _clips(clip_ratio, clip_ratio_low, clip_ratio_high)
        loss_mat, clipfrac, lower = _ppo_clip_matrix(lr, adv, mask, eps_l, eps_h, clip_ratio_c)
    elif kind == "reinforce":
        thr = float(rollout_is_threshold)
        ratio = torch.exp(lr).detach()
        loss_mat = -torch.clamp(ratio, max=thr) * adv * log_prob
        clipfrac = masked_mean((ratio > thr).to(ratio.dtype), mask)
        lower = log_prob.new_zeros(())
    else:
        raise ValueError(f"bypass_loss must be 'ppo_clip' or 'reinforce', got {kind!r}")
    loss = _agg(x, loss_mat, norm_length)
    return loss, _metrics(clipfrac, lower, masked_mean(-lr, mask))
