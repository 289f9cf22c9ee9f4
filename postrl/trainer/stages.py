"""The driver-side stages of one RL step that are plain functions of the batch.

Each stage takes the batch and returns ``(batch, metrics)``; the trainer's ``step`` calls them in
DESIGN.md's order: dynamic sampling (after the reward), the advantage stage (6: KL in the reward,
rollout correction, the estimator) and the step's bookkeeping metrics (9). Nothing here
special-cases an algorithm name: estimators declare what they need in their registry metadata.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from postrl.algos import (
    ADV_ESTIMATORS,
    apply_kl_penalty,
    bind_adv_estimator,
    rollout_correction_with_health,
)
from postrl.protocol import DataProto
from postrl.protocol.layout import concat_rollouts, segment_parents
from postrl.trainer.metrics import compute_data_metrics, compute_throughput_metrics
from postrl.trainer.ref_batch import RefBatch, outcome_advantages, tag_step_metrics

logger = logging.getLogger(__name__)

__all__ = [
    "advantage_stage",
    "downsample_stage",
    "concat_rollouts",
    "step_metrics",
    "compute_advantage_stage",
    "rollout_correction_stage",
    "kl_in_reward_stage",
    "row_scores",
]


def kl_in_reward_stage(
    batch: DataProto, kl_ctrl: Any, kl_penalty: str
) -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = scores − β·KL(π_old‖π_ref) (Ziegler et al. 2019); updates the
    controller."""
    b = dict(batch.batch)
    rewards, m = apply_kl_penalty(
        b["token_level_scores"],
        b["old_log_probs"],
        b["ref_log_prob"],
        b["response_mask"],
        kl_coef=kl_ctrl.value,
        kl_penalty=kl_penalty,
    )
    b["token_level_rewards"] = rewards
    metrics = {k: float(v) for k, v in m.items()}
    kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(batch))
    metrics["actor/reward_kl_penalty_coeff"] = float(kl_ctrl.value)
    return DataProto(b, batch.non_tensor_batch, batch.meta_info), metrics


def rollout_correction_stage(batch: DataProto, rc: Any) -> tuple[DataProto, dict[str, float]]:
    """Truncated IS weights / rejection on rollout-vs-train log-probs + their health metrics
    (``rollout_corr/*``, and the token-level ``health/ess_ratio``, ``health/chi2``,
    ``health/kl_behav_prox`` of :func:`~postrl.algos.off_policy_health` that
    ``trainer.health.*`` alerts on).

    The metrics are always computed when rollout log-probs exist (they cost one pass over the
    batch) so a silent training/inference mismatch is visible even with correction off.
    """
    if isinstance(batch, RefBatch):  # the tensors are on the workers: the update applies it
        meta = {**batch.meta_info, "rollout_correction": correction_kwargs(rc)}
        return dataclasses.replace(batch, meta_info=meta), {}
    b = dict(batch.batch)
    if "rollout_log_probs" not in b or "old_log_probs" not in b:
        return batch, {}
    weights, b["response_mask"], metrics = rollout_correction_with_health(
        b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], **correction_kwargs(rc)
    )
    if weights is not None:
        b["rollout_is_weights"] = weights
    return DataProto(b, batch.non_tensor_batch, batch.meta_info), metrics


def correction_kwargs(rc: Any) -> dict[str, Any]:
    """``compute_rollout_correction``'s keyword arguments from ``algorithm.rollout_correction``."""
    return dict(
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
        rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower,
    )


