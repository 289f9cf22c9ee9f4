"""``HealthMonitor`` (``trainer.health.*``): the ESS, staleness and no-signal alerts, their
warning lines, the checkpointed streaks; one ``one_step_off`` run logging ``health/*``, and a
``sync`` run whose rewards are all equal raising the no-signal alert."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from postrl.config import load_config
from postrl.trainer.health import HealthMonitor
from postrl.trainer.trainer import RLTrainer

LOGGER = "postrl.trainer.health"


def _monitor(*overrides: str) -> HealthMonitor:
    return HealthMonitor(load_config(None, ["trainer.mode=one_step_off", *overrides]))


def _stale(mon: HealthMonitor, values: list[float], start: int = 1) -> list[float]:
    return [
        mon.check({"replay/staleness/mean": v}, step)["health/alerts/staleness"]
        for step, v in enumerate(values, start)
    ]


def test_staleness_alert_fires_at_the_kth_step_at_the_bound_and_resets(caplog):
    mon = _monitor("trainer.async.max_staleness=2", "trainer.health.staleness_alert_steps=3")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        alerts = _stale(mon, [2.0, 2.0, 1.5, 2.0, 2.0, 2.0, 2.0, 1.0, 2.0])
    assert alerts == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines  # once per streak, at the K-th step (step 6)
    assert "step 6" in lines[0] and "replay/staleness/mean=2" in lines[0]
    assert "trainer.async.max_staleness=2" in lines[0]
    assert "trainer.health.staleness_alert_steps=3" in lines[0]


def test_staleness_alert_is_off_when_disabled_or_on_policy_or_unmeasured():
    assert (
        _monitor("trainer.health.staleness_alert_steps=0").check({"replay/staleness/mean": 5.0}, 1)
        == {}
    )
    sync = HealthMonitor(load_config(None, ["trainer.health.staleness_alert_steps=1"]))
    assert sync.check({"replay/staleness/mean": 5.0}, 1) == {}  # sync has no bound to sit at
    mon = _monitor("trainer.health.staleness_alert_steps=1", "trainer.async.max_staleness=2")
    assert mon.check({"actor/pg_loss": 0.1}, 1) == {}
    assert mon.check({"replay/staleness/mean": 2.0}, 2) == {"health/alerts/staleness": 1.0}
    # one_step_off's own schedule (batches 1 + num_warmup_batches versions old) is no alert
    tight = _monitor("trainer.health.staleness_alert_steps=1", "trainer.async.max_staleness=1")
    assert tight.check({"replay/staleness/mean": 1.0}, 2) == {}


def test_ess_alert_line_names_metric_value_threshold_and_key(caplog):
    mon = _monitor("trainer.health.min_ess_ratio=0.5")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert mon.check({"health/ess_ratio": 0.8}, 1) == {"health/alerts/ess": 0.0}
        assert mon.check({"health/ess_ratio": 0.25}, 2) == {"health/alerts/ess": 1.0}
        assert mon.check({"health/ess_ratio": 0.5}, 3) == {"health/alerts/ess": 0.0}
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    for part in (
        "step 2",
        "health/ess_ratio=0.25",
        "threshold 0.5",
        "trainer.health.min_ess_ratio",
    ):
        assert part in lines[0], (part, lines[0])
    off = _monitor("trainer.health.min_ess_ratio=0")
    assert off.check({"health/ess_ratio": 0.01}, 1) == {}
    assert mon.check({"actor/pg_loss": 0.1}, 4) == {}  # no measurement, no check


def _flat(mon: HealthMonitor, advs: list[float], start: int = 1, score: float = 0.0):
    return [
        mon.check(
            {"critic/advantages/max": a, "critic/advantages/min": -a, "critic/score/mean": score},
            step,
        )["health/alerts/no_signal"]
        for step, a in enumerate(advs, start)
    ]


def test_no_signal_alert_fires_after_k_steps_of_zero_advantages_in_any_mode(caplog):
    mon = HealthMonitor(load_config(None, ["trainer.health.no_signal_alert_steps=2"]))  # sync
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        alerts = _flat(mon, [0.0, 0.7, 0.0, 1e-8, 0.0, 0.3, 0.0])
    assert alerts == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines  # once per streak, at the K-th step (step 4)
    for part in ("step 4", "for 2 steps", "critic/score/mean=0", "actor.optim.lr",
                 "trainer.health.no_signal_alert_steps=2"):  # fmt: skip
        assert part in lines[0], (part, lines[0])
    from postrl.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"trainer.health.no_signal_alert_steps=-1 must be >= 0"):
        validate_config(load_config(None, ["trainer.health.no_signal_alert_steps=-1"]))
    off = HealthMonitor(load_config(None, ["trainer.health.no_signal_alert_steps=0"]))
    assert off.check({"critic/advantages/max": 0.0, "critic/advantages/min": 0.0}, 1) == {}
    assert mon.check({"actor/pg_loss": 0.0}, 8) == {}  # no advantages measured, no check
    # across a checkpoint: the streak goes on
    state = json.loads(json.dumps(mon.state_dict()))
    again = HealthMonitor(load_config(None, ["trainer.health.no_signal_alert_steps=2"]))
    again.load_state_dict(state)
    assert _flat(again, [0.0], start=8) == [1.0]


def _fit_rows(cfg, caplog) -> list[dict]:
    """Train ``cfg`` with the monitor's warnings captured; the metrics rows of the steps."""
    trainer = RLTrainer(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(ln) for ln in (Path(cfg.trainer.run_dir) / "metrics.jsonl").open()]
    return [r for r in rows if "actor/pg_loss" in r]


