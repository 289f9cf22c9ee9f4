"""``benchmarks/async_learning.py``: the tail (tool-latency) task is a valid config with a
held-out set disjoint from its training draw, sampled validation and the latency tool.
Correctness, never timing."""

from __future__ import annotations

import pytest
import yaml

from postrl.config import load_config, validate_config


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("async_learning")


def test_tail_task_is_the_latency_workload_with_a_held_out_set(bench, tmp_path, tiny_model_dir):
    from postrl.data.tasks import read_rows

    base, over = bench._tail_task(tmp_path, 2, "300,0.5,50,1500", str(tiny_model_dir))
    cfg = load_config(base, [*over, f"trainer.run_dir={tmp_path / 'run'}"])
    validate_config(cfg, check_registries=True)
    assert cfg.model.path == str(tiny_model_dir)
    assert cfg.rollout.val_kwargs.temperature == 1.0 and cfg.rollout.val_kwargs.n == 4
    train, val = read_rows(cfg.data.train_files[0]), read_rows(cfg.data.val_files[0])
    assert len(val) == 128
    prompts = lambda rows: {str(r["prompt"]) for r in rows}  # noqa: E731
    assert not prompts(val) & prompts(train), "held-out problems appear in the training draw"
    tool = yaml.safe_load(open(cfg.rollout.agent.tool_config_path))["tools"][0]["config"]
    assert tool["distribution"] == "lognormal"
    assert (tool["median_ms"], tool["sigma"]) == (300.0, 0.5)
    assert (tool["min_latency_ms"], tool["max_latency_ms"]) == (50.0, 1500.0)
