"""The tool loop end to end on the real native rollout backend with a random tiny model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agent_helpers import make_row

from postrl.agent import AgentLoopManager
from postrl.agent.tool_loop import ToolAgentLoop
from postrl.protocol import DataProto
from postrl.rollout import SamplingParams, TokenOutput, create_rollout_backend

MAX_MODEL_LEN = 512


class BackendClient:
    """The minimal rollout client: forwards to one backend."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: list[tuple[list[int], TokenOutput]] = []

    async def generate(self, prompt_ids, sampling, request_id, trajectory_id=None):
        out = await self.backend.generate(prompt_ids, sampling, request_id)
        self.calls.append((list(prompt_ids), out))
        return out


class ForcedFirstTurnClient(BackendClient):
    """Turn 1 is a scripted tool call (log-prob 0); later turns come from the real backend."""

    def __init__(self, backend: Any, tokenizer: Any, first_turn: str) -> None:
        super().__init__(backend)
        self.first = tokenizer.encode(first_turn, add_special_tokens=False)

    async def generate(self, prompt_ids, sampling, request_id, trajectory_id=None):
        if request_id.endswith("-t0"):
            out = TokenOutput(list(self.first), [0.0] * len(self.first), "stop")
            self.calls.append((list(prompt_ids), out))
            return out
        return await super().generate(prompt_ids, sampling, request_id, trajectory_id)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    be = create_rollout_backend(
        "native", tiny_model_dir, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, device="cpu"
    )
    yield be
    be.close()


def _check(out, client):
    n = len(out.response_ids)
    assert n > 0 and len(out.response_mask) == n and len(out.response_logprobs) == n
    assert len(out.prompt_ids) + n < MAX_MODEL_LEN
    # every generation's prompt is prompt + the response so far; its ids are the mask-1 span
    mine = [(p, o) for p, o in client.calls if p[: len(out.prompt_ids)] == out.prompt_ids]
    mask = [0] * n
    for p, o in mine:
        start = len(p) - len(out.prompt_ids)
        assert out.response_ids[:start] == p[len(out.prompt_ids) :]
        assert out.response_ids[start : start + len(o.token_ids)] == o.token_ids
        assert out.response_logprobs[start : start + len(o.token_ids)] == pytest.approx(o.log_probs)
        mask[start : start + len(o.token_ids)] = [1] * len(o.token_ids)
    assert out.response_mask == mask


def test_manager_with_native_backend(backend, tokenizer, agent_config):
    """Random model via the manager: well-formed trajectories and an assembled batch."""
    from postrl.tools import create_tools

    client = BackendClient(backend)
    mgr = AgentLoopManager(
        client,
        tokenizer,
        agent_config,
        tools=create_tools(["calculator"]),
        max_model_len=MAX_MODEL_LEN,
    )
    rows = [make_row(tokenizer, q) for q in ("What is 2+2?", "Compute 17*3.")]
    prompts = DataProto.from_dict(
        non_tensors={
            k: [r[k] for r in rows]
            for k in ("raw_prompt_ids", "messages", "data_source", "ground_truth", "extra_info")
        }
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=24)
    batch = asyncio.run(
        asyncio.wait_for(mgr.generate(prompts, sp, n=2, seed=0, step=0), timeout=120)
    )
    assert len(batch) == 4
    for i in range(4):
        mask = batch.batch["response_mask"][i]
        am = batch.batch["attention_mask"][i, batch.batch["prompts"].shape[1] :]
        assert bool((mask <= am).all())
        metrics = batch.non_tensor_batch["agent_metrics"][i]
        # the loop's construction is exact; re-tokenising random (often invalid UTF-8) bytes is not
        assert metrics["agent/token_drift_ratio"] == 0.0
        assert 0.0 <= metrics["agent/retokenize_drift_ratio"] <= 1.0
    assert int(batch.batch["response_mask"].sum()) == sum(len(o.token_ids) for _, o in client.calls)


def test_real_backend_continues_after_observation(backend, tokenizer, agent_config):
    """A forced tool call, a real calculator observation, then real generations on the spliced
    ids."""
    from postrl.tools import create_tools

    turn = (
        "<tool_call>"
        + json.dumps({"name": "calculator", "arguments": {"expression": "123*456"}})
        + "</tool_call><|im_end|>"
    )
    client = ForcedFirstTurnClient(backend, tokenizer, turn)
    loop = ToolAgentLoop(
        client,
        tokenizer,
        agent_config,
        tools=create_tools(["calculator"]),
        max_model_len=MAX_MODEL_LEN,
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11)
    out = asyncio.run(asyncio.wait_for(loop.run(sp, **make_row(tokenizer)), timeout=120))
    assert (
        out.metrics["agent/num_tool_calls"] == 1 and out.metrics["agent/num_assistant_turns"] >= 2
    )
    assert "56088" in tokenizer.decode(out.response_ids)
    _check(out, client)
    assert out.metrics["agent/token_drift_ratio"] == 0.0
