"""A 20-step GRPO run on the ``small`` preset (≈25M parameters) with the actor and the native
rollout engine on CUDA: every step's metrics finite, the policy moved, rewards scored."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from postrl.config import load_config
from postrl.data import generate_addition, write_parquet

pytestmark = pytest.mark.gpu

DIGITS = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)


def test_grpo_small_preset_on_device(device, tmp_path):
    from postrl.testing import make_model
    from postrl.trainer import RLTrainer

    steps = int(os.environ.get("POSTRL_GPU_TEST_STEPS", "20"))
    model = make_model(tmp_path / "small", preset="small", seed=0)
    train = write_parquet(generate_addition(64, seed=0), tmp_path / "train.parquet")
    reward = tmp_path / "digits.py"
    reward.write_text(DIGITS)  # dense rewards: a random model gets non-zero advantages
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            f"data.train_files=[{train}]",
            "data.val_files=[]",
            "data.train_batch_size=8",
            "data.max_prompt_length=64",
            "actor.ppo_mini_batch_size=8",
            "actor.optim.lr=1e-5",
            "rollout.n=4",
            "rollout.response_length=16",
            f"reward.custom_function.path={reward}",
            f"trainer.device={device}",
            f"trainer.total_steps={steps}",
            "trainer.loggers=[jsonl]",
            "trainer.val_before_train=false",
            f"trainer.run_dir={run_dir}",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        before = {
            k: v.detach().float().cpu().clone()
            for k, v in trainer.roles.actor.get_per_tensor_param()
        }
        last = trainer.fit()
        after = {k: v.detach().float().cpu() for k, v in trainer.roles.actor.get_per_tensor_param()}
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {r['step']}: non-finite {bad}"
        assert r["reward/scored"] == 32
    assert sum(r["actor/grad_norm"] > 0 for r in rows) >= max(1, steps // 2)  # it learned
    assert last["actor/grad_norm_nonfinite_skips"] == 0
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 0, "no parameter changed in the run"
    assert all(torch.isfinite(v).all() for v in after.values())
    print(
        f"grpo small on {device}: {steps} steps, median step "
        f"{sorted(r['timing_s/step'] for r in rows)[len(rows) // 2]:.3f}s"
    )
