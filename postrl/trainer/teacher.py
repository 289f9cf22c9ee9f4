"""The teacher of on-policy distillation (``distill.*``): built, checked and applied.

- :func:`build_teacher` — a frozen :class:`~postrl.workers.teacher.TeacherWorker` group on
  ``trainer.backend`` (``distill.teacher_path``) or a :class:`~postrl.rollout.teacher.
  RemoteTeacher` (``distill.teacher_url``); both answer ``compute_teacher_log_prob(batch)``.
- :func:`check_teacher_tokenizer` — at startup, before any model is loaded: teacher and student
  must share the tokenizer (vocabulary and special tokens), else :class:`ConfigError` naming the
  field and what differs.
- :func:`distill_stage` — in stage 6, after the estimator: the configured loss of
  :data:`~postrl.algos.distill.DISTILL_LOSSES` applied as its registry entry's ``kind`` says
  (``advantage``: the per-token term joins the advantages; ``loss``: the update adds it to its
  loss from the teacher's top-k, ``teacher_topk_ids`` / ``teacher_topk_log_probs``), and the
  ``distill/*`` metrics.

The teacher's log-probs themselves are stage 4 of the step (``Roles.teacher_log_probs``, timed
as ``timing_s/teacher``), beside the reference's, in every mode whose batch reaches the driver.
"""

from __future__ import annotations

from typing import Any

from postrl.config import ConfigError
from postrl.protocol import DataProto

__all__ = ["build_teacher", "check_teacher_tokenizer", "distill_stage"]


def _field(cfg: Any) -> str:
    d = cfg.distill
    return (
        f"distill.teacher_path={d.teacher_path!r}"
        if d.teacher_path
        else f"distill.teacher_url={d.teacher_url!r}"
    )


def check_teacher_tokenizer(cfg: Any, student_tokenizer: Any) -> None:
    """Raise :class:`ConfigError` when the teacher's tokenizer is not the student's (a no-op
    without a teacher). The remote teacher is asked for its fingerprint (``/v1/tokenizer``)."""
    from postrl.rollout.teacher import (
        RemoteTeacher,
        fingerprint_mismatch,
        tokenizer_fingerprint,
    )

    d = cfg.distill
    if not d.enabled:
        return
    if d.teacher_path:
        from postrl.data import load_tokenizer

        teacher = tokenizer_fingerprint(load_tokenizer(d.teacher_path))
    else:
        client = RemoteTeacher(d.teacher_url, d.api_key, d.timeout_s)
        try:
            teacher = client.fingerprint()
        finally:
            client.shutdown()
    why = fingerprint_mismatch(tokenizer_fingerprint(student_tokenizer), teacher)
    if why:
        raise ConfigError(
            f"invalid config:\n  - {_field(cfg)}: the teacher's tokenizer differs from the "
            f"student's (model.path={cfg.model.path!r}): {'; '.join(why)}. The per-token "
            "signal compares log-probs of the same token ids: use a teacher that shares the "
            "student's tokenizer (e.g. one trained from the student's model with `postrl sft`)"
        )


def build_teacher(cfg: Any, group: Any) -> Any:
    """The teacher: ``group(TeacherWorker, "teacher")`` for ``distill.teacher_path`` (the same
    worker-group factory as the reference), a remote client for ``distill.teacher_url``, or
    None without a teacher."""
    d = cfg.distill
    if d.teacher_path:
        from postrl.workers.teacher import TeacherWorker

        return group(TeacherWorker, "teacher")
    if d.teacher_url:
        from postrl.rollout.teacher import RemoteTeacher
        from postrl.workers.teacher import teacher_topk

        return RemoteTeacher(d.teacher_url, d.api_key, d.timeout_s, top_k=teacher_topk(cfg))
    return None


def distill_stage(batch: DataProto, cfg: Any) -> tuple[DataProto, dict[str, float]]:
    """Stage 6, after the estimator: ``distill/*`` metrics and the loss's effect on the
    advantages, as its registry entry's ``kind`` says — ``advantage`` (reverse_kl): the
    per-token term joins them; ``loss`` (gkd): the update adds the term to its loss (the
    teacher's top-k travels with the batch), and the task advantages are scaled by
    ``distill.task_reward_weight`` here (0: pure distillation). ``returns``, a critic's targets,
    stay the task's. A no-op when the batch has no ``teacher_log_prob``."""
    from postrl.algos.distill import DISTILL_LOSSES, distill_metrics, teacher_topk_mass

    b = dict(batch.batch)
    if "teacher_log_prob" not in b:
        return batch, {}
    d = cfg.distill
    student = b["old_log_probs"]  # (B, T) π_old: the policy that sampled (on-policy)
    mask = b["response_mask"]
    metrics = {
        k: float(v) for k, v in distill_metrics(student, b["teacher_log_prob"], mask).items()
    }
    fn, meta = DISTILL_LOSSES.get(d.loss), DISTILL_LOSSES.meta(d.loss)
    task = b["advantages"]
    if meta["kind"] == "advantage":
        b["advantages"] = fn(
            student,
            b["teacher_log_prob"],
            mask,
            task,
            coef=d.coef,
            task_weight=d.task_reward_weight,
            baseline=d.baseline,
        ).to(task.dtype)
    elif d.task_reward_weight != 1.0:  # a loss-kind term: the task's share of the update
        b["advantages"] = (task.float() * d.task_reward_weight).to(task.dtype)
    if "teacher_topk_log_probs" in b:
        metrics["distill/teacher_topk_mass"] = float(
            teacher_topk_mass(b["teacher_topk_log_probs"], mask)
        )
    return DataProto(b, batch.non_tensor_batch, batch.meta_info), metrics
