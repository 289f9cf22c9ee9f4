"""GRPO with the env_agent loop end to end: examples/envs/grpo_frozenlake.yaml shrunk onto the
tiny model and a 3x3 lake. Even samples are played by a scripted expert (they reach the goal,
return 1), odd samples by the random model (they never name a move: return 0), so the trained
scores, the masks of the observation turns and the update are all known."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import fit_with_snapshots

from postrl.config import load_config
from postrl.data import write_parquet
from postrl.envs import env_rows, make_env
from postrl.rollout.types import TokenOutput
from postrl.trainer.modes import SyncMode, register_trainer
from postrl.trainer.trainer import RLTrainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "grpo_frozenlake.yaml"
KW = {"size": 3, "holes": 1}
_K = re.compile(r"-k(\d+)-t(\d+)$")


def _expert_move(prompt_text: str) -> str:
    """The first move of a shortest path on the last grid the prompt shows."""
    last = prompt_text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    grid = last.splitlines()[-KW["size"] :]
    env = make_env("frozenlake", **KW)
    env.reset(0)
    cells = {(r, c): ch for r, row in enumerate(grid) for c, ch in enumerate(row)}
    env.pos = next(p for p, ch in cells.items() if ch == "P")
    env.goal = next(p for p, ch in cells.items() if ch == "G")
    env.holes = frozenset(p for p, ch in cells.items() if ch == "O")
    return env.solve()[0]


class ExpertOnEvenSamples:
    """Rollout client wrapper: even samples play the expert, odd ones the real engine."""

    def __init__(self, inner: Any, tokenizer: Any) -> None:
        self.inner, self.tok = inner, tokenizer

    async def generate(self, prompt_ids, sampling, request_id, trajectory_id=None):
        k = int(_K.search(request_id).group(1))
        if k % 2 == 0:
            text = self.tok.decode(prompt_ids, skip_special_tokens=False)
            ids = self.tok.encode(_expert_move(text) + "<|im_end|>", add_special_tokens=False)
            return TokenOutput(ids, [-0.5] * len(ids), "stop")
        return await self.inner.generate(
            prompt_ids, sampling, request_id=request_id, trajectory_id=trajectory_id
        )


@register_trainer("sync_env_script_test", on_policy=True, override=True)
class ScriptedEnvMode(SyncMode):
    """``sync`` with :class:`ExpertOnEvenSamples` around the client; records the batches."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        ctx.agents.client = ExpertOnEvenSamples(ctx.agents.client, ctx.tokenizer)
        self.trained: list[Any] = []

    def next_batch(self, step: int) -> Any:
        batch, metrics = super().next_batch(step)
        self.trained.append(batch)
        return batch, metrics


def test_grpo_frozenlake_recipe_trains(tiny_model_dir, tmp_path):
    train = write_parquet(env_rows("frozenlake", 4, env_kwargs=KW), tmp_path / "train.parquet")
    test = write_parquet(
        env_rows("frozenlake", 2, split="test", env_kwargs=KW), tmp_path / "test.parquet"
    )
    ov = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "rollout.n=4",
        "rollout.response_length=6",
        "rollout.agent.max_assistant_turns=4",
        "trainer.total_steps=2",
        "trainer.test_freq=0",
        "trainer.mode=sync_env_script_test",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    trainer = RLTrainer(load_config(EXAMPLE, ov))
    try:
        before, last, after = fit_with_snapshots(trainer)
        trained = trainer.mode.trained
    finally:
        trainer.close()
    assert not {k: v for k, v in last.items() if not math.isfinite(v)}
    # 2 prompts x 4 samples: the two experts per prompt reach the goal (return 1), the random
    # model never names a move within its 6 tokens (return 0)
    assert last["critic/score/mean"] == pytest.approx(0.5)
    assert last["agent/env/success"] == pytest.approx(0.5)
    assert last["reward/scored"] == 8 and last["reward/failed/total"] == 0
    # greedy validation before training: the random model solves nothing, accuracy = success
    assert "val/env/frozenlake/acc" in last or "val/acc/mean" in last
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for batch in trained:
        mask = batch.batch["response_mask"]
        extra = batch.non_tensor_batch["agent_extra"]
        for i in range(0, len(batch), 1):
            moves = len(extra[i]["turn_rewards"])
            flips = int((mask[i, 1:] != mask[i, :-1]).sum())
            if batch.non_tensor_batch["sample_index"][i] % 2 == 0:
                # expert: moves turns with moves - 1 observations between them (1,0,1,...,1)
                assert moves >= 2 and flips == 2 * (moves - 1) + int(mask[i, -1] == 0)
                assert extra[i]["turn_rewards"][-1] == 1.0
            else:
                assert moves == 0 and int(mask[i].sum()) == 6  # one truncated turn
