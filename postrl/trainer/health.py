"""Off-policy health alerts (``trainer.health.*``): one warning line and a ``health/alerts/*``
metric when the step's importance weights degenerate or its batches sit at the staleness bound.

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
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["HealthMonitor"]

ESS_METRIC = "health/ess_ratio"
STALENESS_METRIC = "replay/staleness/mean"


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
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the consecutive-steps counter."""
        return {"staleness_streak": int(self.streak)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None or missing keys: a fresh monitor)."""
        self.streak = int((state or {}).get("staleness_streak", 0))