def compute_advantage_stage(batch: DataProto, algo: Any) -> DataProto:
    """Run the configured estimator (``algorithm.adv_estimator_kwargs`` bound); inputs are
    chosen by the estimator's declared ``needs`` (required) and ``optional`` fields (passed when
    the batch has them, e.g. ``rollout_is_weights``)."""
    name = algo.adv_estimator
    fn = _bound_estimator(name, algo.adv_estimator_kwargs)
    b = dict(batch.batch)
    rewards = b.get("token_level_rewards", b["token_level_scores"])
    kwargs: dict[str, Any] = dict(
        token_level_rewards=rewards,
        response_mask=b["response_mask"],
        index=np.asarray(batch.non_tensor_batch["uid"]),
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        sample_mask=b.get("sample_valid"),
    )
    for need in ADV_ESTIMATORS.meta(name).get("needs", ()):
        if need not in b:
            raise KeyError(
                f"advantage estimator {name!r} needs batch[{need!r}], "
                "which the step did not produce"
            )
        kwargs[need] = b[need]
    for opt in ADV_ESTIMATORS.meta(name).get("optional", ()):
        if opt in b:
            kwargs[opt] = b[opt]
    parents = segment_parents(batch.non_tensor_batch)
    if parents is None:
        advantages, returns = fn(**kwargs)
    else:
        advantages, returns = _advantage_with_segments(fn, kwargs, parents)
    b["token_level_rewards"] = rewards
    b["advantages"] = advantages
    b["returns"] = returns
    return DataProto(b, batch.non_tensor_batch, batch.meta_info)


