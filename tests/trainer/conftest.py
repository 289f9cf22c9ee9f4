"""Fixtures for trainer tests: tiny model + addition parquet files + a small config."""

from __future__ import annotations

import pytest

from postrl.data import generate_addition, write_parquet


@pytest.fixture(scope="session")
def addition_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("addition")
    train = write_parquet(generate_addition(64, seed=0), d / "train.parquet")
    test = write_parquet(generate_addition(8, seed=0, split="test"), d / "test.parquet")
    return str(train), str(test)


@pytest.fixture(scope="session")
def epoch_files(tmp_path_factory):
    """16 training prompts (4 batches of 4 per epoch at ``data.train_batch_size=4``) and 4
    held-out ones: the small epochs of the tests that count each prompt's training by uid."""
    d = tmp_path_factory.mktemp("epoch16")
    train = write_parquet(generate_addition(16, seed=5), d / "train.parquet")
    test = write_parquet(generate_addition(4, seed=5, split="test"), d / "test.parquet")
    return train, test


@pytest.fixture
def small_overrides(tiny_model_dir, addition_files, tmp_path):
    """key=value overrides for a seconds-long GRPO run."""
    train, test = addition_files
    return [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "rollout.n=4",
        "rollout.response_length=8",
        "trainer.total_steps=2",
        "trainer.test_freq=2",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]


DIGITS_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    # dense, varied rewards so a random tiny model gets non-zero GRPO advantages\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)


@pytest.fixture(scope="session")
def digits_reward(tmp_path_factory):
    """Path of a custom reward file scoring the fraction of digits in the response."""
    p = tmp_path_factory.mktemp("rewards") / "digits.py"
    p.write_text(DIGITS_REWARD)
    return str(p)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster per test module, 4 logical CPUs (e.g. 2 rollout-replica bundles of
    1 CPU plus the training workers; threads are set apart by the configs)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
