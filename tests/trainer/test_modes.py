"""The mode interface, proven from outside the package: a toy mode defined in this file produces
its batches its own way, registers itself, and trains through ``fit()`` with save and exact
resume — with no edit to ``postrl/``. Also: registry metadata ``on_policy`` drives the fusion check.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from trainer_helpers import metric_rows

from postrl.config import ConfigError, load_config
from postrl.protocol import DataProto
from postrl.trainer.modes import TRAINER_MODES, register_trainer
from postrl.trainer.roles import resolve_fuse_old_log_prob
from postrl.trainer.trainer import RLTrainer


@register_trainer("toy_reverse_test", on_policy=True, override=True)
class ReverseMode:
    """Walks the training set backwards, ``train_batch_size`` rows per step, ignoring the loader:
    its own cursor is its state. Each prompt gets ``rollout.n`` samples at the current weights."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.cursor = len(ctx.loader.dataset)
        self.seen: list[list[int]] = []
        self.synced = 0

    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        bs = self.ctx.cfg.data.train_batch_size
        if self.cursor < bs:
            self.cursor = len(self.ctx.loader.dataset)
        rows = list(range(self.cursor - 1, self.cursor - 1 - bs, -1))
        self.cursor -= bs
        self.seen.append(rows)
        prompts = self.ctx.loader.dataset.batch(rows)
        ctx = self.ctx
        batch = ctx.generate(prompts, ctx.sampling_params(), ctx.cfg.rollout.n, step, None)
        return batch, {"toy/cursor": float(self.cursor)}

    def sync_weights(self) -> dict[str, float]:
        self.synced += 1
        return self.ctx.sync_weights()

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])

    def close(self) -> None:
        pass


@register_trainer("toy_offpolicy_test", on_policy=False, override=True)
class OffPolicyMode(ReverseMode):
    """Same batches, declared off-policy."""


@register_trainer("toy_lifo_test", on_policy=False, take_order="lifo", override=True)
class LifoMode(ReverseMode):
    """Declares a take order no replay buffer has."""


def test_a_declared_take_order_is_checked_at_startup(small_overrides):
    with pytest.raises(ConfigError) as e:
        RLTrainer(load_config(None, [*small_overrides, "trainer.mode=toy_lifo_test"]))
    assert "trainer.mode=toy_lifo_test declares take_order='lifo'" in str(e.value)
    cfg = load_config(
        None,
        [*small_overrides, "trainer.mode=toy_lifo_test", "trainer.async.take_order=completion"],
    )
    from postrl.config.validate import async_errors

    assert not [m for m in async_errors(cfg) if "take_order" in m]


def _run(overrides: list[str]) -> tuple[list[list[int]], int]:
    trainer = RLTrainer(load_config(None, overrides))
    try:
        trainer.fit()
        return trainer.mode.seen, trainer.mode.cursor
    finally:
        trainer.close()


def test_external_mode_trains_saves_and_resumes_exactly(small_overrides, tmp_path, digits_reward):
    from postrl.data import generate_addition, write_parquet

    train = write_parquet(generate_addition(8, seed=5), tmp_path / "train8.parquet")
    """8 training rows, 4 per step: steps 1–4 see rows 7..4, 3..0, 7..4, 3..0. A run stopped
    after step 2 and resumed (its cursor restored from the checkpoint) logs what the
    uninterrupted run logged."""
    common = [
        *small_overrides,
        "trainer.mode=toy_reverse_test",
        "trainer.num_threads=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=2",
        f"data.train_files=[{train}]",
        f"reward.custom_function.path={digits_reward}",
        "data.val_files=[]",
    ]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    seen, _ = _run([*common, "trainer.total_steps=4", f"trainer.run_dir={full_dir}"])
    assert seen == [[7, 6, 5, 4], [3, 2, 1, 0], [7, 6, 5, 4], [3, 2, 1, 0]]
    _run([*common, "trainer.total_steps=2", f"trainer.run_dir={cut_dir}"])
    state = json.loads((cut_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["mode"] == {"cursor": 0}  # the mode's own state is in the checkpoint
    resumed, _ = _run([*common, "trainer.total_steps=4", f"trainer.run_dir={cut_dir}"])
    assert resumed == [[7, 6, 5, 4], [3, 2, 1, 0]]  # steps 3 and 4 only, from the cursor
    full, cut = metric_rows(full_dir), metric_rows(cut_dir)
    assert [r["step"] for r in cut] == [1, 2, 3, 4]
    diff = {
        (r["step"], k): (r.get(k), c.get(k))
        for r, c in zip(full, cut)
        for k in set(r) | set(c)
        if r.get(k) != c.get(k)
    }
    assert not diff  # exact resume through the external mode (1 thread)
    assert full[-1]["weights/version"] == 5  # the initial push + one sync per step
    assert all(r["actor/grad_norm"] > 0 for r in full)  # it trained
    assert [r["toy/cursor"] for r in full] == [4, 0, 4, 0]  # the mode's metrics are logged


def test_on_policy_metadata_drives_old_log_prob_fusion(small_overrides):
    base = [*small_overrides, "actor.ppo_mini_batch_size=4"]  # one mini-batch: fusable
    assert TRAINER_MODES.meta("sync")["on_policy"] is True
    assert resolve_fuse_old_log_prob(load_config(None, [*base, "trainer.mode=toy_reverse_test"]))
    off = load_config(None, [*base, "trainer.mode=toy_offpolicy_test"])
    assert not resolve_fuse_old_log_prob(off)  # an off-policy mode never gets ratio ≡ 1
    with pytest.raises(ConfigError, match="off-policy"):
        RLTrainer(
            load_config(
                None, [*base, "trainer.mode=toy_offpolicy_test", "actor.fuse_old_log_prob=true"]
            )
        )


@pytest.mark.parametrize("freeze", [True, False])
def test_fit_keeps_the_startup_heap_off_the_collector_only_while_it_trains(small_overrides, freeze):
    """``trainer.freeze_gc``: the objects alive when ``fit`` starts are frozen during the steps
    (no full collection walks the model) and handed back to the collector when it returns."""
    import gc

    from postrl.trainer.hooks import install, uninstall

    seen: list[int] = []
    hook = install(
        lambda point: seen.append(gc.get_freeze_count()) if point.endswith(":end") else None
    )
    try:
        trainer = RLTrainer(load_config(None, [*small_overrides, f"trainer.freeze_gc={freeze}"]))
        try:
            trainer.fit()
        finally:
            trainer.close()
    finally:
        uninstall(hook)
    assert len(seen) == 2
    if freeze:
        assert min(seen) > 10_000  # torch's and transformers' modules, the model, the data
    else:
        assert seen == [0, 0]
    assert gc.get_freeze_count() == 0
