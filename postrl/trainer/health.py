"""Health alerts (``trainer.health.*``): one warning line and a ``health/alerts/*`` metric when
the step's importance weights degenerate, its batches sit at the staleness bound, or its batches
carry no learning signal.

The step measures (``postrl/trainer/stages.py``, :func:`postrl.algos.off_policy_health` and the
replay buffer); :class:`HealthMonitor` only reads the step's reduced metrics:

* ``health/alerts/ess`` — 1.0 when ``health/ess_ratio`` < ``trainer.health.min_ess_ratio``
  (checked only when that is > 0 and the step measured ESS); a warning line every such step.
* ``health/alerts/staleness`` — 1.0 while ``replay/staleness/mean`` has been at (>=)
  ``trainer.async.max_staleness`` for ``trainer.health.staleness_alert_steps`` steps in a row
  (checked only when both are >= 1, the mode is off-policy, the bound is looser than the mode's
  own schedule — ``one_step_off`` trains batches ``1 + num_warmup_batches`` versions old by
  design — and the step reported staleness); the
  warning line is logged once, at the step the streak reaches K; a step below the bound resets
  the streak. The streak is checkpointed (:meth:`HealthMonitor.state_dict`).
* ``health/alerts/no_signal`` — 1.0 while every trained token's advantage has been 0
  (``critic/advantages/max`` and ``/min`` within 1e-6 of 0: every group's rewards equal, so the
  policy gradient is 0) for ``trainer.health.no_signal_alert_steps`` steps in a row, in any
  mode. With the score at 0 this is a collapse that GRPO cannot leave by itself (seen in the
  async modes at a learning rate too large for their staleness, docs/async.md); at 1 the task
  is solved. One warning line when the streak reaches K; checkpointed like the staleness streak.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["HealthMonitor"]

ESS_METRIC = "health/ess_ratio"
STALENESS_METRIC = "replay/staleness/mean"
ADV_MAX, ADV_MIN, SCORE = "critic/advantages/max", "critic/advantages/min", "critic/score/mean"
NO_SIGNAL_EPS = 1e-6


class HealthMonitor:
    """Turns a step's metrics into ``health/alerts/*`` metrics and warning lines.

    Args:
        cfg: the full config (reads ``trainer.health.*``, ``trainer.async.max_staleness`` and
            ``trainer.mode``: an on-policy mode has no staleness bound to sit at).
    """

    def __init__(self, cfg: Any) -> None:
        from postrl.trainer.modes import is_on_policy

        tc = cfg.trainer
        self.min_ess_ratio = float(tc.health.min_ess_ratio)
        self.alert_steps = int(tc.health.staleness_alert_steps)
        self.max_staleness = 0 if is_on_policy(tc.mode) else int(tc.async_.max_staleness)
        # one_step_off trains every batch exactly 1 + num_warmup_batches versions old by design:
        # sitting at a bound that tight is the schedule, not a symptom
        designed = 1 + int(tc.async_.num_warmup_batches) if tc.mode == "one_step_off" else 0
        if self.max_staleness <= designed:
            self.max_staleness = 0
        self.streak = 0  # consecutive steps with mean staleness at the bound
        self.no_signal_steps = int(tc.health.no_signal_alert_steps)
        self.no_signal_streak = 0  # consecutive steps whose advantages were all 0

    def check(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """The ``health/alerts/*`` metrics of ``step`` (a key only for a check that ran)."""
        out: dict[str, float] = {}
        ess = metrics.get(ESS_METRIC)
        if self.min_ess_ratio > 0 and ess is not None and not math.isnan(ess):
            low = ess < self.min_ess_ratio
            out["health/alerts/ess"] = float(low)
            if low:
                logger.warning(
                    "health alert (step %d): %s=%.4g is below the threshold %.4g "
                    "(trainer.health.min_ess_ratio): the behaviour policy mu is far from "
                    "pi_prox (stale batches or a rollout/training mismatch); lower "
                    "trainer.async.max_staleness, or set trainer.health.min_ess_ratio=0 to "
                    "silence this",
                    step,
                    ESS_METRIC,
                    ess,
                    self.min_ess_ratio,
                )
        stale = metrics.get(STALENESS_METRIC)
        if self.alert_steps >= 1 and self.max_staleness >= 1 and stale is not None:
            self.streak = self.streak + 1 if stale >= self.max_staleness else 0
            out["health/alerts/staleness"] = float(self.streak >= self.alert_steps)
            if self.streak == self.alert_steps:
                logger.warning(
                    "health alert (step %d): %s=%.4g has sat at the threshold "
                    "trainer.async.max_staleness=%d for %d steps in a row "
                    "(trainer.health.staleness_alert_steps=%d): every trained group is as old "
                    "as the bound allows; raise trainer.async.max_staleness, or set "
                    "trainer.health.staleness_alert_steps=0 to silence this",
                    step,
                    STALENESS_METRIC,
                    stale,
                    self.max_staleness,
                    self.streak,
                    self.alert_steps,
                )
        hi, lo = metrics.get(ADV_MAX), metrics.get(ADV_MIN)
        if self.no_signal_steps >= 1 and hi is not None and lo is not None:
            flat = max(abs(hi), abs(lo)) <= NO_SIGNAL_EPS
            self.no_signal_streak = self.no_signal_streak + 1 if flat else 0
            out["health/alerts/no_signal"] = float(self.no_signal_streak >= self.no_signal_steps)
            if self.no_signal_streak == self.no_signal_steps:
                score = metrics.get(SCORE, math.nan)
                logger.warning(
                    "health alert (step %d): every trained token's advantage has been 0 for %d "
                    "steps in a row (%s=%.3g, %s=%.3g; trainer.health.no_signal_alert_steps=%d): "
                    "every group's rewards are equal, so the policy gets no gradient. %s=%.4g: "
                    "%s; or set trainer.health.no_signal_alert_steps=0 to silence this",
                    step,
                    self.no_signal_streak,
                    ADV_MAX,
                    hi,
                    ADV_MIN,
                    lo,
                    self.no_signal_steps,
                    SCORE,
                    score,
                    "if it fell to 0 the policy has collapsed and GRPO cannot bring it back: "
                    "resume from an earlier checkpoint with a smaller actor.optim.lr (an async "
                    "mode needs about half of sync's, docs/async.md); if every answer is right, "
                    "the prompts are too easy (data.sampler=difficulty, or harder data)",
                )
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the consecutive-steps counters."""
        return {"staleness_streak": int(self.streak), "no_signal_streak": self.no_signal_streak}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None or missing keys: a fresh monitor)."""
        self.streak = int((state or {}).get("staleness_streak", 0))
        self.no_signal_streak = int((state or {}).get("no_signal_streak", 0))
