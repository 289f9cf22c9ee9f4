"""Agentic RL end to end: GRPO with the tool loop, SFT-warmed tool use, and the sandboxed code
reward.

* ``test_grpo_with_tool_loop_end_to_end`` — a few GRPO steps on the tiny model with
  ``tool_agent`` on tool-arith rows (local backend, native rollout). The first assistant turn of
  each trajectory is scripted (a correct calculator call, or a malformed one for every fourth
  sample) and some final answers are scripted too, so tool calls, tool errors, observations and
  non-constant rewards are guaranteed; every other turn is sampled from the model. The batch
  the actor is trained on is captured and its ``response_mask`` checked to be 0 exactly on the
  observation tokens.
* ``test_sft_on_demonstrations_teaches_tool_calls`` (slow) — SFT on 200 demonstrations without
  a system prompt (the call format is learned from the demonstrations alone), then a rollout
  through the tool loop emits parseable calls.
* ``test_code_reward_through_the_reward_loop`` — generated code tasks scored in the sandbox by
  the reward loop's worker processes; sandbox failures are reported as failures, not scores.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import fit_with_snapshots

from postrl.config import load_config
from postrl.data import write_parquet
from postrl.data.code_tasks import generate_code_tasks
from postrl.data.tool_arith import generate_tool_arith, tool_arith_demonstrations
from postrl.reward import RewardLoop, RewardRequest
from postrl.rollout.types import TokenOutput
from postrl.tools.base import ToolResponse
from postrl.tools.calculator import CalculatorTool
from postrl.trainer.modes import SyncMode, register_trainer
from postrl.trainer.trainer import RLTrainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_tool_arith.yaml"
TOOLS = f"rollout.agent.tool_config_path={ROOT / 'examples' / 'tools' / 'calculator.yaml'}"
OBS_HEAD = "\n<|im_start|>user\n<tool_response>\n"
OBS_TAIL = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
_QUESTION = re.compile(r"What is (.+?)\? Use the calculator\.")
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_K = re.compile(r"-k(\d+)-t(\d+)$")


class FirstTurnScript:
    """Rollout client wrapper: scripts the tool call (turn 0) and, for even samples, the answer.

    Sample ``k`` of each prompt: ``k % 4 == 3`` writes a malformed call (an error observation),
    the others a correct calculator call for the question in the prompt. On turn 1, even
    samples answer with the number in the last tool response; odd samples (and every other
    generation) are sampled from the real engine.
    """

    def __init__(self, inner: Any, tokenizer: Any) -> None:
        self.inner, self.tok = inner, tokenizer
        self.scripted: dict[str, list[int]] = {}

    def _out(self, text: str, request_id: str) -> TokenOutput:
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        self.scripted[request_id] = ids
        return TokenOutput(ids, [-1.0] * len(ids), "stop")

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Any,
        request_id: str,
        trajectory_id: str | None = None,
    ) -> TokenOutput:
        k, turn = (int(g) for g in _K.search(request_id).groups())
        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        if turn == 0:
            if k % 4 == 3:
                return self._out("<tool_call>\n{not json</tool_call>", request_id)
            expr = _QUESTION.findall(text)[-1]
            call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
            return self._out(f"<tool_call>\n{call}\n</tool_call>", request_id)
        if turn == 1 and k % 2 == 0:
            return self._out(f"The answer is {_RESULT.findall(text)[-1]}.", request_id)
        return await self.inner.generate(
            prompt_ids, sampling, request_id=request_id, trajectory_id=trajectory_id
        )


@register_trainer("sync_tool_script_test", on_policy=True, override=True)
class ScriptedToolMode(SyncMode):
    """``sync`` with :class:`FirstTurnScript` around the client; records the rollout batches."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.script = FirstTurnScript(ctx.agents.client, ctx.tokenizer)
        ctx.agents.client = self.script
        self.trained: list[Any] = []

    def next_batch(self, step: int) -> Any:
        batch, metrics = super().next_batch(step)
        self.trained.append(batch)
        return batch, metrics


