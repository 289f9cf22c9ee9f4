"""Reward requests, per-sample outcomes, the batch result, errors, and return-value validation.

A reward function's return value is classified by :func:`classify` into either a valid score or
one failure reason (``FAILURE_REASONS``). **A failure is not a score**: a failed sample has
``valid=False`` and a 0.0 placeholder in ``scores`` that must never be used as a reward; the
trainer excludes it from its group's baseline and gives it zero advantage and no loss.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FAILURE_REASONS",
    "RewardRequest",
    "SampleScore",
    "RewardResult",
    "RewardError",
    "RewardFailureError",
    "classify",
    "failed",
]

#: Why a sample has no score. ``nan`` covers NaN and +-inf; ``crash`` is a worker process that
#: died mid-call (segfault, os._exit, OOM kill); ``bad_type`` a value that is not a real number
#: or a dict with a real "score".
FAILURE_REASONS: tuple[str, ...] = ("exception", "timeout", "nan", "none", "bad_type", "crash")
_FAILED_KEYS = {r: f"reward/failed/{r}" for r in FAILURE_REASONS}


class RewardError(RuntimeError):
    """A reward setup or contract error that must stop the run (not a per-sample failure),
    e.g. a batch function returning the wrong number of scores."""


class RewardFailureError(RuntimeError):
    """More samples failed than ``reward.max_failure_ratio`` allows; the message has the counts."""


@dataclass
class RewardRequest:
    """One trajectory to score (verl's ``compute_score`` arguments plus a ``uid``).

    Attributes:
        data_source: selects the registered function (ignored by a custom function's routing,
            but passed to it).
        solution_str: the decoded response.
        ground_truth: ``reward_model.ground_truth`` of the row (any picklable value).
        extra_info: the row's ``extra_info`` dict, passed through.
        uid: caller's id (e.g. the prompt uid), carried into logs and the result.
    """

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] | None = None
    uid: Any = None


@dataclass(frozen=True)
class SampleScore:
    """Outcome for one sample: ``score`` is None exactly when ``reason`` names a failure."""

    score: float | None
    reason: str | None = None
    detail: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        """True when the sample has a real score."""
        return self.reason is None


def failed(
    reason: str, detail: str | None = None, extra: dict[str, Any] | None = None
) -> SampleScore:
    """A failed :class:`SampleScore` (``reason`` must be one of ``FAILURE_REASONS``)."""
    assert reason in FAILURE_REASONS, reason
    return SampleScore(None, reason, detail, extra or {})


def classify(value: Any) -> SampleScore:
    """Validate a reward function's return value for one sample.

    Accepted: a real number (``int``, ``float``, ``bool``, numpy scalars, one-element tensors)
    or a dict whose ``"score"`` is one; other dict keys become per-sample extras. ``None`` ->
    ``none``; NaN/inf -> ``nan``; anything else -> ``bad_type``.
    """
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            keys = ", ".join(map(str, value)) or "(none)"
            return failed("bad_type", f"dict return value has no 'score' key (keys: {keys})")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if value is None:
        return failed("none", "reward function returned None", extra)
    if type(value) is not float and type(value) is not int:  # (the common case skips the ABC)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            return failed(
                "bad_type", f"score has type {type(value).__name__}, expected a real number", extra
            )
    score = float(value)
    if not math.isfinite(score):
        return failed("nan", f"score is {score}", extra)
    return SampleScore(score, None, None, extra)


@dataclass
class RewardResult:
    """Scores for a batch of B requests, in request order.

    Attributes:
        scores: (B,) float32; 0.0 placeholder where ``valid`` is False — never a reward.
        valid: (B,) bool; False for failed samples.
        failure_reason: per sample, one of ``FAILURE_REASONS`` or None.
        failure_detail: per sample, the error text (traceback, type, value) or None.
        extra: per extra key returned in dicts, a length-B list (None where absent).
        metrics: ``reward/generated``, ``reward/scored``, ``reward/failed/<reason>`` and
            ``reward/failed/total``; always ``generated == scored + failed/total``.
        uids: the requests' uids.
    """

    scores: torch.Tensor
    valid: torch.Tensor
    failure_reason: list[str | None]
    failure_detail: list[str | None]
    extra: dict[str, list[Any]]
    metrics: dict[str, float]
    uids: list[Any]

    @classmethod
    def from_samples(
        cls, samples: list[SampleScore], uids: list[Any] | None = None
    ) -> RewardResult:
        """Assemble the batch result (and its counts) from per-sample outcomes."""
        keys: list[str] = []
        for s in samples:
            keys += [k for k in s.extra if k not in keys]
        return cls.from_columns(
            torch.tensor([s.score if s.valid else 0.0 for s in samples], dtype=torch.float32),
            [s.reason for s in samples],
            [s.detail for s in samples],
            {k: [s.extra.get(k) for s in samples] for k in keys},
            uids,
        )

    @classmethod
    def from_columns(
        cls,
        scores: torch.Tensor,
        reasons: list[str | None],
        details: list[str | None],
        extra: dict[str, list[Any]] | None = None,
        uids: list[Any] | None = None,
    ) -> RewardResult:
        """Build a result from columns: ``scores`` (B,), one failure reason (or None) per row.

        ``valid`` and the counts are derived from ``reasons``; scores of failed rows are
        zeroed (a placeholder, never a reward).
        """
        n = len(reasons)
        ok = [r is None for r in reasons]
        valid = torch.tensor(ok, dtype=torch.bool)
        n_failed = n - sum(ok)
        metrics = dict.fromkeys(_FAILED_KEYS.values(), 0.0)
        if n_failed:  # counted in Python: a group of 8 is scored per call on the hot path
            for r in reasons:
                if r in _FAILED_KEYS:
                    metrics[_FAILED_KEYS[r]] += 1.0
        metrics["reward/failed/total"] = float(n_failed)
        metrics["reward/scored"] = float(n - n_failed)
        metrics["reward/generated"] = float(n)
        return cls(
            scores=(
                torch.where(valid, scores.to(torch.float32), 0.0)
                if n_failed
                else scores.to(torch.float32, copy=True)
            ),
            valid=valid,
            failure_reason=list(reasons),
            failure_detail=list(details),
            extra=dict(extra or {}),
            metrics=metrics,
            uids=list(uids) if uids is not None else [None] * n,
        )

    @classmethod
    def scatter(cls, n: int, parts: list[tuple[list[int], RewardResult]]) -> RewardResult:
        """Merge results of disjoint row subsets column by column: ``parts`` holds
        ``(row positions, result of those rows)``; every one of the ``n`` rows appears once."""
        scores = torch.zeros(n, dtype=torch.float32)
        reasons: list[str | None] = [None] * n
        details: list[str | None] = [None] * n
        uids: list[Any] = [None] * n
        extra: dict[str, list[Any]] = {}
        seen = 0
        for rows, part in parts:
            if len(rows) != len(part):
                raise ValueError(f"{len(rows)} row positions for a result of {len(part)} rows")
            scores[torch.as_tensor(rows, dtype=torch.long)] = part.scores
            for j, i in enumerate(rows):
                reasons[i], details[i], uids[i] = (
                    part.failure_reason[j],
                    part.failure_detail[j],
                    part.uids[j],
                )
            for k, vals in part.extra.items():
                col = extra.setdefault(k, [None] * n)
                for j, i in enumerate(rows):
                    col[i] = vals[j]
            seen += len(rows)
        if seen != n:
            raise ValueError(f"scatter covers {seen} rows, expected {n}")
        return cls.from_columns(scores, reasons, details, extra, uids)

    def __len__(self) -> int:
        return len(self.failure_reason)
