"""The driver-side stages of one RL step that are plain functions of the batch.

Each stage takes the batch and returns a new one plus metrics; the trainer's ``step`` calls them
in DESIGN.md's order. Nothing here special-cases an algorithm name: estimators declare what they
need in their registry metadata.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from postrl.algos import (
    ADV_ESTIMATORS,
    apply_kl_penalty,
    compute_rollout_correction,
    filter_groups,
    get_adv_estimator,
    overlong_reward_penalty,
)
from postrl.protocol import DataProto
from postrl.reward import RewardRequest, RewardResult
from postrl.reward.types import SampleScore, classify, failed

logger = logging.getLogger(__name__)

__all__ = [
    "decode_responses",
    "make_reward_request",
    "apply_reward_result",
    "reward_model_result",
    "compute_advantage_stage",
    "rollout_correction_stage",
    "kl_in_reward_stage",
    "dynamic_sampling_stage",
]


def decode_responses(tokenizer: Any, batch: DataProto) -> list[str]:
    """Decode every response (padding stripped; special tokens skipped)."""
    responses = batch.batch["responses"]
    lengths = batch.batch["attention_mask"][:, -responses.shape[1] :].sum(-1).tolist()
    ids = [row[:n] for row, n in zip(responses.tolist(), lengths)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def make_reward_request(
    tokenizer: Any, response_ids: list[int], row: dict[str, Any]
) -> RewardRequest:
    """The reward request of one finished trajectory (used for streaming submission)."""
    return RewardRequest(
        data_source=str(row["data_source"]),
        solution_str=tokenizer.decode(response_ids, skip_special_tokens=True),
        ground_truth=row["ground_truth"],
        extra_info=dict(row.get("extra_info") or {}),
        uid=row.get("uid"),
    )


def reward_model_result(
    rm_scores: torch.Tensor, uids: list[Any], rule: RewardResult | None = None
) -> RewardResult:
    """The reward of each row from reward-model scores (B,): the score itself (``reward.model.mode
    =replace``) or ``rule`` + score (``add``). A non-finite reward-model score is a failed sample
    (``nan``), never a number; a row whose rule reward failed stays failed."""
    samples: list[SampleScore] = []
    for i, v in enumerate(rm_scores.tolist()):
        rm = classify(v)
        if rule is None:
            samples.append(rm)
            continue
        extra = {k: vals[i] for k, vals in rule.extra.items() if vals[i] is not None}
        if not bool(rule.valid[i]):
            samples.append(failed(rule.failure_reason[i], rule.failure_detail[i], extra))
        elif not rm.valid:
            samples.append(failed(rm.reason, f"reward model: {rm.detail}", extra))
        else:
            samples.append(SampleScore(float(rule.scores[i]) + rm.score, None, None, extra))
    return RewardResult.from_samples(samples, uids)


def apply_reward_result(
    batch: DataProto,
    result: RewardResult,
    overlong: Any | None = None,
    max_response_length: int | None = None,
) -> tuple[DataProto, dict[str, float]]:
    """Write ``token_level_scores`` (score on the last response token) and ``sample_valid``.

    Failed samples keep a 0 placeholder that no estimator reads: they are excluded from their
    group's baseline via ``sample_valid`` and their ``response_mask`` is zeroed (no loss).

    With ``overlong.enable`` (DAPO soft overlong punishment) the penalty ramps over the last
    ``overlong.buffer_len`` tokens before ``max_response_length`` — the *configured* maximum
    (``rollout.response_length``), passed here or as ``meta_info["max_response_length"]``. The
    batch's own width cannot stand in for it: responses are padded to the longest one of the
    batch, so a batch of short answers would be punished for lengths far below the limit.
    """
    b = dict(batch.batch)
    R = b["responses"].shape[1]
    resp_len = b["attention_mask"][:, -R:].sum(-1)  # (B,)
    scores = result.scores.clone()
    metrics = dict(result.metrics)
    if overlong is not None and getattr(overlong, "enable", False):
        max_len = (
            max_response_length
            if max_response_length is not None
            else batch.meta_info.get("max_response_length")
        )
        if max_len is None:
            raise ValueError(
                "reward.overlong.enable=True needs the configured maximum response length: call "
                "apply_reward_result(..., max_response_length=cfg.rollout.response_length) or set "
                "batch.meta_info['max_response_length'] (the padded batch width is not the limit)"
            )
        penalty = overlong_reward_penalty(
            resp_len, int(max_len), overlong.buffer_len, overlong.penalty_factor
        )
        scores = scores + penalty.to(scores.dtype)
        metrics["reward/overlong_penalty/mean"] = float(penalty.float().mean())
    tls = torch.zeros_like(b["responses"], dtype=torch.float32)
    last = (resp_len - 1).clamp(min=0)
    tls[torch.arange(tls.shape[0]), last] = scores
    valid = result.valid.clone()
    b["token_level_scores"] = tls
    b["sample_valid"] = valid
    b["response_mask"] = b["response_mask"] * valid[:, None].to(b["response_mask"].dtype)
    out = DataProto(b, dict(batch.non_tensor_batch), dict(batch.meta_info))
    for k, vals in result.extra.items():
        nums = [float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if nums:
            metrics[f"reward/extra/{k}/mean"] = sum(nums) / len(nums)
    return out, metrics


def kl_in_reward_stage(
    batch: DataProto, kl_ctrl: Any, kl_penalty: str
) -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = scores − β·KL(π_old‖π_ref) (Ziegler et al. 2019); updates the controller."""
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
    current_kl = metrics.get("actor/reward_kl_penalty", metrics.get("critic/kl", 0.0))
    kl_ctrl.update(current_kl, n_steps=len(batch))
    metrics["actor/reward_kl_penalty_coeff"] = float(kl_ctrl.value)
    return DataProto(b, batch.non_tensor_batch, batch.meta_info), metrics


