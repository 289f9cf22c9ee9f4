"""``postrl train`` with ``rollout.backend=vllm`` on CPU: the engine runs in a replica process
of the vLLM venv (``make vllm-venv``), weights reach it by one layerwise reload per sync, and
every sync is verified. A 4-step seeded sync-mode run whose sync after step 2 is corrupted
once in transit completes; every sync is verified, step 2's counts one mismatch (resent), and the
rollout's log-probs match the trainer's (fp32: ``rollout_corr/kl_k1`` < 1e-4 at every step, so
the engine held each update exactly).

Skipped only where vLLM cannot import; under ``CI=true`` that fails instead."""

from __future__ import annotations

import pytest
from test_weight_contract import corrupt_run
from trainer_helpers import metric_rows

from postrl.data import generate_addition, write_parquet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def vllm_ready():
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "rollout"))
    from test_vllm import vllm_python

    return vllm_python()


def test_vllm_sync_run_verifies_every_sync_and_recovers_a_corrupted_one(
    vllm_ready, tiny_model_dir, tmp_path, digits_reward
):
    train = write_parquet(generate_addition(8, seed=3), tmp_path / "train.parquet")
    run = tmp_path / "run"
    args = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        "data.train_batch_size=2",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-3",
        "rollout.n=4",
        "rollout.response_length=8",
        "rollout.backend=vllm",
        "rollout.max_num_seqs=16",
        "trainer.total_steps=4",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "trainer.seed=7",
        f"reward.custom_function.path={digits_reward}",
        f"trainer.run_dir={run}",
    ]
    p = corrupt_run(args, "--corrupt-sync", 2, timeout=1700)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = metric_rows(run)
    assert len(rows) == 4
    assert [r["weight_sync/verified"] for r in rows] == [1.0] * 4
    assert [r["weight_sync/mismatch"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    for r in rows:
        assert abs(r["rollout_corr/kl_k1"]) < 1e-4, r["rollout_corr/kl_k1"]
    assert rows[-1]["weights/version"] == 5.0  # the start's push, then one per step


@pytest.mark.ray
@pytest.mark.slow
def test_vllm_fully_async_on_ray_runs_its_replica_process_from_the_actor(
    vllm_ready, ray_cluster, tiny_model_dir, tmp_path, digits_reward
):
    """``trainer.mode=fully_async trainer.backend=ray rollout.backend=vllm``: the Ray actor (the
    main venv's python, no vllm) starts the replica process with the vLLM venv's python inside
    its placement and forwards to it over 127.0.0.1; every push reaches the engine and is
    verified, the watchdog reads the replica process's CPU (its pid, on this machine), and the
    process ends with the run."""
    import os

    from trainer_helpers import fully_async_overrides

    from postrl.config import load_config
    from postrl.rollout.watchdog import process_cpu_ticks
    from postrl.trainer import RLTrainer

    train = write_parquet(generate_addition(8, seed=3), tmp_path / "train.parquet")
    test = write_parquet(generate_addition(2, seed=3, split="test"), tmp_path / "test.parquet")
    run = tmp_path / "run"
    args = [
        *fully_async_overrides(tiny_model_dir, train, test, digits_reward, run, steps=2),
        "data.train_batch_size=2",
        "trainer.async.parameter_sync_step=1",
        "trainer.test_freq=0",
        "rollout.backend=vllm",
        "rollout.max_num_seqs=16",
        "trainer.backend=ray",
    ]
    trainer = RLTrainer(load_config(None, args))
    try:
        (rep,) = trainer.ctx.fleet.replicas
        assert rep.local_pid == rep.pid and rep.pid != os.getpid()
        assert process_cpu_ticks(rep.pid) is not None
        cmdline = open(f"/proc/{rep.pid}/cmdline", "rb").read().split(b"\0")
        assert cmdline[0].decode() == vllm_ready  # the vLLM venv's python, not the actor's
        trainer.fit()
    finally:
        trainer.close()
    assert process_cpu_ticks(rep.pid) is None, "the replica process outlived the run"
    rows = metric_rows(run)
    assert len(rows) == 2
    pushes = [r for r in rows if "weights/version" in r]
    assert len(pushes) == 2
    assert all(r["weight_sync/verified"] == 1.0 for r in pushes)
    assert all(r["weight_sync/mismatch"] == 0.0 for r in pushes)
    assert (run / "rollout_replica_0.log").exists()
