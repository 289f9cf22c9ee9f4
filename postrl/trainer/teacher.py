"""The teacher of on-policy distillation (``distill.*``): built, checked and applied.

- :func:`build_teacher` — a frozen :class:`~postrl.workers.teacher.TeacherWorker` group on
  ``trainer.backend`` (``distill.teacher_path``) or a :class:`~postrl.rollout.teacher.
  RemoteTeacher` (``distill.teacher_url``); both answer ``compute_teacher_log_prob(batch)``.
- :func:`check_teacher_tokenizer` — at startup, before any model is loaded: teacher and student
  must share the tokenizer (vocabulary and special tokens), else :class:`ConfigError` naming the
  field and what differs.
- :func:`distill_stage` — in stage 6, after the estimator: the configured loss of
  :data:`~postrl.algos.distill.DISTILL_LOSSES` applied as its registry entry's ``kind`` says
  (``advantage``: the per-token term joins the advantages), and the ``distill/*`` metrics.

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

        return RemoteTeacher(d.teacher_url, d.api_key, d.timeout_s)
    return None


def distill_stage(batch: DataProto, cfg: Any) -> tuple[DataProto, dict[str, float]]:
    """Stage 6, after the estimator: ``distill/*`` metrics and, for an ``advantage`` loss, the
    per-token term in ``advantages`` (``returns``, a critic's targets, stay the task's). A no-op
    when the batch has no ``teacher_log_prob``."""
    from postrl.algos.distill import DISTILL_LOSSES, distill_metrics

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
    if meta["kind"] == "advantage":
        task = b["advantages"]
        b["advantages"] = fn(
            student,
            b["teacher_log_prob"],
            mask,
            task,
            coef=d.coef,
            task_weight=d.task_reward_weight,
        ).to(task.dtype)
    return DataProto(b, batch.non_tensor_batch, batch.meta_info), metrics
