"""verl's own documented launch commands, shrunk to the tiny model, run to completion on CPU
through the verl entry points (``python -m postrl.verl.main_ppo`` and ``postrl verl``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from verl_commands import GRPO_QWEN2_7B, GRPO_QWEN3_8B, QUICKSTART_PPO, shrink

from postrl.cli import main as postrl_main
from postrl.config import load_config

pytestmark = pytest.mark.slow

HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wandb_or_console(cmd: list[str]) -> list[str]:
    """Keep the scripts' wandb logger when wandb is installed (offline), else log to console."""
    if HAVE_WANDB:
        return cmd
    return [a if not a.startswith("trainer.logger=") else "trainer.logger=console" for a in cmd]


def _check_run(run_dir: Path, *, critic: bool, kl_loss: bool, responses: int) -> list[dict]:
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]  # (step 0: val_before_train)
    last = rows[-1]
    assert last["reward/scored"] == responses and last["reward/failed/total"] == 0
    assert ("critic/vf_loss" in last) == critic
    assert ("actor/kl_loss" in last) == kl_loss
    assert "val/acc/mean" in last  # validation after the last step
    assert (run_dir / "checkpoints").is_dir()  # save_freq > 0 saves at the last step
    # the translated config is on disk and is exactly what ran
    ran = load_config(run_dir / "config.yaml")
    assert load_config(run_dir / "verl_translated.yaml") == ran
    return rows


def test_quickstart_ppo_with_critic(verl_home, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "ppo"
    args = shrink(QUICKSTART_PPO, verl_home, tiny_model_dir, run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "postrl.verl.main_ppo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # accepted-without-effect keys are logged once each, with the reason
    assert proc.stderr.count("log_prob_micro_batch_size_per_gpu: 8 has no effect here") == 1
    assert "gpu_memory_utilization: 0.4 has no effect here" in proc.stderr
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.algorithm.adv_estimator == "gae"  # verl's default estimator: PPO with a critic
    assert cfg.rollout.n == 1 and cfg.trainer.test_freq == 10 and cfg.trainer.save_freq == 10
    assert cfg.critic.ppo_mini_batch_size == 2  # ${actor_rollout_ref.actor.ppo_mini_batch_size}
    assert cfg.actor.optim.weight_decay == 0.01  # verl's default, not postrl's 0.0
    _check_run(run_dir, critic=True, kl_loss=False, responses=4)


VERL_CUSTOM_REWARD = '''
def my_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A reward file written for verl: verl's signature, a dict with extra info."""
    assert data_source == "openai/gsm8k" and extra_info["split"] in ("train", "test")
    return {"score": 0.25, "acc": 1.0, "pred": solution_str[:3], "n_chars": len(solution_str)}
'''


def test_grpo_qwen2_7b_with_a_verl_custom_reward_file(
    verl_home, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    reward = tmp_path / "reward.py"
    reward.write_text(VERL_CUSTOM_REWARD)
    run_dir = tmp_path / "grpo"
    custom = [f"custom_reward_function.path={reward}", "custom_reward_function.name=my_reward"]
    args = shrink(_wandb_or_console(GRPO_QWEN2_7B), verl_home, tiny_model_dir, run_dir, custom)
    assert postrl_main(["verl", *args]) == 0
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 2
    assert cfg.actor.use_kl_loss and cfg.ref.enable is None and cfg.data.truncation == "filter"
    assert cfg.trainer.backend == "local"  # 8 GPUs asked for; one CPU worker here
    last = _check_run(run_dir, critic=False, kl_loss=True, responses=8)[-1]
    # the verl reward file, unchanged: its score and its numeric extra info as metrics
    assert last["critic/score/mean"] == pytest.approx(0.25)
    assert last["reward/extra/acc/mean"] == 1.0 and last["reward/extra/n_chars/mean"] > 0


def test_grpo_qwen3_8b_gsm8k_and_math(verl_home, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "grpo"
    args = shrink(_wandb_or_console(GRPO_QWEN3_8B), verl_home, tiny_model_dir, run_dir)
    assert postrl_main(["verl", *args]) == 0
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.actor.use_dynamic_bsz and len(cfg.data.train_files) == 2
    rows = _check_run(run_dir, critic=False, kl_loss=True, responses=8)
    # gsm8k and MATH rows, each scored by verl's rule for its data_source
    assert "val/DigitalLearningGmbH/MATH-lighteval/acc" in rows[-1]
    assert "val/openai/gsm8k/acc" in rows[-1]
    if HAVE_WANDB:  # offline W&B run files written under the run dir
        assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
