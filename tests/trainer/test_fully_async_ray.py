"""``trainer.mode=fully_async`` with ``trainer.backend=ray``: the rollout replicas are Ray actors
on a placement group of their own (apart from the training workers'), weights reach them as
bucket frames while they serve, a SIGKILLed replica actor is detected, its requests re-issued
and its slot restarted on the same bundle, and every prompt is trained exactly once."""

from __future__ import annotations

import os
import signal

import pytest
from trainer_helpers import (
    await_replacement,
    each_prompt_once_per_epoch,
    fully_async_overrides,
    metric_rows,
)

from postrl.config import load_config
from postrl.data import generate_addition, write_parquet
from postrl.trainer import RLTrainer, hooks

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


def test_fully_async_on_ray_places_replicas_apart_and_restarts_a_killed_one(
    ray_cluster, tiny_model_dir, digits_reward, tmp_path
):
    train = write_parquet(generate_addition(16, seed=5), tmp_path / "train.parquet")
    test = write_parquet(generate_addition(4, seed=5, split="test"), tmp_path / "test.parquet")
    run = tmp_path / "run"
    args = [
        *fully_async_overrides(tiny_model_dir, train, test, digits_reward, run),
        "rollout.num_replicas=2",
        "rollout.weight_bucket_mb=0.05",  # several frames per push
        "trainer.backend=ray",
        "trainer.num_workers=2",
        "trainer.async.replica_health_interval_s=0.5",  # (Ray reports a killed actor dead)
        "trainer.async.max_replica_restarts=1",
    ]
    trainer = RLTrainer(load_config(None, args))
    fleet = trainer.ctx.fleet
    first = list(fleet.replicas)
    workers = set(trainer.roles.actor.pids)
    pids = {r.pid for r in first}
    assert len(pids) == 2 and not pids & workers and os.getpid() not in pids

    # the replicas' placement group is their own: one 1-CPU bundle per replica
    table = ray.util.placement_group_table()
    groups = [g for g in table.values() if g["name"].startswith("rollout_replicas")]
    assert len(groups) == 1 and groups[0]["state"] == "CREATED"
    assert list(groups[0]["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]

    def kill(_):
        os.kill(first[0].pid, signal.SIGKILL)

    faults = {"step3:after_gen": kill, "step8:after_gen": lambda t: await_replacement(t, first[0])}

    def hook(point: str) -> None:
        if point in faults:
            faults[point](trainer)

    hooks.install(hook)
    try:
        trainer.fit()
        new = fleet.replicas[0]
        assert new is not first[0] and not new.dead and new.pid not in pids
        assert new.policy_version == fleet.version, "the restarted replica missed a push"
        busy = new.busy_s
    finally:
        hooks.uninstall(hook)
        trainer.close()
    assert first[0].dead_reason and "Ray actor died" in first[0].dead_reason
    assert busy > 0, "the restarted replica never generated"
    each_prompt_once_per_epoch(run, 2, 16, steps_per_epoch=8)
    rows = metric_rows(run)
    last = rows[-1]
    assert last["rollout/replica_failures"] == 1
    assert last["rollout/replica_restarts"] == 1
    assert last["rollout/live_replicas"] == 2
    assert last["rollout/reissued_requests"] > 0
    pushes = [r for r in rows if "weights/version" in r]
    assert len(pushes) == 8 and all(r["weights/buckets"] > 1 for r in pushes)
    # the placement group goes with the run
    left = [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith("rollout_replicas") and g["state"] != "REMOVED"
    ]
    assert not left, left
