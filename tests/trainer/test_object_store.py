"""``trainer.async.data_plane=object_store``: trajectories are run, scored and kept on the
rollout side (Ray's object store); the driver sees tags and references only, each training
worker fetches its own shard, and nothing is lost or trained twice.

* the step's stages on rows by reference (each rank materialises its shard, log-probs stay on
  the workers) equal the driver's update on the same trajectories (weights within float
  tolerance after one step: same padding, advantages, old log-probs, loss);
* a ``fully_async`` run on Ray with the object-store plane moves no tensor through the driver
  (counted per step by ``DRIVER_TRAFFIC``), where the driver plane moves every batch;
* a SIGKILLed replica loses nothing: its running trajectories run again elsewhere, its finished
  ones survive in the payload owner's store;
* a SIGKILLed driver resumes from its checkpoint with every prompt trained once;
* GAE with a critic and KL in the reward train on the plane, in ``fully_async``, ``sync`` and
  ``one_step_off`` (the taken groups fetched).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from trainer_helpers import (
    await_replacement,
    each_prompt_once_per_epoch,
    fully_async_overrides,
    metric_rows,
    train_subprocess,
)

from postrl.config import load_config
from postrl.data import generate_addition, write_parquet
from postrl.trainer import RLTrainer, hooks

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


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
        # the weight contract's probe (8 tokens and their log-probs per push, through
        # actor.compute_log_prob) is weight-sync traffic, tested with the contract; here the
        # driver's channels count trajectory traffic only
        "rollout.verify_weights=false",
    ]


def _fit(trainer: RLTrainer, faults: dict | None = None) -> list[dict]:
    """Run ``trainer`` with ``faults`` (fault point -> fn(trainer)); each step's driver traffic
    by channel."""
    traffic: list[dict] = []

    def hook(point: str) -> None:
        if point in (faults or {}):
            faults[point](trainer)  # type: ignore[index]
        if point.endswith(":end"):
            traffic.append(dict(trainer.traffic))

    hooks.install(hook)
    try:
        trainer.fit()
    finally:
        hooks.uninstall(hook)
        trainer.close()
    return traffic


def test_object_store_moves_no_tensor_through_the_driver_and_survives_a_killed_replica(
    ray_cluster, tiny_model_dir, digits_reward, tmp_path
):
    # the driver plane (one epoch): every batch's tensors go through the driver
    cfg = load_config(None, _args(tiny_model_dir, digits_reward, tmp_path, "driver", steps=8))
    for step in _fit(RLTrainer(cfg)):
        assert step[("out", "actor.update_actor")][1] > 0
    driver_rows = metric_rows(tmp_path / "run-driver")

    # the object store (two epochs, two replicas, one SIGKILLed at step 3)
    args = [
        *_args(tiny_model_dir, digits_reward, tmp_path, "object_store"),
        "rollout.num_replicas=2",
        "trainer.async.replica_health_interval_s=0.5",  # (Ray reports a killed actor dead)
        "trainer.async.max_replica_restarts=1",
    ]
    trainer = RLTrainer(load_config(None, args))
    first = list(trainer.ctx.fleet.replicas)
    killed: list[tuple[int, int, int]] = []  # (step, slot, its finished untrained trajectories)

    def kill(step: int):
        def fn(t: RLTrainer) -> None:
            if killed:
                return
            # the replica holding the most finished, untrained trajectories: their payloads
            # must outlive it (when none holds any yet, try again at the next step)
            held = [0] * len(first)
            for o in t.mode.feed.buffer.payloads().values():
                held[o.replica] += 1
            slot = max(range(len(first)), key=held.__getitem__)
            if held[slot]:
                killed.append((step, slot, held[slot]))
                os.kill(first[slot].pid, signal.SIGKILL)

        return fn

    def replaced(t: RLTrainer) -> None:
        assert killed, "no replica held finished trajectories at steps 3-6"
        await_replacement(t, first[killed[0][1]])

    faults = {f"step{i}:after_gen": kill(i) for i in range(3, 7)}
    faults["step11:after_gen"] = replaced
    traffic = _fit(trainer, faults)
    slot = killed[0][1]
    new = trainer.ctx.fleet.replicas[slot]
    assert new is not first[slot] and not new.dead and first[slot].dead_reason
    run = tmp_path / "run-object_store"
    each_prompt_once_per_epoch(run, 2, 16, steps_per_epoch=8)  # nothing lost or doubled
    rows = metric_rows(run)
    last = rows[-1]
    assert last["rollout/replica_failures"] == 1 and last["rollout/replica_restarts"] == 1
    assert last["rollout/live_replicas"] == 2
    assert last["rollout/reissued_requests"] > 0  # its running trajectories ran again

    assert len(traffic) == 16
    for step in traffic:
        data = {k: v for k, v in step.items() if k[1] not in ("weights", "actor.next_weight_frame")}
        tensors = {k: v for k, v in data.items() if v[1]}
        assert not tensors, tensors  # no tensor, either way
        n, _, calls = step.get(("in", "rollout.trajectory"), (0, 0, 0))
        # a call answers a group's 4 samples: per sample a tag (lengths, versions, score, ...)
        assert n <= 4 * 700 * calls, (n, calls)
        n, _, _ = step[("out", "actor.update_actor")]
        assert n < 3000, n  # 8 references and rows, 8 advantages, column references, meta
    for r in rows:
        assert r["driver/in_tensor_bytes"] == 0 and r["driver/out_tensor_bytes"] == 0, r
        assert np.isfinite(r["actor/pg_loss"])
    # the same metrics as the driver plane reports, bar the stages that ran on the workers
    stages = {"timing_s/old_log_prob", "timing_s/ref", "timing_s/reward", "timing_s/values"}
    missing = set().union(*driver_rows) - set().union(*rows)
    assert missing <= stages | {"timing_s/update_critic"}, missing


def _scored_rows(tokenizer_vocab: int, n_rows: int, seed: int) -> list:
    """One-row scored batches in the rollout layout (what a replica puts into the store)."""
    from postrl.agent import AgentLoopManager
    from postrl.agent.base import AgentLoopOutput
    from postrl.config import AgentConfig

    class _Tok:
        pad_token_id, eos_token_id = 0, 1

    mgr = AgentLoopManager(None, _Tok(), AgentConfig())
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_rows):
        p, r = 3 + i % 4, 2 + (i * 3) % 6
        out = AgentLoopOutput(
            prompt_ids=torch.randint(2, tokenizer_vocab, (p,), generator=g).tolist(),
            response_ids=torch.randint(2, tokenizer_vocab, (r,), generator=g).tolist(),
            response_mask=[1] * r,
            response_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
            response_versions=[(r, 0)],
        )
        row = {"uid": f"g{i // 2}", "index": i // 2, "sample_index": i % 2, "request_id": str(i)}
        b = mgr.assemble([out], [row])
        scores = torch.zeros(1, r)
        scores[0, -1] = float(i % 3 == 0)
        b.batch["token_level_scores"] = scores
        b.batch["sample_valid"] = torch.ones(1, dtype=torch.bool)
        rows.append(b)
    return rows


@pytest.mark.parametrize(
    "kl",
    [
        pytest.param(["trainer.num_workers=2"], id="ref-group-dp2"),
        pytest.param(["trainer.num_workers=1", "model.lora_rank=4"], id="lora-ref-dp1"),
    ],
)
def test_stages_on_rows_by_reference_equal_the_driver_update(
    ray_cluster, tiny_model_dir, tmp_path, kl
):
    """The same trajectories trained through the driver (pad, balance, old and reference
    log-probs, rollout correction, advantages, update with a KL loss) and by the same stages on
    rows by reference (each rank materialises its shard; log-probs stay on the workers) give the
    same weights: on 2 dp ranks with a reference group and a shard padded by a
    masked row, and with a LoRA model whose reference is itself with the adapters off."""
    from safetensors.torch import load_file

    from postrl.protocol.layout import concat_rollouts
    from postrl.trainer import stages
    from postrl.trainer.ref_batch import RefBatch, outcome_advantages
    from postrl.trainer.roles import build_roles

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "trainer.backend=ray",
            *kl,
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.5",
            "actor.ppo_epochs=2",  # (the second pass sees a policy apart from the reference)
            "trainer.num_threads=1",
            "rollout.n=2",
            "data.train_batch_size=5",
            "actor.ppo_mini_batch_size=5",
            "actor.fuse_old_log_prob=false",
            "algorithm.rollout_correction.rollout_is=token",
            "actor.optim.lr=1e-3",
        ],
    )
    rows = _scored_rows(100, 9, seed=3)  # 9 rows: dp 2 pads one masked row
    saved = {}
    for plane in ("driver", "object_store"):
        roles = build_roles(cfg, 1, use_ref=True, use_critic=False)
        try:
            if plane == "driver":
                batch = concat_rollouts(rows)
                batch.meta_info.update(temperature=cfg.rollout.temperature, global_step=1)
                batch, _ = roles.balance(batch)
                batch, _ = roles.old_log_probs(batch)
                batch, _ = roles.ref_log_probs(batch)
                batch, _ = stages.rollout_correction_stage(batch, cfg.algorithm.rollout_correction)
                batch = stages.compute_advantage_stage(batch, cfg.algorithm)
                _, metrics = roles.update_actor(batch)
            else:  # the same stages on rows by reference (no advantage here: the tags')
                groups = [(f"g{j}", j, rows[2 * j : 2 * j + 2]) for j in range(5)]
                batch = RefBatch.from_groups(groups)
                batch.meta_info.update(temperature=cfg.rollout.temperature, global_step=1)
                batch, _ = roles.balance(batch)
                batch, _ = roles.old_log_probs(batch)
                batch, _ = roles.ref_log_probs(batch)
                batch, _ = stages.rollout_correction_stage(batch, cfg.algorithm.rollout_correction)
                adv, _ = outcome_advantages(batch, cfg.algorithm)
                batch = batch.with_row_values(advantages=adv.numpy(), returns=adv.numpy())
                _, metrics = roles.update_actor(batch)
                assert set(batch.column_keys) >= {"old_log_probs", "ref_log_prob"}
            roles.save(tmp_path / plane)
        finally:
            roles.close()
        files = sorted((tmp_path / plane / "actor").rglob("*.safetensors"))
        saved[plane] = ({k: v for f in files for k, v in load_file(str(f)).items()}, metrics)
    (wa, ma), (wb, mb) = saved["driver"], saved["object_store"]
    assert wa.keys() == wb.keys()
    for k in wa:  # same rows on the same ranks: equal up to float reassociation
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)
    assert ma["actor/grad_norm"] > 0 and ma["actor/kl_loss"] != 0  # it trained, with a KL
    # (Adam's first step hardly sees a gradient's scale: the loss and its norm do)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key


def test_object_store_kill_and_resume_loses_and_duplicates_nothing(
    ray_cluster, tiny_model_dir, digits_reward, tmp_path, monkeypatch
):
    """SIGKILL the driver mid-epoch (a checkpoint at step 3 holds finished trajectories that
    lived in the object store), resume on the same Ray cluster: every prompt is trained once."""
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    plane = _args(tiny_model_dir, digits_reward, tmp_path, "object_store", steps=8)
    args = [*plane, "trainer.save_freq=3"]
    assert train_subprocess(args, threads=1, kill_at="step5:after_gen") == -9
    assert train_subprocess(args, threads=1) == 0
    run = tmp_path / "run-object_store"
    each_prompt_once_per_epoch(run, 1, 16, steps_per_epoch=8)
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["driver/in_tensor_bytes"] == 0 for r in rows)


@pytest.mark.parametrize("mode", ["fully_async", "sync", "one_step_off"])
def test_object_store_trains_a_critic_and_kl_in_the_reward(
    ray_cluster, tiny_model_dir, tmp_path, mode
):
    """GAE with a critic and KL in the reward on the object-store plane, in ``fully_async``,
    ``sync`` (the same replica actors and payload owner, staleness 0) and ``one_step_off``
    (its paused trajectories resume on the replicas after the push): the replicas
    still run, score and keep the trajectories; the stages that read tensors on the driver get
    the taken groups fetched there (channel ``object_store.fetch``, counted in ``driver/*``),
    and the step runs the driver plane's stages on them — the critic and the actor train."""
    # never 0: with the digits reward a step whose 16 samples hold no digit (seen once in a
    # loaded CI run of `one_step_off`, whose resumed samples depend on timing) has returns,
    # values (the critic's head starts at zero) and advantages all 0: both gradients are 0
    reward = tmp_path / "never_zero.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    d = sum(c.isdigit() for c in solution_str)\n"
        "    return (d + 1) / (len(solution_str) + 1)\n"
    )
    args = [
        *_args(tiny_model_dir, str(reward), tmp_path, "object_store", steps=2),
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "critic.optim.lr=1e-4",
        f"trainer.mode={mode}",
    ]
    trainer = RLTrainer(load_config(None, args))
    assert trainer.use_critic and trainer.use_ref
    assert type(trainer.ctx.runner).__name__ == "ObjectStoreRunner"
    traffic = _fit(trainer)
    rows = metric_rows(tmp_path / "run-object_store")
    assert len(rows) == 2 and len(traffic) == 2
    for r in rows:
        assert np.isfinite(r["critic/vf_loss"]) and np.isfinite(r["actor/pg_loss"]), r
        assert "actor/reward_kl_penalty_coeff" in r and "critic/values/mean" in r
        assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0, r  # both trained
        assert r["driver/in_tensor_bytes"] > 0  # the fetched groups, counted
        if mode == "sync":  # scored on the replicas, reported: the step's 4 groups of 4
            assert r["reward/scored"] == 16, r
    for step in traffic:
        n, tensors, _ = step[("in", "object_store.fetch")]
        assert tensors > 0 and n >= tensors  # 2 groups of 4 trajectories, fetched once
        assert step.get(("in", "rollout.trajectory"), (0, 0, 0))[1] == 0  # tags only
