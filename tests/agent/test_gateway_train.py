"""``postrl train`` with the gateway loop on the tiny model: sync (a command agent) and
one_step_off (an in-process entrypoint agent). Multi-turn and multi-segment trajectories reach
the update: the captured batches hold each run's segment rows, with observation tokens masked,
and the parameters move."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from postrl.config import load_config
from postrl.data import generate_addition, write_parquet
from postrl.trainer.trainer import RLTrainer

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("gw_addition")
    return str(write_parquet(generate_addition(16, seed=0), d / "train.parquet"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,agent",
    [
        ("sync", f"rollout.agent.gateway.command={sys.executable} {HERE / 'gw_agents.py'} e2e"),
        ("one_step_off", "rollout.agent.gateway.entrypoint=gw_agents:e2e_agent"),
    ],
)
def test_gateway_trains(tiny_model_dir, train_file, tmp_path, mode, agent):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{train_file}]",
            "data.val_files=[]",
            "data.train_batch_size=2",
            "data.max_prompt_length=48",
            "actor.ppo_mini_batch_size=2",
            "actor.optim.lr=1e-3",
            "rollout.n=2",
            "rollout.response_length=8",
            "rollout.agent.default_agent_loop=gateway",
            agent,
            "rollout.agent.gateway.timeout_s=120",
            f"trainer.mode={mode}",
            "trainer.total_steps=1",
            "trainer.loggers=[jsonl]",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.save_freq=0",
        ],
    )
    trainer = RLTrainer(cfg)
    seen = []
    update = trainer.roles.update_actor

    def spy(batch, *a, **kw):
        seen.append(batch)
        return update(batch, *a, **kw)

    trainer.roles.update_actor = spy
    before = {k: v.detach().clone() for k, v in trainer.roles.actor.get_per_tensor_param()}
    try:
        last = trainer.fit()
        after = dict(trainer.roles.actor.get_per_tensor_param())
    finally:
        trainer.close()
    assert last["agent/gateway_failures"] == 0.0
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert len(seen) == 1
    for batch in seen:
        nt, b = batch.non_tensor_batch, batch.batch
        seg = nt["segment"]
        odd = [int(i) % 2 == 1 for i in nt["index"]]
        own = seg == 0
        assert own.sum() == 4  # 2 prompts x n=2 runs
        # every odd-index run brought its earlier conversation as a segment row
        assert (seg > 0).sum() == sum(o for o, s in zip(odd, seg) if s == 0)
        scores = b["token_level_scores"].sum(-1)
        for i in range(len(seg)):
            if seg[i] > 0:  # same run (uid, sample) → same score
                j = next(
                    j
                    for j in range(len(seg))
                    if seg[j] == 0
                    and nt["uid"][j] == nt["uid"][i]
                    and nt["sample_index"][j] == nt["sample_index"][i]
                )
                assert scores[i] == scores[j]
        # two-turn rows: observation tokens ("Sure?" user turn) are in the response, masked
        mask = b["response_mask"]
        for i in range(len(seg)):
            n = int(b["attention_mask"][i, -mask.shape[1] :].sum())
            if seg[i] == 0 and not odd[i] or seg[i] > 0:
                assert 0 < int(mask[i, :n].sum()) < n  # sampled turns + a masked observation
    assert last["agent/gateway_segments"] > 1.0  # mean over runs: odd rows have 2


@pytest.mark.ray
@pytest.mark.slow
def test_gateway_trains_fully_async_on_ray(tiny_model_dir, train_file, tmp_path):
    """The gateway loop with ``trainer.backend=ray`` in ``fully_async`` (rollout replicas as
    Ray actors, weights pushed while agents run), 2 steps: no failures, multi-segment runs
    reach the update, every sampled token keeps the policy version that sampled it (known,
    >= 0) and observation tokens none (-1). The ``object_store`` data plane refuses segment
    loops at startup (one row per sample), checked in test_gateway.py."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"data.train_files=[{train_file}]",
                "data.val_files=[]",
                "data.train_batch_size=2",
                "data.max_prompt_length=48",
                "actor.ppo_mini_batch_size=2",
                "actor.optim.lr=1e-3",
                "rollout.n=2",
                "rollout.response_length=8",
                "rollout.agent.default_agent_loop=gateway",
                f"rollout.agent.gateway.command={sys.executable} {HERE / 'gw_agents.py'} e2e",
                "rollout.agent.gateway.timeout_s=120",
                "trainer.mode=fully_async",
                "trainer.backend=ray",
                "trainer.num_workers=1",
                "trainer.total_steps=2",
                "trainer.loggers=[jsonl]",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.save_freq=0",
            ],
        )
        trainer = RLTrainer(cfg)
        seen = []
        update = trainer.roles.update_actor

        def spy(batch, *a, **kw):
            seen.append(batch)
            return update(batch, *a, **kw)

        trainer.roles.update_actor = spy
        try:
            last = trainer.fit()
        finally:
            trainer.close()
    finally:
        ray.shutdown()
    assert last["agent/gateway_failures"] == 0.0
    assert last["agent/gateway_segments"] >= 1.0
    assert last["actor/grad_norm"] > 0
    assert len(seen) == 2
    # multi-segment runs (odd dataset rows) reach the update: in some step, not necessarily the
    # last, since completion order may take two single-segment groups last (it did once)
    assert any((b.non_tensor_batch["segment"] > 0).any() for b in seen)
    for batch in seen:
        b = batch.batch
        mask, versions = b["response_mask"].bool(), b["rollout_policy_version"]
        seg, index = batch.non_tensor_batch["segment"], batch.non_tensor_batch["index"]
        # every odd-index run brought its rewritten conversation as a segment row
        assert (seg > 0).sum() == sum(int(i) % 2 == 1 for i, s in zip(index, seg) if s == 0)
        assert (versions[mask] >= 0).all()  # sampled tokens: the version that sampled them
        n = b["attention_mask"][:, -mask.shape[1] :].bool()
        assert (versions[n & ~mask] == -1).all()  # observation tokens: no policy
