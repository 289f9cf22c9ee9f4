"""Declared needs and who produces them: one table.

Registered algorithm entries declare the batch fields they read beyond rewards, mask and group
ids (``@register_adv_est("gae", needs=("values",))``, ``@register_policy_loss("bypass_mode",
needs=("rollout_log_prob",))``, ``@register_distill_loss("reverse_kl", needs=(...))`` when a
teacher is configured). Every such name has one row in :data:`NEEDS`: the batch field it
names, the stage of the step that produces it, the role that stage requires, and — for fields no
standing stage produces — a producer the step runs after stage 5 (values), before the advantage.

==================  ==================  ==================  =================================
need                batch field         produced by         requires
==================  ==================  ==================  =================================
values              values              5 values (critic)   a critic (``critic.optim.lr > 0``)
old_log_probs       old_log_probs       4 old log-probs     no old-log-prob fusion
sum_pi_squared      sum_pi_squared      4 old log-probs     no fusion; the pass gets the flag
                                        (same pass)         ``calculate_sum_pi_squared``
                                                            (fallback: one log-prob pass)
ref_log_prob        ref_log_prob        4 reference         ``ref.enable`` not False
reward_baselines    reward_baselines    ReMax producer      — (one greedy rollout per prompt,
                                                            scored by the run's reward)
rollout_log_prob    rollout_log_probs   1 rollout           —
proximal_log_prob   old_log_probs       4 old log-probs     not ``bypass_mode``; no
                    (π_prox)            (or the fused       ``rollout_correction.rollout_is``
                                        update's forward)   (the loss weights by π_prox/μ)
rollout_is_weights  rollout_is_weights  6 rollout correct.  ``rollout_correction.rollout_is``
teacher_log_prob    teacher_log_prob    4 teacher           ``distill.teacher_path`` or ``_url``
teacher_topk        teacher_topk_log_   4 teacher (same     ``distill.teacher_path`` or ``_url``
                    probs, _ids         forward, K =        (gkd)
                                        ``distill.topk``)
==================  ==================  ==================  =================================

Config validation calls :func:`check_needs` (a need nothing produces, or whose producer cannot
run under the config, is an error naming the estimator or loss, the need and the fix);
:func:`postrl.config.validate.old_log_prob_fusion_blockers` reads :func:`fusion_blockers`. The
step asks :func:`roles_needed` which workers to build, :func:`log_prob_meta` which flags the
old-log-prob pass gets, and calls :func:`produce_missing` once before the advantage stage.

A producer has the signature ``produce(ctx, prompts, batch) -> (batch, metrics)`` where ``ctx``
is the step context (:class:`NeedContext`); users add rows with :func:`register_need`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from postrl.protocol import DataProto
from postrl.registry import Registry

__all__ = [
    "NEEDS",
    "Need",
    "NeedContext",
    "register_need",
    "required_needs",
    "check_needs",
    "fusion_blockers",
    "roles_needed",
    "log_prob_meta",
    "missing_needs",
    "produce_missing",
    "produce_reward_baselines",
    "produce_sum_pi_squared",
]


class NeedContext(Protocol):
    """What a producer may use from the step (the trainer's step context provides it)."""

    cfg: Any
    """The run's :class:`~postrl.config.PostRLConfig`."""
    reward: Any
    """The reward stage: ``finish(batch) -> (batch, metrics)`` writing ``token_level_scores`` and
    ``sample_valid``."""
    actor: Any
    """The actor worker group: ``compute_log_prob(batch)`` honours ``meta_info`` flags."""

    def generate(self, prompts: DataProto, sampling: Any, n: int, step: int) -> DataProto:
        """Roll out ``n`` samples per prompt on the rollout fleet (waking and sleeping it)."""
        ...

    def sampling_params(self, validation: bool = False) -> Any:
        """The run's :class:`~postrl.rollout.SamplingParams` (training or validation)."""
        ...


Producer = Callable[[Any, DataProto, DataProto], tuple[DataProto, dict[str, float]]]


@dataclass(frozen=True)
class Need:
    """One row of the table: a need name and everything about how it is produced."""

    name: str
    """The name entries declare in ``needs=(...)``."""
    key: str
    """The batch field holding it."""
    stage: str
    """Who produces it (for messages and docs): ``values``, ``old_log_prob``, ``reference``,
    ``teacher``, ``rollout``, ``rollout_correction`` or ``producer``."""
    doc: str
    """What it is, one line."""
    role: str | None = None
    """The worker the producing stage runs on when it is not always built: ``critic``,
    ``reference`` or ``teacher`` (:func:`roles_needed`)."""
    before_update: bool = False
    """Produced by the old-log-prob pass and read before the update: old-log-prob fusion (which
    computes them inside the update) is impossible while it is needed."""
    meta_flag: str | None = None
    """``meta_info`` flag asking the old-log-prob pass to produce it (:func:`log_prob_meta`)."""
    produce: Producer | None = None
    """Run by :func:`produce_missing` when the batch lacks :attr:`key` (None: a stage of the
    step always produces it)."""
    check: Callable[[Any], list[str]] | None = None
    """``check(cfg)`` -> why the producer cannot run under this config, each with the fix."""


NEEDS: Registry[Need] = Registry("batch need")


def register_need(need: Need, *, override: bool = False) -> Need:
    """Add a row to :data:`NEEDS` (an estimator or loss that needs a new field brings its
    producer here; duplicate names raise unless ``override``)."""
    NEEDS.add(need.name, need, override=override)
    return need


# ---------------------------------------------------------------------------- producers
def produce_sum_pi_squared(
    ctx: Any, prompts: DataProto, batch: DataProto
) -> tuple[DataProto, dict[str, float]]:
    """``sum_pi_squared`` (B, R) = ``Σ_v π(v | ·)²`` of each response token under the current
    policy, from one actor log-prob pass.

    The step normally gets it from its old-log-prob pass (``meta_info`` flag of
    :func:`log_prob_meta`, no extra pass); this runs only when that pass did not happen — e.g.
    ``rollout_correction.bypass_mode`` takes old log-probs from the rollout.
    """
    meta = dict(batch.meta_info)
    meta.setdefault("temperature", ctx.cfg.rollout.temperature)
    meta.update(calculate_sum_pi_squared=True, calculate_entropy=False)
    out = ctx.actor.compute_log_prob(
        DataProto(dict(batch.batch), dict(batch.non_tensor_batch), meta)
    )
    if "sum_pi_squared" not in out.batch:
        raise RuntimeError(
            "the actor's compute_log_prob ignored meta_info['calculate_sum_pi_squared']: the "
            "log-prob engine must return batch['sum_pi_squared'] when the flag is set"
        )
    sps = out.batch["sum_pi_squared"]
    return batch.union(DataProto.from_dict({"sum_pi_squared": sps})), {}


def _greedy(sampling: Any) -> Any:
    """The run's sampling parameters made greedy (temperature 0, no filters, no seed)."""
    return dataclasses.replace(sampling, temperature=0.0, top_p=1.0, top_k=-1, seed=None)


def produce_reward_baselines(
    ctx: Any, prompts: DataProto, batch: DataProto
) -> tuple[DataProto, dict[str, float]]:
    """ReMax's baseline (Li et al. 2023, arXiv 2310.10505): one greedy response per prompt,
    scored by the run's own reward, broadcast to every sample of that prompt by ``uid``.

    ``batch["reward_baselines"]`` (B,) is the greedy response's score; a failed score is NaN,
    which the ``remax`` estimator turns into zero advantage for that group. The greedy rollout
    runs on the current (pre-update) weights, like the samples. Needs
    ``batch.meta_info["global_step"]`` (the step's number: group uids are derived from it).

    Metrics: ``remax/baseline_score/mean`` (valid baselines), ``remax/baseline_failed`` (count),
    ``remax/baseline_response_length/mean``.
    """
    if "global_step" not in batch.meta_info:
        raise ValueError(
            "produce_reward_baselines needs batch.meta_info['global_step'] (the step number the "
            "samples were generated with, so the greedy rollout's group uids match): set it "
            "before producing needs"
        )
    step = int(batch.meta_info["global_step"])
    greedy = ctx.generate(prompts, _greedy(ctx.sampling_params(validation=False)), 1, step)
    scored, _ = ctx.reward.finish(greedy)
    score = scored.batch["token_level_scores"].sum(-1).float()  # (P,)
    valid = scored.batch["sample_valid"].bool() & torch.isfinite(score)
    score = torch.where(valid, score, torch.full_like(score, math.nan))
    # matched by dataset row, not uid: an async mode's groups carry their dispatch step's uid
    by_row = {int(i): float(s) for i, s in zip(scored.non_tensor_batch["index"], score.tolist())}
    rows = [int(i) for i in batch.non_tensor_batch["index"]]
    lost = sorted(set(rows) - set(by_row))
    if lost:
        raise RuntimeError(
            f"the greedy baseline rollout produced no row for dataset rows {lost[:5]} "
            f"({len(lost)} of {len(set(rows))}): the prompts must be the batch's own"
        )
    base = torch.tensor([by_row[i] for i in rows], dtype=torch.float32)  # (B,)
    resp_len = scored.batch["response_mask"].sum(-1).float()
    metrics = {
        "remax/baseline_score/mean": float(score[valid].mean()) if bool(valid.any()) else 0.0,
        "remax/baseline_failed": float((~valid).sum()),
        "remax/baseline_response_length/mean": float(resp_len.mean()) if len(resp_len) else 0.0,
    }
    return batch.union(DataProto.from_dict({"reward_baselines": base})), metrics


# ---------------------------------------------------------------------------- the table
def _critic_check(cfg: Any) -> list[str]:
    if cfg.critic.optim.lr > 0:
        return []
    return [
        f"a critic trains it, but critic.optim.lr={cfg.critic.optim.lr}: set critic.optim.lr > 0"
    ]


def _ref_check(cfg: Any) -> list[str]:
    if cfg.ref.enable is False:
        return [
            "the reference policy computes it, but ref.enable=false: set ref.enable=null or true"
        ]
    return []


def _rollout_is_check(cfg: Any) -> list[str]:
    if cfg.algorithm.rollout_correction.rollout_is:
        return []
    return [
        "rollout correction computes it, but algorithm.rollout_correction.rollout_is is unset: "
        "set it to 'token' or 'sequence'"
    ]


def _proximal_check(cfg: Any) -> list[str]:
    """Decoupled PPO's proximal policy must be recomputed, and its π_prox/μ weight is the loss's
    own (a stage-6 weight would apply twice)."""
    rc = cfg.algorithm.rollout_correction
    out = []
    if rc.bypass_mode:
        out.append(
            "algorithm.rollout_correction.bypass_mode=true takes old log-probs from the rollout, "
            "so π_prox would be μ: set algorithm.rollout_correction.bypass_mode=false"
        )
    if rc.rollout_is:
        out.append(
            f"algorithm.rollout_correction.rollout_is={rc.rollout_is!r} would weight the loss by "
            "π_prox/μ a second time: unset it and set actor.policy_loss_kwargs.rollout_is / "
            "rollout_is_threshold (same meaning)"
        )
    return out


for _need in (
    Need(
        "values",
        "values",
        "values",
        "critic values V(s_t) (B, T)",
        role="critic",
        check=_critic_check,
    ),
    Need(
        "old_log_probs",
        "old_log_probs",
        "old_log_prob",
        "log-probs of the sampled tokens under the policy before the update (B, T)",
        before_update=True,
    ),
    Need(
        "sum_pi_squared",
        "sum_pi_squared",
        "old_log_prob",
        "Σ_v π(v|·)² of each response token's next-token distribution (B, T)",
        before_update=True,
        meta_flag="calculate_sum_pi_squared",
        produce=produce_sum_pi_squared,
    ),
    Need(
        "ref_log_prob",
        "ref_log_prob",
        "reference",
        "log-probs under the reference policy (B, T)",
        role="reference",
        check=_ref_check,
    ),
    Need(
        "reward_baselines",
        "reward_baselines",
        "producer",
        "reward of one greedy response per prompt, per sample (B,)",
        produce=produce_reward_baselines,
    ),
    Need("rollout_log_prob", "rollout_log_probs", "rollout", "the sampler's log-probs (B, T)"),
    Need(
        "proximal_log_prob",
        "old_log_probs",
        "old_log_prob",
        "log-probs under the weights at the start of this update (π_prox, B, T): the old-log-"
        "prob pass, or the update's own first forward when it is fused (one mini-batch, one "
        "epoch: the weights have not moved yet, so that forward is exactly π_prox)",
        check=_proximal_check,
    ),
    Need(
        "teacher_log_prob",
        "teacher_log_prob",
        "teacher",
        "log-probs of the sampled tokens under the distillation teacher (B, T)",
        role="teacher",
    ),
    Need(
        "teacher_topk",
        "teacher_topk_log_probs",
        "teacher",
        "the teacher's top-k log-probs and token ids at each response position (B, T, K), "
        "K = distill.topk",
        role="teacher",
    ),
    Need(
        "rollout_is_weights",
        "rollout_is_weights",
        "rollout_correction",
        "truncated importance weights π_old/μ (B, T)",
        check=_rollout_is_check,
    ),
):
    register_need(_need)


# ---------------------------------------------------------------------------- queries
def _declared(cfg: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """(config key, entry name, needs) of the configured estimator, policy loss and — with a
    teacher (``distill.*``) — distillation loss."""
    from postrl.algos import ADV_ESTIMATORS, POLICY_LOSSES
    from postrl.algos.distill import DISTILL_LOSSES

    out = []
    entries = [
        ("algorithm.adv_estimator", ADV_ESTIMATORS, cfg.algorithm.adv_estimator),
        ("actor.policy_loss", POLICY_LOSSES, cfg.actor.policy_loss),
    ]
    if cfg.distill.enabled:
        entries.append(("distill.loss", DISTILL_LOSSES, cfg.distill.loss))
    for key, registry, name in entries:
        if name in registry:  # an unknown name is reported by the registry check
            out.append((key, name, tuple(registry.meta(name).get("needs", ()))))
    return out


def required_needs(cfg: Any) -> list[str]:
    """The needs of the configured estimator and policy loss, in declaration order, once each."""
    seen: dict[str, None] = {}
    for _, _, needs in _declared(cfg):
        seen.update(dict.fromkeys(needs))
    return list(seen)


def reads_proximal(cfg: Any) -> bool:
    """Whether the configured loss treats old log-probs as the proximal policy π_prox and takes
    the behaviour policy μ from the rollout (decoupled PPO): then an off-policy mode may fuse
    the old-log-prob pass into the update, since π_prox is the update's starting weights."""
    return "proximal_log_prob" in required_needs(cfg)


def check_needs(cfg: Any) -> list[str]:
    """Config errors: a declared need no stage produces, or whose producer cannot run here.

    Each message names the config key and entry (``algorithm.adv_estimator='remax'``), the
    need, and the fix.
    """
    errors = []
    for key, name, needs in _declared(cfg):
        for need in needs:
            if need not in NEEDS:
                errors.append(
                    f"{key}={name!r} needs {need!r}, which no stage of the step produces (known "
                    f"needs: {', '.join(NEEDS.names())}): register a producer with "
                    "postrl.trainer.needs.register_need(Need(...)) before the trainer starts, or "
                    f"choose another {key.split('.')[-1]}"
                )
                continue
            row = NEEDS.get(need)
            for why in row.check(cfg) if row.check else ():
                errors.append(f"{key}={name!r} needs {need!r} ({row.doc}): {why}")
    return errors


def fusion_blockers(cfg: Any) -> list[str]:
    """Why old-log-prob fusion is impossible because of declared needs (empty: it is not)."""
    out = []
    for key, name, needs in _declared(cfg):
        early = [n for n in needs if n in NEEDS and NEEDS.get(n).before_update]
        if early:
            out.append(
                f"{key}={name!r} needs {', '.join(early)} before the update (from the "
                "old-log-prob pass)"
            )
    return out


def roles_needed(cfg: Any) -> set[str]:
    """Workers the declared needs require (``critic``, ``reference``, ``teacher``)."""
    return {NEEDS.get(n).role for n in required_needs(cfg) if n in NEEDS and NEEDS.get(n).role}


def log_prob_meta(cfg: Any) -> dict[str, bool]:
    """``meta_info`` flags for the step's old-log-prob pass so it also produces the needs that
    come from the same forward (``{"calculate_sum_pi_squared": True}`` for OTB); keep the
    fields they name when merging that pass's output into the batch."""
    flags = (NEEDS.get(n).meta_flag for n in required_needs(cfg) if n in NEEDS)
    return {f: True for f in flags if f}


def missing_needs(cfg: Any, batch: DataProto) -> list[str]:
    """Declared needs the batch lacks that a producer of the table can make, in order."""
    out = []
    for n in required_needs(cfg):
        row = NEEDS.get(n) if n in NEEDS else None
        if row is not None and row.produce is not None and row.key not in batch.batch:
            out.append(n)
    return out


def produce_missing(
    ctx: Any, prompts: DataProto, batch: DataProto
) -> tuple[DataProto, dict[str, float]]:
    """Run the producer of every declared need the batch lacks (call once after stage 5 —
    values — and before the advantage stage); returns the batch and the producers' metrics."""
    metrics: dict[str, float] = {}
    for need in missing_needs(ctx.cfg, batch):
        batch, m = NEEDS.get(need).produce(ctx, prompts, batch)
        metrics.update(m)
    return batch, metrics
