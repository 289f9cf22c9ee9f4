"""Every token carries the policy version that produced it: loops -> AgentLoopOutput -> batch."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from agent_helpers import ScriptedClient, make_row

from postrl.agent import AgentLoopManager, AgentLoopOutput
from postrl.agent.base import token_versions
from postrl.agent.tool_loop import ToolAgentLoop
from postrl.protocol import DataProto
from postrl.rollout import (
    RolloutClient,
    RolloutReplica,
    SamplingParams,
    create_rollout_backend,
)
from postrl.rollout.types import TokenOutput

IM_END = "<|im_end|>"


def _expand(segs):
    return [v for n, v in segs for _ in range(n)]


def _out(n_resp, segs, mask=None):
    return AgentLoopOutput(
        prompt_ids=[7, 8],
        response_ids=list(range(1, n_resp + 1)),
        response_mask=mask or [1] * n_resp,
        response_logprobs=[0.0] * n_resp,
        response_versions=segs,
    )


def test_assemble_writes_versions_per_token_and_row_tags(tokenizer, agent_config):
    mgr = AgentLoopManager(None, tokenizer, agent_config)
    outs = [
        _out(5, [(2, 3), (3, 4)]),  # resumed once: versions 3 then 4
        _out(3, [(1, 4), (1, -1), (1, 5)], mask=[1, 0, 1]),  # policy, observation, policy
        _out(2, None),  # a loop that reports no versions
        _out(0, []),  # empty response
    ]
    rows = [{"request_id": f"r{i}"} for i in range(4)]
    b = mgr.assemble(outs, rows)
    v = b.batch["rollout_policy_version"]
    assert v.dtype == torch.int64 and v.shape == (4, 5)
    assert v.tolist() == [
        [3, 3, 4, 4, 4],
        [4, -1, 5, -1, -1],  # -1 on the observation token and on padding
        [-1, -1, -1, -1, -1],
        [-1, -1, -1, -1, -1],
    ]
    nt = b.non_tensor_batch
    assert nt["min_version"].tolist() == [3, 4, -1, -1]  # over known (>= 0) tokens only
    assert nt["max_version"].tolist() == [4, 5, -1, -1]
    assert nt["min_version"].dtype == np.int64
    # survives the trainer's concat of rollouts (padding stays -1) and reorder
    from postrl.trainer.stages import concat_rollouts

    both = concat_rollouts([b, mgr.assemble([_out(7, [(7, 9)])], [{"request_id": "x"}])])
    assert both.batch["rollout_policy_version"][0].tolist() == [3, 3, 4, 4, 4, -1, -1]
    assert both.reorder([4, 0, 1, 2, 3]).non_tensor_batch["max_version"].tolist()[0] == 9


def test_assemble_rejects_versions_that_do_not_cover_the_response(tokenizer, agent_config):
    mgr = AgentLoopManager(None, tokenizer, agent_config)
    with pytest.raises(ValueError, match="trajectory bad: response_versions cover 4 tokens"):
        mgr.assemble([_out(5, [(4, 0)])], [{"request_id": "bad"}])


def test_token_versions_reads_client_segments():
    out = TokenOutput([1, 2, 3], [0.0] * 3, "stop", versions=[(2, 0), (0, 1), (1, 2)])
    assert token_versions(out, 3) == [(2, 0), (1, 2)]  # empty segment dropped
    assert token_versions(TokenOutput([1, 2], [0.0] * 2, "stop"), 2) == [(2, -1)]
    assert token_versions(TokenOutput([], [], "stop"), 0) == []
    with pytest.raises(ValueError, match="policy versions for 2 tokens but returned 3"):
        token_versions(TokenOutput([1, 2, 3], [0.0] * 3, "stop", versions=[(2, 0)]), 3)


@dataclass
class VersionedClient(ScriptedClient):
    """ScriptedClient whose k-th turn reports ``turn_versions[k]`` as ``(fraction, version)``
    splits: the first ``ceil(len * fraction)`` tokens get the first version."""

    turn_versions: tuple = ()

    async def generate(self, prompt_ids, sampling, request_id, trajectory_id=None):
        out = await super().generate(prompt_ids, sampling, request_id, trajectory_id)
        v = self.turn_versions[len(self.prompts) - 1]
        n = len(out.token_ids)
        if len(v) == 1:
            out.versions = [(n, v[0])]
        else:
            out.versions = [(3, v[0]), (n - 3, v[1])]
        return out


def test_tool_loop_versions_policy_turns_and_observations(tokenizer, agent_config):
    """Turn 1 was interrupted by a weight update (3 tokens on v0, the rest on v1); turn 2 ran on
    v1; the observation between them carries -1."""
    from postrl.tools import create_tools

    script = [
        'Compute <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}'
        "</tool_call>" + IM_END,
        "It is 6." + IM_END,
    ]
    client = VersionedClient(tokenizer, script, turn_versions=((0, 1), (1,)))
    loop = ToolAgentLoop(client, tokenizer, agent_config, tools=create_tools(["calculator"]))
    row = make_row(tokenizer)
    sp = SamplingParams(temperature=1.0, max_new_tokens=256, seed=3)
    out = asyncio.run(asyncio.wait_for(loop.run(sp, **row), timeout=60))
    gen1, gen2 = client.generated
    n_obs = len(out.response_ids) - len(gen1) - len(gen2)
    assert n_obs > 0 and out.response_mask == [1] * len(gen1) + [0] * n_obs + [1] * len(gen2)
    want = [0] * 3 + [1] * (len(gen1) - 3) + [-1] * n_obs + [1] * len(gen2)
    assert _expand(out.response_versions) == want
    mgr = AgentLoopManager(client, tokenizer, agent_config)
    b = mgr.assemble([out], [row])
    assert b.batch["rollout_policy_version"][0].tolist() == want
    assert (b.non_tensor_batch["min_version"][0], b.non_tensor_batch["max_version"][0]) == (0, 1)


def test_weight_update_mid_trajectory_shows_both_versions(tiny_model_factory, tokenizer):
    """One real replica (native engine), the resuming client and the manager: a pause + weight
    update + resume in the middle of generation -> each row's tokens are version 0 up to the
    interruption and version 1 after it, exactly where the client's segments say."""
    from safetensors.torch import load_file

    from postrl.config.schema import AgentConfig

    d = tiny_model_factory("qwen2")
    be = create_rollout_backend("native", d, max_num_seqs=4, max_model_len=512)
    replica = RolloutReplica(be)
    client = RolloutClient(replica)
    mgr = AgentLoopManager(client, tokenizer, AgentConfig(default_agent_loop="single_turn"))
    prompts = DataProto.from_dict(
        {"dummy": torch.zeros(2, 1)},
        {
            "raw_prompt_ids": np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8]], dtype=object),
            "index": np.array([0, 1]),
        },
    )
    sp = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    weights = load_file(str(d / "model.safetensors"))
    finished: dict[int, AgentLoopOutput] = {}

    async def run():
        task = asyncio.create_task(
            mgr.generate(
                prompts,
                sp,
                1,
                seed=0,
                step=0,
                on_sample_end=lambda i, o, r: finished.update({i: o}),
            )
        )
        while be.num_running == 0 or int(be.s_ngen[0]) < 5:
            await asyncio.sleep(0.002)
        replica.pause()  # aborts the in-flight requests; the client re-sends after resume
        deadline = asyncio.get_running_loop().time() + 60
        while replica.load:  # the aborted segments are labelled (version 0) when they return
            assert asyncio.get_running_loop().time() < deadline, "aborted requests never returned"
            await asyncio.sleep(0.002)
        replica.update_weights(weights.items())  # version 0 -> 1
        replica.resume()
        return await asyncio.wait_for(task, 300)

    batch = asyncio.run(run())
    v = batch.batch["rollout_policy_version"]
    assert v.shape == (2, 60) and (batch.batch["response_mask"].sum(-1) == 60).all()
    interrupted = 0
    for i in range(2):
        row = v[i].tolist()
        assert row == _expand(finished[i].response_versions)  # the tensor is the segments
        assert set(row) <= {0, 1} and row == sorted(row)  # v0 prefix, then v1
        interrupted += 0 in row and 1 in row
        assert batch.non_tensor_batch["min_version"][i] == min(row)
        assert batch.non_tensor_batch["max_version"][i] == max(row)
    assert interrupted >= 1  # at least the row that had produced >= 5 tokens was cut
    assert int(v[0].tolist().count(0)) >= 5 or int(v[1].tolist().count(0)) >= 5
