"""The env_agent loop: observation tokens masked, sampled ids kept, per-turn rewards summed or
discounted, the return scoring the trajectory through the reward stage; on a real tiny model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from agent_helpers import ScriptedClient

from postrl.agent import AgentLoopManager
from postrl.agent.env_loop import EnvAgentLoop
from postrl.config.schema import AgentConfig, EnvConfig
from postrl.envs import ENVS, env_rows, make_env
from postrl.reward import RewardLoop, RewardStage
from postrl.rollout import SamplingParams, TokenOutput, create_rollout_backend

KW = {"size": 3, "holes": 1, "invalid_reward": -0.5}


def _row(tokenizer, env: str = "frozenlake", kw: dict | None = None, seed: int = 0) -> dict:
    row = env_rows(env, 1, seed=seed, env_kwargs=kw)[0]
    msgs = row["prompt"]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return {
        "raw_prompt_ids": tokenizer.encode(text, add_special_tokens=False),
        "messages": msgs,
        "data_source": row["data_source"],
        "ground_truth": "",
        "extra_info": row["extra_info"],
        "request_id": "r0",
        "uid": "0-0",
        "sample_index": 0,
        "index": 0,
        "seed": 11,
    }


def _plan(row: dict) -> list[str]:
    info = row["extra_info"]
    env = make_env(info["env"], **info.get("env_kwargs", {}))
    env.reset(info["seed"])
    return env.solve()


def _config(turns: int = 8, gamma: float = 1.0) -> AgentConfig:
    return AgentConfig(
        default_agent_loop="env_agent",
        max_assistant_turns=turns,
        max_tool_response_length=64,
        env=EnvConfig(gamma=gamma),
    )


def _play(tokenizer, row, script, config, max_new_tokens=8):
    client = ScriptedClient(tokenizer, [t + "<|im_end|>" for t in script])
    loop = EnvAgentLoop(client, tokenizer, config)
    out = asyncio.run(loop.run(SamplingParams(max_new_tokens=max_new_tokens, seed=3), **row))
    return out, client


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_masks_and_rewards_by_hand(tokenizer, gamma):
    row = _row(tokenizer, kw=KW)
    plan = _plan(row)
    out, client = _play(tokenizer, row, ["jump", *plan], _config(gamma=gamma))
    # turn rewards: invalid (-0.5), then 0 per move and 1.0 for the move onto the goal
    rewards = [-0.5] + [0.0] * (len(plan) - 1) + [1.0]
    assert out.extra["turn_rewards"] == rewards
    # G = Σ γ^t r_t: γ=1 → -0.5 + 1 = 0.5; γ=0.5 → -0.5 + 0.5^len(plan)
    expected = 0.5 if gamma == 1.0 else -0.5 + 0.5 ** len(plan)
    assert out.extra["reward"] == {"score": pytest.approx(expected), "acc": 1.0}
    assert out.metrics["agent/env/success"] == 1.0
    assert out.metrics["agent/env/turns"] == len(plan) + 1
    assert out.extra["termination"] == "done"
    # the trajectory is the chat template of the whole conversation, and mask 1 exactly on
    # the sampled ids of each turn (the observations in between are mask 0)
    convo = tokenizer.apply_chat_template(out.extra["messages"], tokenize=False)
    ids = tokenizer.encode(convo, add_special_tokens=False)
    full = out.prompt_ids + out.response_ids
    assert full == ids[: len(full)] and len(ids) - len(full) <= 1  # template's closing "\n"
    sampled = [t for t, m in zip(out.response_ids, out.response_mask) if m]
    assert sampled == [t for g in client.generated for t in g]
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask) if not m] == [0.0] * (
        len(out.response_ids) - len(sampled)
    )
    # each generation's prompt is everything before it, as sampled (never re-tokenised)
    for prompt in client.prompts:
        assert prompt == full[: len(prompt)]
    assert sum(n for n, _ in out.response_versions) == len(out.response_ids)


def test_turn_budget_hole_and_truncated_turn(tokenizer):
    row = _row(tokenizer, kw=KW)
    out, _ = _play(tokenizer, row, ["jump"] * 5, _config(turns=3))
    assert out.extra["termination"] == "max_assistant_turns"
    assert out.extra["turn_rewards"] == [-0.5, -0.5, -0.5]
    assert out.extra["reward"]["acc"] == 0.0
    # a turn cut by max_new_tokens ends the episode without stepping the environment
    out, _ = _play(tokenizer, row, ["right right right right"], _config(), max_new_tokens=4)
    assert out.finish_reason == "length" and out.extra["turn_rewards"] == []
    assert out.extra["reward"] == {"score": 0.0, "acc": 0.0}


def test_row_checks_and_env_errors(tokenizer):
    row = _row(tokenizer, kw=KW)
    bad = dict(row, extra_info={"seed": 1})
    with pytest.raises(ValueError, match="extra_info.env"):
        _play(tokenizer, bad, ["up"], _config())
    other = dict(row, extra_info=dict(row["extra_info"], seed=row["extra_info"]["seed"] + 2))
    with pytest.raises(ValueError, match="does not end with the first observation"):
        _play(tokenizer, other, ["up"], _config())

    class Broken:
        def reset(self, seed: int) -> str:
            return "state"

        def step(self, action: str) -> tuple[str, float, bool]:
            raise KeyError("boom")

    ENVS.add("test_broken", Broken, override=True)
    row = _row(tokenizer)
    msgs = [{"role": "user", "content": "state"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    row.update(
        messages=msgs,
        raw_prompt_ids=tokenizer.encode(text, add_special_tokens=False),
        extra_info={"env": "test_broken", "seed": 0},
    )
    out, _ = _play(tokenizer, row, ["up"], _config())
    assert "boom" in out.extra["reward"]["error"] and out.metrics["agent/env/errors"] == 1.0


class _FirstMoveScripted:
    """Turn 0 is a scripted move ("left", log-prob -1); later turns come from the real engine."""

    def __init__(self, backend: Any, tokenizer: Any) -> None:
        self.backend, self.tok = backend, tokenizer

    async def generate(self, prompt_ids, sampling, request_id, trajectory_id=None):
        if request_id.endswith("-t0"):
            ids = self.tok.encode("left<|im_end|>", add_special_tokens=False)
            return TokenOutput(ids, [-1.0] * len(ids), "stop")
        return await self.backend.generate(prompt_ids, sampling, request_id)


def _runs(mask) -> list[tuple[int, int]]:
    """(value, length) runs of a 1-D 0/1 tensor."""
    out: list[tuple[int, int]] = []
    for v in mask.tolist():
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def test_real_model_batch_is_scored_by_its_return(tiny_model_dir, tokenizer):
    """A random tiny model plays sokoban through the manager; the reward stage scores each
    row with the loop's return (no reward function exists for ``env/sokoban``)."""
    from postrl.data import RLDataset, write_parquet

    backend = create_rollout_backend(
        "native", tiny_model_dir, max_num_seqs=8, max_model_len=512, device="cpu"
    )
    try:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = write_parquet(env_rows("sokoban", 2, seed=0), f"{d}/rows.parquet")
            ds = RLDataset([str(path)], tokenizer, max_prompt_length=256)
            prompts = ds.batch([0, 1])
        client = _FirstMoveScripted(backend, tokenizer)
        manager = AgentLoopManager(client, tokenizer, _config(turns=3, gamma=0.9))
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
        batch = asyncio.run(manager.generate(prompts, sampling, n=2, seed=0, step=0))
    finally:
        backend.close()
    extras = list(batch.non_tensor_batch["agent_extra"])
    mask = batch.batch["response_mask"]
    lp = batch.batch["rollout_log_probs"]
    obs_head = tokenizer.encode("\n<|im_start|>user\n", add_special_tokens=False)
    left = tokenizer.encode("left<|im_end|>", add_special_tokens=False)
    for i, e in enumerate(extras):
        # turn 0 (scripted) moved; its observation follows with mask 0; turn 1 is sampled
        assert e["turn_rewards"][0] == pytest.approx(-0.1)
        runs = _runs(mask[i][: int(batch.batch["attention_mask"][i, -mask.shape[1] :].sum())])
        assert runs[0] == (1, len(left)) and runs[1][0] == 0 and runs[2][0] == 1
        start = runs[0][1]
        obs = batch.batch["responses"][i, start : start + runs[1][1]].tolist()
        assert obs[: len(obs_head)] == obs_head
        assert tokenizer.decode(obs).endswith("<|im_start|>assistant\n")
        sampled = slice(start + runs[1][1], start + runs[1][1] + runs[2][1])
        assert bool((lp[i, sampled] < 0).all()) and bool((lp[i, start : sampled.start] == 0).all())
        g = sum(0.9**t * r for t, r in enumerate(e["turn_rewards"]))
        assert e["reward"]["score"] == pytest.approx(g)
    with RewardLoop(num_workers=1) as loop:  # never started: no function is called
        stage = RewardStage(loop, tokenizer)
        scored, metrics = stage.finish(batch)
    sums = scored.batch["token_level_scores"].sum(-1)
    assert sums.tolist() == pytest.approx([e["reward"]["score"] for e in extras])
    assert bool(scored.batch["sample_valid"].all()) and metrics["reward/failed/total"] == 0