def rollout_correction_stage(batch: DataProto, rc: Any) -> tuple[DataProto, dict[str, float]]:
    """Truncated IS weights / rejection on rollout-vs-train log-probs + their health metrics.

    The metrics are always computed when rollout log-probs exist (they cost one pass over the
    batch) so a silent training/inference mismatch is visible even with correction off.
    """
    b = dict(batch.batch)
    if "rollout_log_probs" not in b or "old_log_probs" not in b:
        return batch, {}
    weights, mask, m = compute_rollout_correction(
        b["old_log_probs"],
        b["rollout_log_probs"],
        b["response_mask"],
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
        rollout_rs_threshold_lower=rc.rollout_rs_threshold_lower,
    )
    b["response_mask"] = mask.to(b["response_mask"].dtype)
    if weights is not None:
        b["rollout_is_weights"] = weights
    return DataProto(b, batch.non_tensor_batch, batch.meta_info), {
        k: float(v) for k, v in m.items()
    }


def compute_advantage_stage(batch: DataProto, algo: Any) -> DataProto:
    """Run the configured estimator; inputs are chosen by the estimator's declared needs."""
    name = algo.adv_estimator
    fn = get_adv_estimator(name)
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
                f"advantage estimator {name!r} needs batch[{need!r}], which the step did not produce"
            )
        kwargs[need] = b[need]
    advantages, returns = fn(**kwargs)
    b["token_level_rewards"] = rewards
    b["advantages"] = advantages
    b["returns"] = returns
    return DataProto(b, batch.non_tensor_batch, batch.meta_info)


def dynamic_sampling_stage(batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    """DAPO dynamic sampling: drop whole groups whose valid rewards are all equal."""
    scores = batch.batch["token_level_scores"].sum(-1)
    keep, m = filter_groups(
        scores,
        np.asarray(batch.non_tensor_batch["uid"]),
        sample_mask=batch.batch.get("sample_valid"),
    )
    metrics = {f"dynamic_sampling/{k}": float(v) for k, v in m.items()}
    metrics["dynamic_sampling/skipped_update"] = 0.0
    if bool(keep.all()):
        return batch, metrics
    if not bool(keep.any()):
        # An empty batch cannot be dispatched to the workers (and a step without rows has nothing
        # to learn): keep the rows but mask every token, so the engines drop them and take no
        # optimizer step, while the step's bookkeeping still runs.
        logger.warning(
            "dynamic sampling dropped every group this step (all rewards equal within groups); "
            "skipping the update — raise data.train_batch_size or rollout.n if this is frequent"
        )
        b = dict(batch.batch)
        b["response_mask"] = torch.zeros_like(b["response_mask"])
        metrics["dynamic_sampling/skipped_update"] = 1.0
        return DataProto(b, batch.non_tensor_batch, batch.meta_info), metrics
    return batch[keep], metrics