@pytest.fixture(scope="module")
def tool_arith_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tool_arith")
    train = write_parquet(
        generate_tool_arith(16, seed=0, min_digits=2, max_digits=3), d / "train.parquet"
    )
    return str(train)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(value, length) runs of a 1-D 0/1 tensor."""
    out: list[tuple[int, int]] = []
    for v in mask.tolist():
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


class RewardingCalculator(CalculatorTool):
    """The calculator, plus a step reward of 0.25 for every call it evaluates."""

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        out = await super().execute(instance_id, parameters)
        return out if out.error else ToolResponse(out.text, reward_delta=0.25)


@pytest.mark.parametrize("weight", [1.0, 0.0])
def test_tool_rewards_reach_the_trained_score(tiny_model_dir, tool_arith_files, tmp_path, weight):
    """A tool's ``reward_delta`` is summed per trajectory and added to its score with
    ``reward.tool_reward_weight``. Per step: 3 of 4 samples make a well-formed call (+0.25 each)
    and the even samples (2 of 4) answer correctly (rule reward 1), so the trained scores
    average 0.5 + weight × 0.75 / 4."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: test_tool_rl:RewardingCalculator\n    config: {max_digits: 50}\n"
    )
    ov = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{tool_arith_files}]",
        "data.val_files=[]",
        "data.train_batch_size=1",
        "data.max_prompt_length=512",
        "actor.ppo_mini_batch_size=1",
        "rollout.n=4",
        "rollout.response_length=96",
        "trainer.total_steps=1",
        "trainer.mode=sync_tool_script_test",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}",
        f"reward.tool_reward_weight={weight}",
        f"rollout.agent.tool_config_path={tools}",
    ]
    trainer = RLTrainer(load_config(EXAMPLE, ov))
    try:
        last = trainer.fit()
    finally:
        trainer.close()
    assert last["agent/num_tool_calls"] == pytest.approx(0.75)
    assert last["reward/tool_reward/mean"] == pytest.approx(0.25 * 3 / 4)
    assert last["critic/score/mean"] == pytest.approx(0.5 + weight * 0.25 * 3 / 4)


def test_grpo_with_tool_loop_end_to_end(tiny_model_dir, tool_arith_files, tmp_path):
    ov = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{tool_arith_files}]",
        "data.val_files=[]",
        "data.train_batch_size=1",
        "data.max_prompt_length=512",
        "actor.ppo_mini_batch_size=1",
        "actor.optim.lr=1e-4",
        "rollout.n=4",
        "rollout.response_length=96",
        "trainer.total_steps=2",
        "trainer.mode=sync_tool_script_test",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.save_freq=0",
    ]
    cfg = load_config(EXAMPLE, [*ov, TOOLS])
    assert cfg.rollout.agent.check_token_faithfulness and cfg.rollout.agent.max_assistant_turns == 2
    trainer = RLTrainer(cfg)
    try:
        before, last, after = fit_with_snapshots(trainer)
        mode, tok = trainer.mode, trainer.tokenizer
    finally:
        trainer.close()

    bad = {k: v for k, v in last.items() if not math.isfinite(v)}
    assert not bad, bad
    # per step: 1 prompt x 4 samples; 3 of 4 make a well-formed call, 1 a malformed one
    assert last["agent/num_tool_calls"] == pytest.approx(0.75)
    assert last["agent/tool_errors"] == pytest.approx(0.25)
    assert last["agent/token_drift_ratio"] == 0.0
    # the malformed call's parse error is capped at max_tool_response_length like tool output
    assert last["agent/tool/errors/malformed_call"] == 1.0 and last["agent/tool/truncated"] == 1.0
    assert "agent/tool_time_s" in last and "agent/num_assistant_turns" in last
    assert last["agent/num_turns/mean"] == 4.0  # prompt + call + observation + answer
    # even samples copy the tool result (reward 1), odd ones are the random model (reward 0)
    assert last["critic/score/mean"] == pytest.approx(0.5)
    assert last["reward/scored"] == 4
    assert any(not torch.equal(before[k], after[k]) for k in before), (
        "the update changed no parameter"
    )

    assert len(mode.trained) == 2
    for batch in mode.trained:
        width = batch.batch["responses"].shape[1]
        valid = batch.batch["attention_mask"][:, -width:].bool()
        for i in range(len(batch)):
            ids = batch.batch["responses"][i][valid[i]]
            mask = batch.batch["response_mask"][i][valid[i]]
            runs = _runs(mask)
            # policy call, observation, policy answer: exactly one masked span, in the middle
            assert [v for v, _ in runs] == [1, 0, 1], runs
            call_len, obs_len = runs[0][1], runs[1][1]
            obs = tok.decode(ids[call_len : call_len + obs_len].tolist(), skip_special_tokens=False)
            assert obs.startswith(OBS_HEAD) and obs.endswith(OBS_TAIL), obs
            policy = tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            assert "<tool_call>" in policy and "<tool_response>" not in policy
            # the scripted call is trained exactly as generated, the observation follows it
            rid = next(
                r
                for r, s in mode.script.scripted.items()
                if r.endswith("-t0") and s == ids[:call_len].tolist()
            )
            k = int(_K.search(rid).group(1))
            inner = obs[len(OBS_HEAD) : -len(OBS_TAIL)]
            if k % 4 == 3:
                assert inner.startswith("Error:"), inner
            else:
                expr = _QUESTION.findall(tok.decode(batch.batch["prompts"][i].tolist()))[-1]
                assert inner == str(eval(expr)), (expr, inner)  # noqa: S307 - our own expression


