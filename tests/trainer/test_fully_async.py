"""``trainer.mode=fully_async``: rollout replicas in processes of their own generate while the
trainer trains one mini-batch per step; weights pushed every ``parameter_sync_step`` steps
without aborting requests; nothing lost or duplicated across replica deaths and whole-run
kills; config errors name the field and the fix."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

import pytest
import torch
from trainer_helpers import metric_rows, train_subprocess

from postrl.config import ConfigError, load_config
from postrl.data import generate_addition, write_parquet
from postrl.trainer import RLTrainer
from postrl.trainer.ledger import read_ledger

pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def epoch_files(tmp_path_factory):
    """16 training prompts (4 batches of 4 per epoch, 8 mini-batch steps) and 4 held-out."""
    d = tmp_path_factory.mktemp("fasync")
    train = write_parquet(generate_addition(16, seed=5), d / "train.parquet")
    test = write_parquet(generate_addition(4, seed=5, split="test"), d / "test.parquet")
    return train, test


def _base(tiny_model_dir, epoch_files, digits_reward, run, steps: int = 16) -> list[str]:
    train, test = epoch_files
    return [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "actor.policy_loss=decoupled",
        "rollout.n=4",
        "rollout.response_length=8",
        "trainer.mode=fully_async",
        "trainer.async.parameter_sync_step=2",
        "trainer.async.max_staleness=1",
        f"trainer.total_steps={steps}",  # 8 mini-batch steps per epoch
        "trainer.test_freq=8",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "trainer.num_threads=1",
        f"reward.custom_function.path={digits_reward}",
        f"trainer.run_dir={run}",
    ]


def _each_prompt_once_per_epoch(run, epochs: int = 2, size: int = 16, per_epoch: int = 8):
    rows = read_ledger(run)
    assert [r["step"] for r in rows] == list(range(1, per_epoch * epochs + 1))
    uids = Counter(u for r in rows for u in r["uid"])
    assert max(uids.values()) == 1, "a group was trained twice"
    for e in range(epochs):
        idx = Counter(i for r in rows if r["epoch"] == e for i in r["index"])
        assert sorted(idx) == list(range(size)), f"epoch {e}: prompts lost {idx}"
        assert set(idx.values()) == {1}, f"epoch {e}: prompts duplicated {idx}"


def test_fully_async_trains_each_prompt_once_within_the_staleness_bound(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    cfg = load_config(None, _base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"))
    trainer = RLTrainer(cfg)
    assert trainer.total_steps == 16
    seen = []
    update = trainer.roles.update_actor

    def spy(batch):
        v = batch.batch["rollout_policy_version"]
        mask = batch.batch["response_mask"].bool()
        seen.append((trainer.ctx.fleet.version, v[mask].min().item(), len(batch)))
        return update(batch)

    trainer.roles.update_actor = spy
    pids = [r.process.pid for r in trainer.ctx.fleet.replicas]
    try:
        trainer.fit()
    finally:
        trainer.close()
    for pid in pids:  # the replica processes are gone with the trainer
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    _each_prompt_once_per_epoch(tmp_path / "run")
    rows = metric_rows(tmp_path / "run")
    assert all(n == 2 * 4 for *_, n in seen), "a step trains one mini-batch of 2 groups × 4"
    for current, oldest, _ in seen:
        assert current - oldest <= 1, "a token older than trainer.async.max_staleness was trained"
    versions = [r["weights/version"] for r in rows if "weights/version" in r]
    assert len(versions) == 8, "weights are pushed every parameter_sync_step=2 steps"
    assert max(r["replay/staleness/max"] for r in rows) <= 1
    assert all(r["rollout/live_replicas"] == 1 for r in rows)


def test_fully_async_config_errors_name_the_field_and_the_fix(small_overrides):
    base = [*small_overrides, "trainer.mode=fully_async"]
    with pytest.raises(ConfigError) as e:
        RLTrainer(load_config(None, [*base, "trainer.async.parameter_sync_step=3"]))
    msg = str(e.value)
    assert "data.train_batch_size=4 with trainer.mode=fully_async" in msg
    assert "parameter_sync_step × actor.ppo_mini_batch_size = 6" in msg
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [*base, "trainer.async.parameter_sync_step=2", "trainer.async.max_staleness=0"],
            )
        )
    assert "set trainer.async.max_staleness >= 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None, [*base, "trainer.async.parameter_sync_step=2", "trainer.deterministic=true"]
            )
        )
    assert "trainer.deterministic=true with trainer.mode=fully_async" in str(e.value)


def test_separate_async_is_an_alias(small_overrides):
    from postrl.trainer import TRAINER_MODES

    assert TRAINER_MODES.get("separate_async") is TRAINER_MODES.get("fully_async")
    with pytest.raises(ConfigError) as e:  # validated the same way
        RLTrainer(
            load_config(
                None,
                [
                    *small_overrides,
                    "trainer.mode=separate_async",
                    "trainer.async.parameter_sync_step=3",
                ],
            )
        )
    assert "trainer.mode=separate_async" in str(e.value)
