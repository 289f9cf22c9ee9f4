"""Advantage estimators: registry and the classic estimators.

Every estimator is called with **keyword arguments only**, named as in verl's ``core_algos`` so
ported code fits, and ignores keywords it does not use (the trainer passes one uniform set):

* ``token_level_rewards`` (B, T) — reward per token (outcome rewards sit on the last token);
* ``response_mask`` (B, T) — 1 on tokens the policy generated;
* ``index`` — length-B group ids (prompt uid; any hashable), for group estimators;
* ``sample_mask`` (B,) bool, optional — ``False`` marks a sample whose reward *failed*
  (crash, timeout, NaN). Such a sample is excluded from its group's statistics (mean, std,
  baseline, whitening) and gets zero advantage. Non-finite rewards are treated as failed even
  without ``sample_mask``, so NaN never leaks;
* hyperparameters: typed keyword arguments with defaults — ``gamma``, ``lam``,
  ``norm_adv_by_std_in_grpo`` (their own ``algorithm.*`` fields, passed to every estimator) and
  estimator-specific ones (``epsilon``, ``f_norm``, ...) set in ``algorithm.adv_estimator_kwargs``
  and checked at startup against the signature (:func:`adv_estimator_hparam_errors`: an unknown
  name is an error with a did-you-mean; ``**kwargs`` only absorbs the uniform inputs);

and returns ``(advantages, returns)``, both (B, T), zero outside ``response_mask``.

Registry metadata: ``needs`` lists batch fields beyond rewards/mask/index (``("values",)`` for
GAE makes config validation require a critic; ``postrl.trainer.needs`` maps every need to the
stage that produces it), ``optional`` batch fields used when present, ``outcome`` says whether
only the sequence score matters. **Deviation from verl:** a group with fewer than two valid
samples gives zero advantage in every group estimator (verl returns the raw score for groups of
one), because a baseline from the sample itself carries no signal.

Scores are ``token_level_rewards.sum(-1)`` (as verl); rows are grouped with one ``index_add``
per statistic, never a Python loop over samples. GAE and REINFORCE++ returns are a reverse
scan over time, vectorised over the batch (the recurrence is inherently sequential in T).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from postrl.algos.hparams import bind_hparams, hparam_errors
from postrl.algos.utils import group_count_mean_std, group_ids, masked_whiten, valid_rows
from postrl.registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "register_adv_est",
    "get_adv_estimator",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "ADV_ESTIMATOR_INPUTS",
    "adv_estimator_inputs",
    "adv_estimator_hparam_errors",
    "bind_adv_estimator",
]

AdvFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvFn] = Registry("advantage estimator")


def register_adv_est(name: str, **meta: Any) -> Callable[[AdvFn], AdvFn]:
    """Register an advantage estimator under ``name``.

    Args:
        name: config value of ``algorithm.adv_estimator``.
        **meta: ``needs=(...)`` batch fields required beyond rewards/mask/index,
            ``outcome=True/False``.
    """
    meta.setdefault("needs", ())
    meta.setdefault("optional", ())
    meta.setdefault("outcome", True)
    return ADV_ESTIMATORS.register(name, **meta)


def get_adv_estimator(name: str) -> AdvFn:
    """The estimator registered as ``name``; unknown names list the registered ones."""
    return ADV_ESTIMATORS.get(name)


ADV_ESTIMATOR_INPUTS = ("token_level_rewards", "response_mask", "index", "sample_mask")
"""Inputs every estimator receives per batch (plus its declared ``needs`` / ``optional``)."""

_ADV_FIELDS = {
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
}


def adv_estimator_inputs(name: str) -> tuple[str, ...]:
    """Per-batch inputs of estimator ``name``: the uniform ones, its needs and optional fields."""
    meta = ADV_ESTIMATORS.meta(name)
    return (*ADV_ESTIMATOR_INPUTS, *meta.get("needs", ()), *meta.get("optional", ()))


def adv_estimator_hparam_errors(
    name: str, hparams: dict[str, Any], field: str = "algorithm.adv_estimator_kwargs"
) -> list[str]:
    """Problems of ``hparams`` as hyperparameters of estimator ``name`` (empty list: fine)."""
    return hparam_errors(
        get_adv_estimator(name),
        hparams,
        inputs=adv_estimator_inputs(name),
        owner=f"advantage estimator {name!r}",
        field=field,
        elsewhere=_ADV_FIELDS,
        open_kwargs=False,
    )


def bind_adv_estimator(name: str, hparams: dict[str, Any] | None = None) -> AdvFn:
    """Estimator ``name`` with ``algorithm.adv_estimator_kwargs`` bound (``HParamError`` on an
    unknown name or a wrong type)."""
    return bind_hparams(
        get_adv_estimator(name),
        dict(hparams or {}),
        inputs=adv_estimator_inputs(name),
        owner=f"advantage estimator {name!r}",
        field="algorithm.adv_estimator_kwargs",
        elsewhere=_ADV_FIELDS,
        open_kwargs=False,
    )


# ---------------------------------------------------------------------------- helpers
def _scores_and_valid(
    token_level_rewards: torch.Tensor, sample_mask: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) sequence scores with failed rows zeroed, and the (B,) valid mask."""
    scores = token_level_rewards.sum(dim=-1)
    valid = valid_rows(scores, sample_mask)
    return torch.where(valid, scores, torch.zeros_like(scores)), valid


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence advantage -> (B, T), zero outside the mask."""
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def _clean_token_rewards(token_level_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) rewards with failed rows (and any non-finite entry) set to 0."""
    r = torch.where(valid.unsqueeze(-1), token_level_rewards, torch.zeros_like(token_level_rewards))
    return torch.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0)


