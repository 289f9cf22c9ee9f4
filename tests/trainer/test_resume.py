"""Exact resume: a run SIGKILLed mid-step / mid-checkpoint / at an epoch boundary and resumed
reproduces the uninterrupted run's metrics rows and final parameters."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import checkpoint_weights, metric_rows, train_subprocess

from postrl.data import generate_addition, write_parquet

pytestmark = pytest.mark.slow


def _train(overrides: list[str], kill_at: str | None = None) -> int:
    return train_subprocess(overrides, threads=1, kill_at=kill_at, timeout=600)


_rows, _final_weights = metric_rows, checkpoint_weights


@pytest.fixture(scope="module")
def resume_setup(tiny_model_dir, tmp_path_factory, digits_reward):
    d = tmp_path_factory.mktemp("resume")
    train = write_parquet(generate_addition(8, seed=3), d / "train.parquet")  # 2 steps per epoch
    test = write_parquet(generate_addition(4, seed=3, split="test"), d / "test.parquet")
    base = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "rollout.n=4",
        "rollout.response_length=6",
        "trainer.total_steps=4",
        "trainer.test_freq=2",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"reward.custom_function.path={digits_reward}",
    ]
    ref = d / "ref"
    assert _train([*base, f"trainer.run_dir={ref}"]) == 0
    first = _final_weights(ref, 1)
    assert any(not torch.equal(first[k], v) for k, v in _final_weights(ref, 4).items()), (
        "training must move the weights"
    )
    return base, d, ref


@pytest.mark.parametrize("kill_at", ["step3:after_gen", "step3:ckpt_components", "step2:end"])
def test_sigkill_and_resume_is_exact(resume_setup, kill_at):
    base, d, ref = resume_setup
    run = d / kill_at.replace(":", "_")
    args = [*base, f"trainer.run_dir={run}"]
    assert _train(args, kill_at=kill_at) == -9  # SIGKILL
    if kill_at.endswith("ckpt_components"):
        assert list((run / "checkpoints").glob("*.tmp-*")), (
            "the interrupted checkpoint should be left unfinished"
        )
    assert _train(args) == 0
    assert _rows(run) == _rows(ref)
    a, b = _final_weights(run, 4), _final_weights(ref, 4)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