def test_a_run_whose_rewards_are_all_equal_raises_the_no_signal_alert(
    small_overrides, tmp_path, caplog
):
    """A real ``sync`` run whose reward is constant (every group's rewards equal): GRPO's
    advantages are all 0, and from the second step on the alert is up (K = 2)."""
    fn = tmp_path / "constant.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return 0.0\n")  # fmt: skip
    cfg = load_config(
        None,
        [
            *small_overrides,
            "data.train_batch_size=2",
            "rollout.n=2",
            "data.val_files=[]",
            f"reward.custom_function.path={fn}",
            "trainer.total_steps=3",
            "trainer.health.no_signal_alert_steps=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    rows = _fit_rows(cfg, caplog)
    assert [r["critic/advantages/max"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["health/alerts/no_signal"] for r in rows] == [0.0, 1.0, 1.0]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert sum("advantage has been 0" in ln for ln in lines) == 1


def test_streak_survives_a_json_round_trip():
    over = ("trainer.async.max_staleness=2", "trainer.health.staleness_alert_steps=3")
    mon = _monitor(*over)
    assert _stale(mon, [2.0, 2.0]) == [0.0, 0.0]
    state = json.loads(json.dumps(mon.state_dict()))
    assert state == {"staleness_streak": 2, "no_signal_streak": 0}
    resumed = _monitor(*over)
    resumed.load_state_dict(state)
    assert _stale(resumed, [2.0], start=3) == [1.0]  # the 3rd step in a row, across the resume
    fresh = _monitor(*over)
    fresh.load_state_dict(None)  # a checkpoint from before the monitor
    assert fresh.state_dict() == {"staleness_streak": 0, "no_signal_streak": 0}


def test_one_step_off_run_logs_health_metrics_and_alerts_and_checkpoints_the_streak(
    small_overrides, tmp_path, caplog
):
    cfg = load_config(
        None,
        [
            *small_overrides,
            "data.train_batch_size=2",  # the smallest batch (keeps it a few seconds)
            "rollout.n=2",
            "trainer.mode=one_step_off",
            "trainer.deterministic=true",  # a fixed interleaving: step 2's batch is 1 version old
            "actor.policy_loss=decoupled",
            "data.val_files=[]",
            "trainer.health.min_ess_ratio=0.999999",
            "trainer.health.staleness_alert_steps=1",
            "trainer.save_freq=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    rows = _fit_rows(cfg, caplog)
    assert len(rows) == 2
    for r in rows:
        assert 0.0 < r["health/ess_ratio"] <= 1.0
        assert r["health/chi2"] > -1.0  # mean(w^2) - 1; below 0 when the sample's mean(w) < 1
        assert r["health/kl_behav_prox"] == pytest.approx(r["rollout_corr/kl_k1"], abs=1e-5)
        assert r["health/alerts/ess"] == float(r["health/ess_ratio"] < 0.999999)
    # step 2 trains the batch generated during step 1: one version old, at the bound (K = 1),
    # which is one_step_off's schedule with max_staleness=1: no staleness alert
    assert [r["replay/staleness/mean"] for r in rows] == [0.0, 1.0]
    assert all("health/alerts/staleness" not in r for r in rows)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert not any("replay/staleness/mean=" in ln for ln in lines)
    assert sum("health/ess_ratio=" in ln for ln in lines) == sum(
        r["health/alerts/ess"] for r in rows
    )
    run = Path(cfg.trainer.run_dir)
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    # saved with every checkpoint; the tiny random model scores 0 on every answer here, so
    # the no-signal streak counts the steps whose advantages were all 0
    flat = [r["critic/advantages/max"] == r["critic/advantages/min"] == 0.0 for r in rows]
    streak = 2 if all(flat) else int(flat[-1])
    assert state["health"] == {"staleness_streak": 0, "no_signal_streak": streak}