def test_example_config_fits_the_bound_style_conversation(tiny_model_dir):
    """The shipped recipe's sizes hold its own conversations: prompt, call turn, observation."""
    from transformers import AutoTokenizer

    from postrl.data.tool_arith import ProblemCalculatorTool
    from postrl.tools.config import load_tool_config

    cfg = load_config(EXAMPLE, [])
    a = cfg.rollout.agent
    tools = load_tool_config(ROOT / a.tool_config_path)
    assert isinstance(tools["calculator"], ProblemCalculatorTool)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    kw = dict(min_digits=2, max_digits=2, kinds=["mul"], prompt_style="bound")
    (demo,) = tool_arith_demonstrations(1, tool_fraction=1.0, **kw)
    user, call, obs, answer = demo["messages"]
    text = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    assert 20 < len(prompt) <= cfg.data.max_prompt_length
    # the call turn must end by end-of-turn, not by length: > its tokens
    assert cfg.rollout.response_length > len(tok.encode(call["content"], add_special_tokens=False))
    assert len(obs["content"]) <= a.max_tool_response_length
    assert a.max_assistant_turns == 2 and a.max_user_turns == 1 and a.check_token_faithfulness


@pytest.mark.slow
def test_sft_on_demonstrations_teaches_tool_calls(tiny_model_dir, tmp_path):
    """200 demonstrations, a short SFT, then a real rollout: parseable calls at a non-zero rate.

    The ``short`` prompt style (no system message: the call format is in the demonstrations
    only) makes a row ~110 tokens instead of ~490 for this byte-level model, so the SFT costs a
    quarter of the ``full`` style's (which took ~2 minutes of the suite's time). Measured at
    this size (3 epochs of 512-token steps, 201 steps), demonstration seeds 1, 2, 3: 16, 15, 16
    of the 16 rollouts call the tool (1 epoch: 1, 2, 14 — too few steps to rely on)."""
    from postrl.supervised.sft import run_sft

    short = {"min_digits": 2, "max_digits": 3, "prompt_style": "short"}
    demos = write_parquet(
        tool_arith_demonstrations(200, seed=1, **short), tmp_path / "demos.parquet"
    )
    train = write_parquet(generate_tool_arith(4, seed=3, **short), tmp_path / "train.parquet")
    m = run_sft(
        str(tiny_model_dir),
        str(demos),
        str(tmp_path / "sft"),
        epochs=3,
        lr=3e-3,
        log_every=10,
        batch_tokens=512,
        warmup_steps=2,
    )  # small steps learn the format faster
    assert m["sft/final_loss"] < m["sft/first_loss"]
    ov = [
        f"model.path={tmp_path / 'sft'}",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        "data.max_prompt_length=512",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        "rollout.response_length=96",
        "rollout.temperature=0.7",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.loggers=[jsonl]",
    ]
    trainer = RLTrainer(load_config(EXAMPLE, [*ov, TOOLS]))
    try:
        trainer.sync_weights()
        ctx = trainer.ctx
        batch = ctx.generate(trainer.loader.next_batch(), ctx.sampling_params(), 4, 1)
    finally:
        trainer.close()
    metrics = list(batch.non_tensor_batch["agent_metrics"])
    calls = sum(d["agent/num_tool_calls"] for d in metrics)
    assert calls > 0, [e["messages"][-1] for e in batch.non_tensor_batch["agent_extra"]]
    assert all(d.get("agent/token_drift_ratio", 0.0) == 0.0 for d in metrics)


def test_code_reward_through_the_reward_loop():
    """Correct programs score 1, wrong ones < 1, and a sandbox that refuses is a failure, not 0."""
    rows = generate_code_tasks(3, seed=0)
    good = [f"Here you go:\n```python\n{r['extra_info']['reference_solution']}```" for r in rows]
    wrong = [
        "```python\ndef f(*args):\n    return None\n```",
        "no code at all",
        "```python\ndef f(x:\n```",
    ]

    def requests(texts: list[str]) -> list[RewardRequest]:
        return [
            RewardRequest("code", t, r["reward_model"]["ground_truth"], r["extra_info"], uid=i)
            for i, (t, r) in enumerate(zip(texts, rows))
        ]

    with RewardLoop(timeout_s=30, num_workers=1) as loop:
        res = loop.score(requests(good) + requests(wrong))
    assert res.valid.all(), res.failure_detail
    assert res.scores[:3].tolist() == [1.0, 1.0, 1.0]
    assert all(s < 1.0 for s in res.scores[3:].tolist())
    assert res.extra["passed"][:3] == [5.0, 5.0, 5.0] and res.extra["total"][3:] == [5.0] * 3

    # required isolation layer disabled -> the sandbox refuses; the sample is failed, never scored
    refuse = {"sandbox_config": {"disabled_layers": ["net_namespace"]}}
    with RewardLoop(timeout_s=30, num_workers=1, fn_kwargs=refuse) as loop:
        res = loop.score(requests(good[:2]))
    assert not res.valid.any()
    assert res.metrics["reward/failed/exception"] == 2 and res.metrics["reward/scored"] == 0
    assert all("SandboxUnavailableError" in d and "refused" in d for d in res.failure_detail)
