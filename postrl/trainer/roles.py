"""The worker groups of a run — actor, reference, critic, reward model, distillation teacher —
behind the step's calls.

:func:`build_roles` creates them on ``trainer.backend`` (``local`` or ``ray``) once; the step
talks to :class:`Roles` only. Every stage method returns ``(batch, metrics)`` and is a no-op for
a role the run does not have (no critic, no reference, no teacher, fused old log-probs, dp = 1),
so the step
has no branches on roles.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.config import PostRLConfig
from postrl.engine.minibatch import pad_masked_rows
from postrl.protocol import DataProto
from postrl.protocol.refs import RemoteProto
from postrl.trainer import stages

logger = logging.getLogger(__name__)

__all__ = ["Roles", "TeacherCall", "build_roles", "resolve_fuse_old_log_prob"]

Staged = tuple[DataProto, dict[str, float]]


@dataclass
class TeacherCall:
    """A teacher call in flight (:meth:`Roles.submit_teacher`)."""

    future: Any
    """``.result()`` -> DataProto ``teacher_log_prob`` (…); waits at most the teacher's own
    deadline (a worker group's call timeout, a remote teacher's ``distill.timeout_s``)."""
    t0: float
    """``time.perf_counter()`` at submit."""


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

        # rows by reference carry their lengths in their tags (``seq_len``)
        key = "seq_len" if "seq_len" in batch.batch else "attention_mask"
        return balance_for_dp(batch, self.dp_size, length_key=key)

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
        query = _with_meta(batch, calculate_entropy=True, **flags)  # this pass only
        out = self.actor.compute_log_prob(query)
        if not isinstance(out, DataProto):  # rows by reference: the columns stay on the workers
            return batch.union(out), _metrics_of(out)
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

    def submit_teacher(self, batch: DataProto) -> TeacherCall | None:
        """Stage 4, first: hand the sampled tokens to the distillation teacher without waiting
        (``submit``: a Ray group or a remote teacher works while the old-log-prob and reference
        passes run here; an in-process group answers at once). None without a teacher."""
        if self.teacher is None:
            return None
        query = batch.select(["input_ids", "attention_mask", "responses"], [])
        t0 = time.perf_counter()
        return TeacherCall(self.teacher.submit("compute_teacher_log_prob", query), t0)

    def teacher_log_probs(self, batch: DataProto, call: TeacherCall | None = None) -> Staged:
        """Stage 4, last: the distillation teacher's log-probs of the sampled tokens
        (``teacher_log_prob``, and its top-k for gkd) joined into the batch. Metrics:
        ``timing_s/teacher`` (submit to answer) and ``timing_s/teacher_wait`` (how long the step
        waited for it after its own stage-4 passes; absent without a teacher)."""
        call = call if call is not None else self.submit_teacher(batch)
        if call is None:
            return batch, {}
        t_wait = time.perf_counter()
        out = call.future.result()  # the teacher's own deadline (group timeouts, timeout_s)
        t1 = time.perf_counter()
        metrics = {"timing_s/teacher": t1 - call.t0, "timing_s/teacher_wait": t1 - t_wait}
        return batch.union(out), metrics

    def values(self, batch: DataProto) -> Staged:
        """Stage 5: critic values (GAE runs only)."""
        if self.critic is None:
            return batch, {}
        return batch.union(self.critic.compute_values(batch)), {}

    def update_critic(self, batch: DataProto) -> Staged:
        """Stage 7: one critic update (padding rows masked, as for the actor)."""
        if self.critic is None:
            return batch, {}
        out = self.critic.update_critic(_padded(batch, self.dp_size))
        return batch, _metrics_of(out)

    def update_actor(self, batch: DataProto) -> Staged:
        """Stage 7: one actor update; returns the batch with what the update used.

        A fused update (batch without ``old_log_probs``) returns the old log-probs it computed;
        they join the batch here, and the rollout-vs-training mismatch metrics are measured on
        them (their one pass: with fusion no correction runs before the update) — over the rows
        it ran, when ``actor.skip_zero_advantage`` left rows out.
        """
        out = self.actor.update_actor(_padded(batch, self.dp_size))
        metrics = _metrics_of(out)
        if isinstance(out, DataProto) and "old_log_probs" in out.batch:
            old = out.batch["old_log_probs"][: len(batch)]
            batch = batch.union(DataProto.from_dict({"old_log_probs": old}))
            rc_cfg = self.cfg.algorithm.rollout_correction
            if "update_trained" in out.batch:  # (actor.skip_zero_advantage) measured on the
                ran = out.batch["update_trained"][: len(batch)]  # rows the update ran
                b = dict(batch.batch)
                b["response_mask"] = b["response_mask"] * ran[:, None].to(b["response_mask"].dtype)
                _, rc = stages.rollout_correction_stage(
                    DataProto(b, batch.non_tensor_batch, batch.meta_info), rc_cfg
                )
            else:
                batch, rc = stages.rollout_correction_stage(batch, rc_cfg)
            metrics.update(rc)
        return batch, metrics

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
    if isinstance(out, list) and out and isinstance(out[0], RemoteProto):  # rows by reference
        m = dict(out[0].meta_info.get("metrics", {}))  # the same on every rank (all-reduced)
        local: dict[str, list[float]] = {}  # each rank's shard: averaged
        for o in out:
            for k, v in o.meta_info.get("local", {}).items():
                local.setdefault(k, []).append(float(v))
        return {**m, **{k: sum(v) / len(v) for k, v in local.items()}}
    if isinstance(out, list):  # one dict per collected rank: identical after all-reduce
        return dict(out[0])
    return dict(out)


def _with_meta(batch: Any, **meta: Any) -> Any:
    """``batch`` with ``meta`` added to a copy of its ``meta_info`` (the tensors shared)."""
    if isinstance(batch, DataProto):
        return DataProto(batch.batch, batch.non_tensor_batch, {**batch.meta_info, **meta})
    return dataclasses.replace(batch, meta_info={**batch.meta_info, **meta})


def _padded(batch: Any, dp: int) -> Any:
    """``batch`` padded to whole dp shards with masked rows (rows by reference pad their own
    shards: :meth:`~postrl.trainer.ref_batch.RefBatch.ref_shards`)."""
    return pad_masked_rows(batch, dp) if isinstance(batch, DataProto) else batch


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