def _require(name: str, **fields: Any) -> None:
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(
            f"advantage estimator {name!r} needs {', '.join(missing)}; make sure the batch "
            f"carries it (the registry meta 'needs' of {name!r} lists the required fields)"
        )


def _reverse_discounted_scan(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}``, reset outside the mask.

    Args:
        rewards: (B, T); mask: (B, T). Returns (B, T).
    """
    mask = response_mask.to(rewards.dtype)
    if gamma == 1.0:  # fast path: reverse cumulative sum
        return (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):  # scan over time, vectorised over B
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


# ---------------------------------------------------------------------------- estimators
@register_adv_est("gae", needs=("values",), outcome=False)
def compute_gae_advantage_return(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv 1506.02438).

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, scanned
    backwards. Tokens outside ``response_mask`` (tool observations in multi-turn rollouts) are
    skipped: they neither add a TD error nor break the chain — ``V_{t+1}`` and ``A_{t+1}`` are
    those of the next *valid* token (as verl). ``returns = A + V`` (before whitening); the
    advantages are then whitened over valid tokens of valid samples.

    Args:
        values: (B, T) critic values. gamma, lam: discount and GAE lambda.
    """
    _require("gae", values=values)
    assert values is not None
    valid = valid_rows(token_level_rewards.sum(-1), sample_mask)
    rewards = _clean_token_rewards(token_level_rewards, valid)
    mask = response_mask.to(rewards.dtype)
    with torch.no_grad():
        next_v = torch.zeros_like(rewards[:, 0])
        last_adv = torch.zeros_like(rewards[:, 0])
        adv = torch.zeros_like(rewards)
        for t in range(rewards.shape[1] - 1, -1, -1):  # reverse scan over T, vectorised over B
            delta = rewards[:, t] + gamma * next_v - values[:, t]
            cand = delta + gamma * lam * last_adv
            m = mask[:, t]
            next_v = values[:, t] * m + (1 - m) * next_v
            last_adv = cand * m + (1 - m) * last_adv
            adv[:, t] = last_adv
        returns = adv + values
        wmask = response_mask.bool() & valid.unsqueeze(-1)
        advantages = masked_whiten(adv, wmask)
    return advantages, returns * wmask.to(returns.dtype)


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    sample_mask: Any = None,
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

    ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the unbiased std of the group's valid
    scores; ``norm_adv_by_std_in_grpo=False`` gives Dr. GRPO's ``A_i = s_i - mean_g``
    (Liu et al. 2025, arXiv 2503.20783). Returns equal advantages (as verl).

    ``positive_weight`` / ``negative_weight`` scale ``A_i > 0`` / ``A_i < 0``: the objective
    splits into positive- and negative-sample reinforcement (PSR / NSR), and weighting them
    trades pass@1 (PSR sharpens) against pass@k (NSR keeps the distribution's spread); Zhu et
    al. 2025, arXiv 2506.01347 (W-REINFORCE: ``positive_weight = 0.1``). Both 1.0 = GRPO.
    """
    if positive_weight < 0 or negative_weight < 0:
        raise ValueError(
            f"grpo: positive_weight={positive_weight} and negative_weight={negative_weight} "
            f"must be >= 0"
        )
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    inv, g = group_ids(index, scores.device)
    count, mean, std = group_count_mean_std(scores, inv, g, valid)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    if positive_weight != 1.0 or negative_weight != 1.0:
        adv = adv * torch.where(adv > 0, positive_weight, negative_weight)
    adv = torch.where(valid & (count > 1), adv, torch.zeros_like(adv))
    out = _broadcast(adv, response_mask)
    return out, out


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740).

    ``A_i = s_i - (sum_{j != i} s_j) / (n - 1) = n / (n - 1) * (s_i - mean_g)`` over the
    group's ``n`` valid samples.
    """
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    inv, g = group_ids(index, scores.device)
    count, mean, _ = group_count_mean_std(scores, inv, g, valid)
    adv = count / (count - 1).clamp(min=1.0) * (scores - mean)
    adv = torch.where(valid & (count > 1), adv, torch.zeros_like(adv))
    out = _broadcast(adv, response_mask)
    return out, out


@register_adv_est("opo")
def compute_opo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with optimal baseline (Hao et al. 2025, arXiv 2505.23585).

    Length-weighted group baseline ``b_g = sum_j |y_j| s_j / sum_j |y_j|``; ``A_i = s_i - b_g``.
    """
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    inv, g = group_ids(index, scores.device)
    lengths = torch.where(valid, response_mask.to(scores.dtype).sum(-1), torch.zeros_like(scores))
    num = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, lengths * scores
    )
    den = torch.zeros_like(num).index_add_(0, inv, lengths)
    count, _, _ = group_count_mean_std(scores, inv, g, valid)
    baseline = (num / den.clamp(min=1e-8))[inv]  # (B,)
    adv = torch.where(valid & (count > 1), scores - baseline, torch.zeros_like(scores))
    out = _broadcast(adv, response_mask)
    return out, out


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    f_norm: float = 1.0,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient advantage (Chu et al. 2025, arXiv 2504.02546).

    ``A_i = alpha * (s_i - mean_g) / f_norm`` with ``alpha = B_valid / max(#{valid s_j != 0}, 1)``
    compensating for groups that carry no gradient. ``f_norm`` (kwarg, default 1).
    """
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    inv, g = group_ids(index, scores.device)
    count, mean, _ = group_count_mean_std(scores, inv, g, valid)
    nonzero = (valid & (scores != 0)).to(scores.dtype).sum()
    alpha = valid.to(scores.dtype).sum() / nonzero.clamp(min=1.0)
    adv = alpha * (scores - mean) / f_norm
    adv = torch.where(valid & (count > 1), adv, torch.zeros_like(adv))
    out = _broadcast(adv, response_mask)
    return out, out


@register_adv_est("reinforce_plus_plus", outcome=False)
def compute_reinforce_plus_plus_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted returns, whitened over the batch.

    ``G_t = r_t + gamma G_{t+1}`` (reset after the end of the response),
    ``A = whiten(G)`` over valid tokens of valid samples.
    """
    valid = valid_rows(token_level_rewards.sum(-1), sample_mask)
    rewards = _clean_token_rewards(token_level_rewards, valid)
    with torch.no_grad():
        returns = _reverse_discounted_scan(rewards, response_mask, gamma)
        wmask = response_mask.bool() & valid.unsqueeze(-1)
        adv = masked_whiten(returns, wmask)
    return adv, returns * wmask.to(returns.dtype)


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262): ``s_i - mean_g``, then whitened over the batch.

    Whitening runs over valid tokens of valid samples in groups of >= 2.
    """
    scores, valid = _scores_and_valid(token_level_rewards, sample_mask)
    inv, g = group_ids(index, scores.device)
    count, mean, _ = group_count_mean_std(scores, inv, g, valid)
    use = valid & (count > 1)
    centered = torch.where(use, scores - mean, torch.zeros_like(scores))
    tok = centered.unsqueeze(-1).expand_as(token_level_rewards)  # (B, T)
    wmask = response_mask.bool() & use.unsqueeze(-1)
    adv = masked_whiten(tok, wmask)
    return adv, adv


@register_adv_est("remax", needs=("reward_baselines",))
def compute_remax_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    sample_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505): the greedy response's reward as baseline.

    ``G_t = sum_{t' >= t} r_t'`` and ``A_t = G_t - b`` with ``reward_baselines`` b (B,).
    A failed baseline (non-finite) also zeroes the sample's advantage.
    """
    _require("remax", reward_baselines=reward_baselines)
    assert reward_baselines is not None
    base = reward_baselines.reshape(-1).to(token_level_rewards.dtype)
    valid = valid_rows(token_level_rewards.sum(-1), sample_mask) & torch.isfinite(base)
    rewards = _clean_token_rewards(token_level_rewards, valid)
    base = torch.where(valid, base, torch.zeros_like(base))
    mask = response_mask.to(rewards.dtype)
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)  # (B, T) reward-to-go
    adv = (returns - base.unsqueeze(-1)) * mask
    return adv, returns
