"""Declared needs have producers (postrl.trainer.needs), run here with real components: a tiny
model on the native rollout engine, the run's real reward function, the actor worker group."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from postrl.algos import get_adv_estimator
from postrl.config import load_config
from postrl.protocol import DataProto
from postrl.trainer import needs as N


@pytest.fixture
def make_ctx(tiny_model_dir, addition_files, digits_reward, tmp_path):
    """``make(overrides) -> (ctx, loader)``: the trainer's real step context (fleet, agent loops,
    reward stage, actor group) for a tiny GRPO-shaped config."""
    from postrl.controller import create_worker_group
    from postrl.data import PromptLoader, RLDataset, load_tokenizer
    from postrl.trainer.context import build_context
    from postrl.workers import ActorWorker

    made = []

    def make(overrides: list[str]):
        cfg = load_config(
            None,
            [
                f"model.path={tiny_model_dir}",
                f"data.train_files=[{addition_files[0]}]",
                "data.train_batch_size=3",
                "data.max_prompt_length=48",
                "actor.ppo_mini_batch_size=3",
                "rollout.n=4",
                "rollout.response_length=6",
                f"reward.custom_function.path={digits_reward}",
                f"trainer.run_dir={tmp_path / 'run'}",
                *overrides,
            ],
        )
        tok = load_tokenizer(cfg.model.path)
        data = RLDataset(cfg.data.train_files, tok, 48, "error", "prompt")
        loader = PromptLoader(data, 3, seed=0, shuffle=False)
        actor = create_worker_group(
            "local", ActorWorker, kwargs={"cfg": cfg, "total_steps": 1}, name="a", world_size=1
        )
        ctx = build_context(cfg, tok, loader, actor, None, multi_turn=False)
        made.append((ctx, actor))
        return ctx, loader

    yield make
    for ctx, actor in made:
        ctx.close()
        actor.shutdown()


def _digits(path: str):
    spec = importlib.util.spec_from_file_location("digits_reward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compute_score


def _rollout(ctx, loader, step: int):
    prompts = loader.next_batch()
    batch = ctx.generate(prompts, ctx.sampling_params(), ctx.cfg.rollout.n, step)
    batch, _ = ctx.reward.finish(batch)
    batch.meta_info.update(global_step=step, temperature=ctx.cfg.rollout.temperature)
    return prompts, batch


def test_remax_baseline_is_the_greedy_response_reward(make_ctx, digits_reward):
    ctx, loader = make_ctx(["algorithm.adv_estimator=remax"])
    prompts, batch = _rollout(ctx, loader, step=3)
    assert N.missing_needs(ctx.cfg, batch) == ["reward_baselines"]
    out, m = N.produce_missing(ctx, prompts, batch)
    base = out.batch["reward_baselines"]  # (B,)
    assert base.shape == (len(batch),) and N.missing_needs(ctx.cfg, out) == []
    # Oracle: decode one greedy response per prompt ourselves and score it with the function.
    sp = ctx.sampling_params()
    greedy = ctx.generate(prompts, type(sp)(**{**vars(sp), "temperature": 0.0}), 1, 3)
    score = _digits(digits_reward)
    tok = ctx.tokenizer
    want = {}
    for uid, ids, msk in zip(
        greedy.non_tensor_batch["uid"], greedy.batch["responses"], greedy.batch["response_mask"]
    ):
        text = tok.decode(ids[msk.bool()].tolist(), skip_special_tokens=True)
        want[uid] = score("addition", text, None)
    uids = list(out.non_tensor_batch["uid"])
    assert len(set(uids)) == 3 and sorted(want) == sorted(set(uids))
    for u, b in zip(uids, base.tolist()):  # broadcast: every sample of a group gets its baseline
        assert b == pytest.approx(want[u], abs=1e-6)
    assert m["remax/baseline_failed"] == 0
    assert m["remax/baseline_score/mean"] == pytest.approx(np.mean(list(want.values())), abs=1e-6)
    # the estimator now runs: A = score - baseline on every response token
    adv, _ = get_adv_estimator("remax")(
        token_level_rewards=out.batch["token_level_scores"],
        response_mask=out.batch["response_mask"],
        reward_baselines=base,
        sample_mask=out.batch["sample_valid"],
    )
    s = out.batch["token_level_scores"].sum(-1)
    first = adv[:, 0]
    torch.testing.assert_close(first, s - base)


def test_remax_baseline_groups_must_match(make_ctx):
    """Prompts other than the batch's: a typed error naming the rows, no KeyError. Matching is
    by dataset row, so a batch generated at an earlier step (async modes) still matches."""
    ctx, loader = make_ctx(["algorithm.adv_estimator=remax"])
    prompts, batch = _rollout(ctx, loader, step=1)
    batch.meta_info["global_step"] = 2  # taken one step after it was generated: fine
    out, _ = N.produce_reward_baselines(ctx, prompts, batch)
    assert bool(torch.isfinite(out.batch["reward_baselines"]).any())
    with pytest.raises(RuntimeError, match="greedy baseline rollout produced no row"):
        N.produce_reward_baselines(ctx, loader.next_batch(), batch)
    del batch.meta_info["global_step"]
    with pytest.raises(ValueError, match="global_step"):
        N.produce_reward_baselines(ctx, prompts, batch)


def test_sum_pi_squared_from_the_old_log_prob_pass_and_fallback(make_ctx):
    """The flag of log_prob_meta makes the step's old-log-prob pass produce it; the fallback
    producer (used when no such pass runs, e.g. bypass mode) gives the same values."""
    ctx, loader = make_ctx(["algorithm.adv_estimator=optimal_token_baseline"])
    prompts, batch = _rollout(ctx, loader, step=1)
    flags = N.log_prob_meta(ctx.cfg)
    assert flags == {"calculate_sum_pi_squared": True}
    stage4 = ctx.actor.compute_log_prob(
        DataProto(batch.batch, batch.non_tensor_batch, {**batch.meta_info, **flags})
    )
    sps = stage4.batch["sum_pi_squared"]
    mask = batch.batch["response_mask"].bool()
    assert bool((sps[mask] > 0).all() and (sps[mask] <= 1).all() and (sps[~mask] == 0).all())
    assert N.missing_needs(ctx.cfg, batch) == ["sum_pi_squared"]
    out, m = N.produce_missing(ctx, prompts, batch)
    assert m == {} and N.missing_needs(ctx.cfg, out) == []
    torch.testing.assert_close(out.batch["sum_pi_squared"], sps, atol=1e-6, rtol=0)
    # and OTB runs on it (old log-probs from the same pass)
    adv, ret = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=out.batch["token_level_scores"],
        response_mask=out.batch["response_mask"],
        index=np.asarray(out.non_tensor_batch["uid"]),
        old_log_probs=stage4.batch["old_log_probs"],
        sum_pi_squared=out.batch["sum_pi_squared"],
    )
    assert torch.isfinite(adv).all() and bool((adv[~mask] == 0).all())


def test_table_queries():
    """Roles, flags and fusion follow the table; a need with a standing stage has no producer."""
    cfg = lambda *ov: load_config(None, list(ov))  # noqa: E731
    assert N.roles_needed(cfg("algorithm.adv_estimator=gae")) == {"critic"}
    assert N.roles_needed(cfg("algorithm.adv_estimator=grpo")) == set()
    assert N.log_prob_meta(cfg("algorithm.adv_estimator=remax")) == {}
    assert N.fusion_blockers(cfg("algorithm.adv_estimator=remax")) == []
    assert N.required_needs(cfg("actor.policy_loss=bypass_mode")) == ["rollout_log_prob"]
    otb = cfg("algorithm.adv_estimator=optimal_token_baseline")
    empty = DataProto.from_dict({"responses": torch.zeros(2, 3, dtype=torch.long)})
    assert N.missing_needs(otb, empty) == ["sum_pi_squared"]  # old_log_probs: stage 4, no producer
    every = {n for n in N.NEEDS.names()}
    assert {
        "values",
        "reward_baselines",
        "sum_pi_squared",
        "old_log_probs",
        "ref_log_prob",
    } <= every