def _advantage_with_segments(
    fn: Any, kwargs: dict[str, Any], parents: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator over the trajectories' own rows only (segment rows are not samples of a
    group), then every segment row takes its trajectory's sequence advantage: the mean of the
    trajectory row's advantages (returns) over its response tokens, on the segment's tokens.
    Exact for outcome estimators (one advantage per sequence: GRPO, RLOO, REINFORCE++, ...);
    for per-token estimators (GAE) it is the sequence average."""
    own = [i for i, p in enumerate(parents) if p == i]
    sel = torch.as_tensor(own, dtype=torch.long)
    sub = {
        k: (v[sel] if isinstance(v, torch.Tensor) else v[own] if isinstance(v, np.ndarray) else v)
        for k, v in kwargs.items()
    }
    adv_own, ret_own = fn(**sub)  # (P, R) each
    mask = kwargs["response_mask"].to(adv_own.dtype)  # (B, R)
    m_own = mask[sel]
    denom = m_own.sum(-1).clamp(min=1)  # (P,)
    seq_adv, seq_ret = (adv_own * m_own).sum(-1) / denom, (ret_own * m_own).sum(-1) / denom
    where = {row: j for j, row in enumerate(own)}
    pos = torch.as_tensor([where[p] for p in parents], dtype=torch.long)  # (B,)
    advantages = seq_adv[pos].unsqueeze(-1) * mask  # (B, R)
    returns = seq_ret[pos].unsqueeze(-1) * mask
    advantages[sel], returns[sel] = adv_own, ret_own
    return advantages, returns


_BOUND: dict[tuple[str, str], Any] = {}


def _bound_estimator(name: str, hparams: dict[str, Any]) -> Any:
    """The estimator with its hyperparameters bound, once per (name, hyperparameters)."""
    import json

    key = (name, json.dumps(hparams, sort_keys=True, default=str))
    if key not in _BOUND:
        _BOUND[key] = bind_adv_estimator(name, hparams)
    return _BOUND[key]


def advantage_stage(batch: DataProto, ctx: Any, kl_ctrl: Any) -> tuple[DataProto, dict[str, float]]:
    """Stage 6: the producers of declared needs the batch still lacks (``trainer/needs.py``:
    e.g. ReMax's greedy baseline), KL in the reward (``algorithm.use_kl_in_reward``), rollout
    correction (IS weights / rejection + health metrics, when old log-probs exist before the
    update), the configured estimator, then the distillation term (``distill.*``: a no-op
    without teacher log-probs)."""
    from postrl.trainer.needs import missing_needs, produce_missing
    from postrl.trainer.teacher import distill_stage

    algo = ctx.cfg.algorithm
    metrics: dict[str, float] = {}
    if missing_needs(ctx.cfg, batch):
        batch, metrics = produce_missing(ctx, ctx.prompts_of(batch), batch)
    if algo.use_kl_in_reward:
        batch, km = kl_in_reward_stage(batch, kl_ctrl, algo.kl_penalty)
        metrics.update(km)
    batch, cm = rollout_correction_stage(batch, algo.rollout_correction)
    metrics.update(cm)
    if isinstance(batch, RefBatch):  # rows by reference: an outcome estimator on the tags
        adv, am = outcome_advantages(batch, algo)  # (one value per row: the same numbers)
        metrics.update(am)
        return batch.with_row_values(advantages=adv.numpy(), returns=adv.numpy()), metrics
    batch, dm = distill_stage(compute_advantage_stage(batch, algo), ctx.cfg)
    metrics.update(dm)
    return batch, metrics


def downsample_stage(batch: DataProto, cfg: Any, step: int) -> tuple[DataProto, dict[str, float]]:
    """After the reward: keep ``algorithm.downsample.size`` responses of each group (PODS,
    ``algos/downsample.py``), so the log-prob recomputes, the advantage and the update see only
    them. A no-op unless ``algorithm.downsample.enable``. Metrics ``downsample/*``: samples in
    and kept, the mean score of all generated and of the kept responses, and the share of kept
    groups whose rewards still differ (a group with any signal keeps it)."""
    ds = cfg.algorithm.downsample
    if not ds.enable:
        return batch, {}
    from postrl.algos.downsample import downsample_groups
    from postrl.algos.utils import group_ids

    scores = batch.batch["token_level_scores"].sum(-1)
    valid = batch.batch.get("sample_valid")
    inv, g = group_ids(np.asarray(batch.non_tensor_batch["uid"]))
    gen = torch.Generator().manual_seed(int(cfg.trainer.seed) * 1_000_003 + step)
    rows = downsample_groups(scores, inv, g, ds.size, ds.rule, valid=valid, generator=gen)
    kept = batch[rows]
    ks = scores[rows].reshape(g, ds.size)
    return kept, {
        "downsample/generated_samples": float(len(batch)),
        "downsample/kept_samples": float(len(kept)),
        "downsample/score_mean_generated": float(scores.float().mean()),
        "downsample/score_mean_kept": float(ks.float().mean()),
        "downsample/groups_with_signal": float((ks.amax(1) > ks.amin(1)).float().mean()),
    }


def step_metrics(batch: DataProto, cfg: Any, step_seconds: float, dp_size: int) -> dict[str, float]:
    """Stage 9: data, agent and throughput metrics of the trained batch (of a
    :class:`~postrl.trainer.ref_batch.RefBatch`: the same names, from its tags)."""
    if isinstance(batch, RefBatch):
        return tag_step_metrics(batch, cfg, step_seconds, dp_size)
    m: dict[str, Any] = dict(compute_data_metrics(batch, cfg.rollout.response_length))
    m.update(_agent_metrics(batch))
    m.update(compute_throughput_metrics(batch, step_seconds, dp_size))
    return m


def row_scores(batch: Any) -> list[float]:
    """Each row's score (the sum of its ``token_level_scores``; a
    :class:`~postrl.trainer.ref_batch.RefBatch`'s tags hold the same sums)."""
    if isinstance(batch, RefBatch):
        return batch.scalars["score"].tolist()
    return batch.batch["token_level_scores"].sum(-1).tolist()


def _agent_metrics(batch: DataProto) -> dict[str, float]:
    nt = batch.non_tensor_batch
    out: dict[str, float] = {}
    if "num_turns" in nt and len(nt["num_turns"]):
        turns = np.asarray(nt["num_turns"], dtype=np.float64)
        out["agent/num_turns/mean"] = float(turns.mean())
    agg: dict[str, list[float]] = {}
    for d in nt.get("agent_metrics", []):
        for k, v in (d or {}).items():
            agg.setdefault(k, []).append(float(v))
    for k, vals in agg.items():
        out[k if k.startswith("agent/") else f"agent/{k}"] = sum(vals) / len(vals)
    if "finish_reason" in nt:
        reasons = list(nt["finish_reason"])
        out["response/finish_abort_ratio"] = reasons.count("abort") / max(len(reasons), 1)
    return out
