"""The worker groups of a run — actor, reference, critic, reward model, distillation teacher —
behind the step's calls.

:func:`build_roles` creates them on ``trainer.backend`` (``local`` or ``ray``) once; the step
talks to :class:`Roles` only. Every stage method returns ``(batch, metrics)`` and is a no-op for
a role the run does not have (no critic, no reference, no teacher, fused old log-probs, dp = 1),
so the step
has no branches on roles.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.config import PostRLConfig
from postrl.engine.minibatch import pad_masked_rows
from postrl.protocol import DataProto
from postrl.trainer import stages

logger = logging.getLogger(__name__)

__all__ = ["Roles", "build_roles", "resolve_fuse_old_log_prob"]

Staged = tuple[DataProto, dict[str, float]]


@dataclass
class Roles:
    """Worker groups of one run (None where the run has no such role)."""

    cfg: PostRLConfig
    actor: Any
    ref: Any = None
    critic: Any = None
    reward_model: Any = None
    """Worker group of ``RewardModelWorker`` when ``reward.model.enable`` (else None)."""
    teacher: Any = None
    """The distillation teacher (``distill.*``): a ``TeacherWorker`` group or a remote client,
    both answering ``compute_teacher_log_prob`` (:func:`postrl.trainer.teacher.build_teacher`)."""
    dp_size: int = 1
    use_lora_ref: bool = False
    """The reference is the actor with its LoRA adapters off (no reference group)."""
    fuse_old_log_prob: bool = False
    """Old log-probs come from the actor update's own forward (``actor.fuse_old_log_prob``)."""

    @property
    def use_ref(self) -> bool:
        """Whether reference log-probs are computed."""
        return self.ref is not None or self.use_lora_ref

    # --- stages ---------------------------------------------------------------------
    def balance(self, batch: DataProto) -> Staged:
        """Stage 3: Karmarkar-Karp reorder so every dp rank gets the same token load."""
        if not self.cfg.trainer.balance_batch or self.dp_size == 1:
            return batch, {}
        from postrl.controller import balance_for_dp

        return balance_for_dp(batch, self.dp_size)

    def old_log_probs(self, batch: DataProto) -> Staged:
        """Stage 4: recompute old log-probs, reuse the rollout's (bypass mode), or nothing when
        the update computes them itself (fused)."""
        if self.fuse_old_log_prob:
            return batch, {}
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            old = {"old_log_probs": batch.batch["rollout_log_probs"]}
            return batch.union(DataProto.from_dict(old)), {}
        from postrl.trainer.needs import log_prob_meta

        flags = log_prob_meta(self.cfg)  # needs from the same forward (e.g. sum_pi_squared)
        query = DataProto(batch.batch, batch.non_tensor_batch, dict(batch.meta_info))
        query.meta_info.update(calculate_entropy=True, **flags)  # this pass only, not the ref's
        out = self.actor.compute_log_prob(query)
        metrics: dict[str, float] = {}
        if "entropys" in out.batch:
            ent, mask = out.batch.pop("entropys"), batch.batch["response_mask"].float()
            metrics["actor/entropy_old"] = float((ent * mask).sum() / mask.sum().clamp(min=1))
        keep = ["old_log_probs"] + [k for k in ("sum_pi_squared",) if k in out.batch]
        return batch.union(out.select(keep, [], [])), metrics

    def ref_log_probs(self, batch: DataProto) -> Staged:
        """Stage 4: reference log-probs (the reference group, or the actor with LoRA off)."""
        if not self.use_ref:
            return batch, {}
        group = self.actor if self.use_lora_ref else self.ref
        return batch.union(group.compute_ref_log_prob(batch)), {}

    def teacher_log_probs(self, batch: DataProto) -> Staged:
        """Stage 4: the distillation teacher's log-probs of the sampled tokens
        (``teacher_log_prob``), timed as ``timing_s/teacher`` (absent without a teacher)."""
        if self.teacher is None:
            return batch, {}
        t0 = time.perf_counter()
        out = self.teacher.compute_teacher_log_prob(batch)
        return batch.union(out), {"timing_s/teacher": time.perf_counter() - t0}

    def values(self, batch: DataProto) -> Staged:
        """Stage 5: critic values (GAE runs only)."""
        if self.critic is None:
            return batch, {}
        return batch.union(self.critic.compute_values(batch)), {}

    def update_critic(self, batch: DataProto) -> Staged:
        """Stage 7: one critic update (padding rows masked, as for the actor)."""
        if self.critic is None:
            return batch, {}
        out = self.critic.update_critic(pad_masked_rows(batch, self.dp_size))
        return batch, _metrics_of(out)

    def update_actor(self, batch: DataProto) -> Staged:
        """Stage 7: one actor update; returns the batch with what the update used.

        A fused update (batch without ``old_log_probs``) returns the old log-probs it computed;
        they join the batch here, and the rollout-vs-training mismatch metrics are measured on
        them (their one pass: with fusion no correction runs before the update).
        """
        out = self.actor.update_actor(pad_masked_rows(batch, self.dp_size))
        metrics = _metrics_of(out)
        if isinstance(out, DataProto) and "old_log_probs" in out.batch:
            old = out.batch["old_log_probs"][: len(batch)]
            batch = batch.union(DataProto.from_dict({"old_log_probs": old}))
            batch, rc = stages.rollout_correction_stage(
                batch, self.cfg.algorithm.rollout_correction
            )
            metrics.update(rc)
        return batch, metrics

    def update_from_refs(self, batch: Any, advantages: Any) -> dict[str, float]:
        """Stages 3-7 for a :class:`~postrl.trainer.object_store.RefBatch` (object-store data
        plane): balance the rows over the dp ranks from their tagged lengths, pad the last
        shard with masked copies, and let each rank fetch, pad and train its shard
        (``ActorWorker.update_actor_from_refs``; reference log-probs for a KL loss come from the
        reference ranks' same shards through the object store, or from the actor with its LoRA
        adapters off). Shard-local metrics (old-log-prob entropy,
        rollout correction, health) are averaged over ranks."""
        from postrl.protocol.balance import balanced_permutation
        from postrl.trainer.needs import log_prob_meta

        cfg, dp, n = self.cfg, self.dp_size, len(batch)
        metrics: dict[str, float] = {}
        order = list(range(n))
        if cfg.trainer.balance_batch and dp > 1:
            lens = (batch.scalars["prompt_len"] + batch.scalars["response_len"]).astype(int)
            perm, metrics = balanced_permutation(lens.tolist(), dp)
            order = perm.tolist()
        pad = (-n) % dp
        picks = order + [order[i % n] for i in range(pad)]  # batch row of each shard slot
        masked = [False] * n + [True] * pad
        size = len(picks) // dp
        shards = [range(r * size, (r + 1) * size) for r in range(dp)]
        rc = cfg.algorithm.rollout_correction
        meta = {
            "meta_info": {
                "temperature": cfg.rollout.temperature,
                "global_step": batch.meta_info.get("global_step", 0),
            },
            "fused": self.fuse_old_log_prob,
            "bypass": bool(rc.bypass_mode),
            "log_prob_flags": log_prob_meta(cfg),
            "correction": stages.correction_kwargs(rc),
            "timeout_s": cfg.trainer.async_.timeout_s,
        }
        adv = advantages.tolist()
        refs = [[batch.refs[picks[j]] for j in s] for s in shards]
        offsets = [[batch.rows[picks[j]] for j in s] for s in shards]
        pads = [[masked[j] for j in s] for s in shards]
        metas = [meta] * dp
        if self.use_lora_ref:  # the actor computes them with its adapters off
            metas = [{**meta, "ref": "lora"}] * dp
        elif self.ref is not None:  # each reference rank stores its shard's; the actor's fetches
            stored = self.ref.compute_ref_log_prob_from_refs(refs, offsets, pads, metas)
            metas = [{**meta, "ref": r[0]} for r in stored]
        out = self.actor.update_actor_from_refs(
            refs, offsets, [[adv[picks[j]] for j in s] for s in shards], pads, metas
        )
        metrics.update(out[0]["update"])
        local: dict[str, list[float]] = {}
        for o in out:
            for k, v in o["local"].items():
                local.setdefault(k, []).append(float(v))
        metrics.update({k: sum(v) / len(v) for k, v in local.items()})
        return metrics

    # --- checkpoints ------------------------------------------------------------------
    def save(self, ckpt_dir: Path) -> None:
        """Write the actor's (and critic's) weights and optimizer state under ``ckpt_dir``."""
        self.actor.save_checkpoint(str(ckpt_dir / "actor"))
        if self.critic is not None:
            self.critic.save_checkpoint(str(ckpt_dir / "critic"))

    def load(self, ckpt_dir: Path) -> None:
        """Restore what :meth:`save` wrote."""
        self.actor.load_checkpoint(str(ckpt_dir / "actor"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(ckpt_dir / "critic"))

    def close(self) -> None:
        """Shut every worker group down."""
        for obj in (self.actor, self.ref, self.critic, self.reward_model, self.teacher):
            if obj is not None and hasattr(obj, "shutdown"):
                obj.shutdown()


def _metrics_of(out: Any) -> dict[str, float]:
    if isinstance(out, DataProto):
        return dict(out.meta_info.get("metrics", {}))
    if isinstance(out, list):  # one dict per collected rank: identical after all-reduce
        return dict(out[0])
    return dict(out)


def build_roles(
    cfg: PostRLConfig,
    total_steps: int,
    *,
    use_ref: bool,
    use_critic: bool,
    use_teacher: bool = False,
) -> Roles:
    """Create the worker groups on ``trainer.backend`` (the teacher when the declared needs
    require one: :func:`postrl.trainer.needs.roles_needed`)."""
    from postrl.controller import create_worker_group
    from postrl.trainer.teacher import build_teacher
    from postrl.workers import ActorWorker, CriticWorker, RefWorker, RewardModelWorker

    tc = cfg.trainer
    dp = tc.num_workers if tc.backend == "ray" else 1
    common = dict(world_size=dp, init_dist=dp > 1) if tc.backend == "ray" else dict(world_size=1)
    kwargs = {"cfg": cfg, "total_steps": total_steps}

    def group(cls: type, name: str) -> Any:
        return create_worker_group(tc.backend, cls, kwargs=kwargs, name=name, **common)

    use_lora_ref = use_ref and cfg.model.lora_rank > 0
    return Roles(
        cfg,
        group(ActorWorker, "actor"),
        ref=group(RefWorker, "ref") if use_ref and not use_lora_ref else None,
        critic=group(CriticWorker, "critic") if use_critic else None,
        reward_model=group(RewardModelWorker, "reward_model") if cfg.reward.model.enable else None,
        teacher=build_teacher(cfg, group) if use_teacher else None,
        dp_size=dp,
        use_lora_ref=use_lora_ref,
        fuse_old_log_prob=resolve_fuse_old_log_prob(cfg),
    )


def resolve_fuse_old_log_prob(cfg: PostRLConfig) -> bool:
    """``actor.fuse_old_log_prob`` resolved: None = on exactly when nothing blocks it."""
    from postrl.config.validate import old_log_prob_fusion_blockers

    setting = cfg.actor.fuse_old_log_prob
    return not old_log_prob_fusion_blockers(cfg) if setting is None else bool(setting)
