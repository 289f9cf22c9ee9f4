"""Exact resume: a run SIGKILLed mid-step / mid-checkpoint / at an epoch boundary and resumed
reproduces the uninterrupted run's metrics rows and final parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from postrl.data import generate_addition, write_parquet

pytestmark = pytest.mark.slow

WALL_CLOCK = ("timing_s/", "perf/")


def _train(overrides: list[str], kill_at: str | None = None) -> int:
    """``postrl train`` in a subprocess; with ``kill_at`` a test-side hook SIGKILLs it there."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = ["postrl.testing.faults_run", "--kill-at", kill_at] if kill_at else ["postrl.cli"]
    cmd = [sys.executable, "-m", *launcher, "train", *overrides, "trainer.num_threads=1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, -9):
        print(proc.stderr[-4000:])
    return proc.returncode


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def _final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run / "checkpoints" / f"step_{step:06d}" / "actor").rglob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    assert out, "no actor tensors in the checkpoint"
    return out


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
