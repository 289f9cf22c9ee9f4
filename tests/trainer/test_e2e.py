"""End-to-end GRPO runs on the tiny model (local backend), with metric and accounting checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from trainer_helpers import fit_with_snapshots

from postrl.config import load_config
from postrl.trainer.trainer import RLTrainer

EXPECTED_KEYS = {
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "perf/time_per_step",
    "reward/generated",
    "reward/scored",
    "reward/failed/total",
    "rollout_corr/ess",
    "val/addition/acc",
    "val/acc/mean",
    "val/addition/score",
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mini", [2, 4], ids=["two-minibatches", "on-policy-fused"])
def test_grpo_local_runs_updates_and_reports(small_overrides, digits_reward, mini):
    """mini=4 (= train_batch_size): one on-policy mini-batch, old log-probs fused into the
    update."""
    cfg = load_config(
        None,
        [
            *small_overrides,
            f"reward.custom_function.path={digits_reward}",
            f"actor.ppo_mini_batch_size={mini}",
        ],
    )
    trainer = RLTrainer(cfg)
    assert trainer.roles.fuse_old_log_prob == (mini == 4)
    try:
        before, last, after = fit_with_snapshots(trainer)
    finally:
        trainer.close()
    assert EXPECTED_KEYS <= set(last), sorted(EXPECTED_KEYS - set(last))
    assert all(math.isfinite(v) for k, v in last.items()), {
        k: v for k, v in last.items() if not math.isfinite(v)
    }
    assert last["reward/generated"] == 16 == last["reward/scored"] + last["reward/failed/total"]
    assert any(not torch.equal(before[k], after[k]) for k in before), (
        "the update changed no parameter"
    )
    if mini == 4:
        # no separate pass (its entropy metric is absent); ratio exactly 1; the mismatch
        # metrics are still reported, measured on the fused log-probs
        assert "actor/entropy_old" not in last and last["actor/ppo_kl"] == 0.0
        assert last["rollout_corr/kl_k3"] < 1e-3
    else:
        assert "actor/entropy_old" in last and "rollout_corr/kl_k3" in last
    run = Path(cfg.trainer.run_dir)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [
        0,
        1,
        2,
    ]  # validation before training, then one row per step
    assert (run / "config.yaml").exists() and (run / "summary.txt").exists()
    info = json.loads((run / "run_info.json").read_text())
    assert "bitwise_reproducible" in info["determinism"]  # the promise, stated per run
    assert list((run / "plots").glob("*.png"))


def test_a_run_without_the_jsonl_logger_ends_cleanly(small_overrides, digits_reward):
    """Plots and the summary read metrics.jsonl: without that logger the run still ends, and
    summary.txt says why there is nothing to plot."""
    ov = [*small_overrides, f"reward.custom_function.path={digits_reward}"]
    cfg = load_config(None, [*ov, "trainer.loggers=[console]", "trainer.total_steps=1"])
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    run = Path(cfg.trainer.run_dir)
    assert not (run / "metrics.jsonl").exists()
    assert "has no jsonl" in (run / "summary.txt").read_text()


def test_failed_rewards_are_masked_counted_not_scored(small_overrides, tmp_path):
    fn = tmp_path / "flaky.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['index'] % 2:\n"
        "        raise RuntimeError('boom')\n"
        "    return float('nan') if extra_info['index'] % 4 == 2 else 1.0\n"
    )
    cfg = load_config(
        None,
        [
            *small_overrides,
            f"reward.custom_function.path={fn}",
            "reward.max_failure_ratio=1.0",
            "trainer.total_steps=1",
            "trainer.val_before_train=false",
            "data.val_files=[]",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        m = trainer.fit()
    finally:
        trainer.close()
    assert m["reward/generated"] == 16
    assert m["reward/failed/exception"] + m["reward/failed/nan"] == m["reward/failed/total"] > 0
    assert m["reward/scored"] + m["reward/failed/total"] == 16
    assert m["critic/score/mean"] == 1.0  # only real scores enter the statistics


def test_max_failure_ratio_stops_the_run(small_overrides, tmp_path):
    from postrl.reward import RewardFailureError

    fn = tmp_path / "broken.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('x')\n"
    )
    cfg = load_config(
        None,
        [
            *small_overrides,
            f"reward.custom_function.path={fn}",
            "reward.max_failure_ratio=0.5",
            "trainer.val_before_train=false",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        with pytest.raises(RewardFailureError):
            trainer.fit()
    finally:
        trainer.close()


def test_train_main_reports_bad_data_without_a_traceback(
    small_overrides, tmp_path, tiny_model_dir, caplog
):
    """A prompt over data.max_prompt_length is a clear error (exit code 2, the message names
    the row and the fix), not a traceback out of ``postrl train``."""
    from postrl.trainer.run import train_main

    code = train_main(None, [*small_overrides, "data.max_prompt_length=4"])
    assert code == 2
    assert "max_prompt_length" in caplog.text


def test_time_budget_stops_and_validates_at_the_marks(small_overrides, digits_reward, tmp_path):
    """``trainer.time_budget_s`` ends the run at the first step whose summed step time reaches
    it (that step is validated and saved); ``test_at_s`` validates where each mark is crossed;
    a resume keeps counting from the checkpoint's training time."""
    run = tmp_path / "run"
    over = small_overrides + [
        f"reward.custom_function.path={digits_reward}",
        "trainer.total_steps=10000",
        "trainer.test_freq=0",
        "trainer.save_freq=10000",
    ]
    trainer = RLTrainer(
        load_config(None, over + ["trainer.time_budget_s=1.5", "trainer.test_at_s=[0.5]"])
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [r for r in _rows(run) if r["step"] > 0]
    times = [r["perf/train_time_s"] for r in rows]
    # the last step crossed the budget (a slow, busy box may cross it in the first step)
    assert times == sorted(times) and times[-1] >= 1.5
    assert len(times) == 1 or times[-2] < 1.5
    assert times == pytest.approx(
        [sum(r["timing_s/step"] for r in rows[: i + 1]) for i in range(len(rows))]
    )
    validated = [r["step"] for r in rows if "val/acc/mean" in r]
    first_past_mark = next(r["step"] for r in rows if r["perf/train_time_s"] >= 0.5)
    assert validated == sorted({first_past_mark, rows[-1]["step"]})
    assert (run / "checkpoints" / f"step_{rows[-1]['step']:06d}").is_dir()

    # resumed with a larger budget: training time continues from the checkpoint's
    trainer = RLTrainer(load_config(None, over + ["trainer.time_budget_s=2.5"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    more = [r for r in _rows(run) if r["step"] > rows[-1]["step"]]
    assert more and more[0]["perf/train_time_s"] > times[-1]
    assert more[-1]["perf/train_time_s"] >= 2.5
    assert len(more) == 1 or more[-2]["perf/train_time_s"] < 2.5


def test_time_budget_settings_are_validated(small_overrides):
    from postrl.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"trainer.time_budget_s=-1.0 must be >= 0"):
        validate_config(load_config(None, small_overrides + ["trainer.time_budget_s=-1"]))
    with pytest.raises(ConfigError, match=r"trainer.test_at_s=\[60.0, 0.0\].*got \[0.0\]"):
        validate_config(load_config(None, small_overrides + ["trainer.test_at_s=[60,0]"]))


def test_downsampled_groups_reach_the_update_with_their_max_variance_subset(
    small_overrides, digits_reward
):
    """PODS: 8 responses generated per prompt, the 4 of each group whose rewards vary most are
    the only ones the update sees (mini-batches of ppo_mini_batch_size × 4 responses)."""
    import itertools

    cfg = load_config(
        None,
        [
            *small_overrides,
            f"reward.custom_function.path={digits_reward}",
            "rollout.n=8",
            "algorithm.downsample.enable=true",
            "algorithm.downsample.size=4",
            "trainer.total_steps=1",
        ],
    )
    trainer = RLTrainer(cfg)
    seen: dict[str, list] = {}
    from postrl.trainer import stages

    real_stage, real_update = stages.downsample_stage, trainer.roles.update_actor

    def spy_stage(batch, cfg, step):
        seen["generated"] = batch
        return real_stage(batch, cfg, step)

    def spy_update(batch):
        seen["trained"] = batch
        return real_update(batch)

    stages.downsample_stage, trainer.roles.update_actor = spy_stage, spy_update
    try:
        trainer.fit()
    finally:
        stages.downsample_stage = real_stage
        trainer.close()
    gen, kept = seen["generated"], seen["trained"]
    assert len(gen) == 32 and len(kept) == 16
    g_scores = gen.batch["token_level_scores"].sum(-1)
    k_scores = kept.batch["token_level_scores"].sum(-1)
    for uid in set(gen.non_tensor_batch["uid"]):
        g = g_scores[torch.as_tensor(gen.non_tensor_batch["uid"] == uid)].double()
        k = k_scores[torch.as_tensor(kept.non_tensor_batch["uid"] == uid)].double()
        assert len(k) == 4
        best = max(g[list(c)].var(unbiased=False) for c in itertools.combinations(range(8), 4))
        assert float(k.var(unbiased=False)) == pytest.approx(float(best), abs=1e-9)
    rows = _rows(Path(cfg.trainer.run_dir))
    step1 = next(r for r in rows if r["step"] == 1)
    assert step1["downsample/generated_samples"] == 32 and step1["downsample/kept_samples"] == 16


def test_downsample_size_is_validated(small_overrides):
    from postrl.config import ConfigError, validate_config

    over = [*small_overrides, "algorithm.downsample.enable=true"]
    with pytest.raises(
        ConfigError, match=r"algorithm.downsample.size=4 must be in \[2, rollout.n=4\)"
    ):
        validate_config(load_config(None, over + ["algorithm.downsample.size=4"]))
    with pytest.raises(ConfigError, match=r"algorithm.downsample.rule='top'"):
        validate_config(
            load_config(
                None, over + ["algorithm.downsample.size=2", "algorithm.downsample.rule=top"]
            )
        )


def test_difficulty_sampler_replays_in_a_run_and_resumes(small_overrides, digits_reward):
    """``data.sampler=difficulty``: groups with signal come back (``sampler/replayed``), fresh
    prompts still follow the permutation, and the sampler's state survives a checkpoint."""
    over = [
        *small_overrides,
        f"reward.custom_function.path={digits_reward}",
        "data.sampler=difficulty",
        "data.sampler_kwargs={replay_fraction: 0.5, success_threshold: 0.05}",
        "trainer.test_freq=0",
        "trainer.save_freq=3",
    ]
    trainer = RLTrainer(load_config(None, [*over, "trainer.total_steps=3"]))
    try:
        trainer.fit()
        state = trainer.loader.sampler.state_dict()
    finally:
        trainer.close()
    run = Path(small_overrides[-1].split("=", 1)[1])
    rows = [r for r in _rows(run) if r["step"] > 0]
    assert all("sampler/pool_size" in r for r in rows)
    assert sum(r["sampler/replayed"] for r in rows) > 0, "nothing was replayed"
    trainer = RLTrainer(load_config(None, [*over, "trainer.total_steps=4"]))
    try:
        trainer._maybe_resume()
        assert trainer.loader.sampler.state_dict() == state
    finally:
        trainer.close()


def test_adaptive_entropy_coeff_survives_a_checkpoint(small_overrides, digits_reward):
    """``actor.entropy_target``: the controller's weight is logged each step and a resumed run
    continues from the saved weight, not from ``actor.entropy_coeff``."""
    over = [
        *small_overrides,
        f"reward.custom_function.path={digits_reward}",
        "actor.entropy_coeff=0.01",
        "actor.entropy_target=100",  # far above any entropy: the weight rises every update
        "actor.entropy_coeff_step=0.002",
        "trainer.test_freq=0",
        "trainer.save_freq=2",
    ]
    trainer = RLTrainer(load_config(None, [*over, "trainer.total_steps=2"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    run = Path(small_overrides[-1].split("=", 1)[1])
    # the weight moves once per step's update (whatever its mini-batch count)
    assert [r["actor/entropy_coeff"] for r in _rows(run) if r["step"] > 0] == pytest.approx(
        [0.01, 0.012]
    )
    trainer = RLTrainer(load_config(None, [*over, "trainer.total_steps=3"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert _rows(run)[-1]["step"] == 3
    assert _rows(run)[-1]["actor/entropy_coeff"] == pytest.approx(0.014)
