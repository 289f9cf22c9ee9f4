"""``trainer.async.data_plane=object_store``: trajectories are run, scored and kept on the
rollout side (Ray's object store); the driver sees tags and references only, each training
worker fetches its own shard, and nothing is lost or trained twice.

* the update from references equals the driver's update on the same trajectories (weights
  within float tolerance after one step: same padding, advantages, old log-probs, loss);
* a ``fully_async`` run on Ray with the object-store plane moves no tensor through the driver
  (counted per step by ``DRIVER_TRAFFIC``), where the driver plane moves every batch;
* a SIGKILLed replica loses nothing: its running trajectories run again elsewhere, its finished
  ones survive in the payload owner's store.
"""

from __future__ import annotations

import numpy as np
import pytest
from trainer_helpers import each_prompt_once_per_epoch, fully_async_overrides, metric_rows

from postrl.config import load_config
from postrl.data import generate_addition, write_parquet
from postrl.trainer import RLTrainer, hooks

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _args(tiny_model_dir, digits_reward, tmp_path, plane: str, steps: int = 16) -> list[str]:
    train = write_parquet(generate_addition(16, seed=5), tmp_path / "train.parquet")
    test = write_parquet(generate_addition(4, seed=5, split="test"), tmp_path / "test.parquet")
    return [
        *fully_async_overrides(
            tiny_model_dir, train, test, digits_reward, tmp_path / f"run-{plane}", steps
        ),
        "trainer.backend=ray",
        "trainer.num_workers=1",
        "trainer.test_freq=0",
        f"trainer.async.data_plane={plane}",
    ]


def _fit(trainer: RLTrainer) -> list[dict]:
    """Run ``trainer``; each step's driver traffic by channel."""
    traffic: list[dict] = []

    def hook(point: str) -> None:
        if point.endswith(":end"):
            traffic.append(dict(trainer.traffic))

    hooks.install(hook)
    try:
        trainer.fit()
    finally:
        hooks.uninstall(hook)
        trainer.close()
    return traffic


def test_object_store_run_moves_no_tensor_through_the_driver(
    ray_cluster, tiny_model_dir, digits_reward, tmp_path
):
    traffic, runs = {}, {}
    for plane in ("driver", "object_store"):
        cfg = load_config(None, _args(tiny_model_dir, digits_reward, tmp_path, plane))
        traffic[plane] = _fit(RLTrainer(cfg))
        runs[plane] = metric_rows(tmp_path / f"run-{plane}")
        # every prompt trained once per epoch, no group twice
        each_prompt_once_per_epoch(tmp_path / f"run-{plane}", 2, 16, steps_per_epoch=8)
    assert len(traffic["object_store"]) == 16
    for step in traffic["object_store"]:
        data = {k: v for k, v in step.items() if k[1] not in ("weights", "actor.next_weight_frame")}
        assert all(t == 0 for _, t, _ in data.values()), data  # no tensor, either way
        n, _, msgs = step.get(("in", "rollout.trajectory"), (0, 0, 0))
        assert n <= 700 * msgs, (n, msgs)  # a tag: lengths, versions, score, a reference
        n, _, _ = step[("out", "actor.update_actor_from_refs")]
        assert n < 2000, n  # 8 references, 8 advantages, the meta
    for step in traffic["driver"]:
        assert step[("out", "actor.update_actor")][1] > 0  # the batch's tensors
    for r in runs["object_store"]:
        assert r["driver/in_tensor_bytes"] == 0 and r["driver/out_tensor_bytes"] == 0, r
        assert np.isfinite(r["actor/pg_loss"])
    # the same metrics as the driver plane reports, bar the stages that ran on the workers
    stages = {"timing_s/old_log_prob", "timing_s/ref", "timing_s/reward", "timing_s/values"}
    missing = set().union(*runs["driver"]) - set().union(*runs["object_store"])
    assert missing <= stages | {"timing_s/update_critic"}, missing
