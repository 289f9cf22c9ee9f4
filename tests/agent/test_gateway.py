"""The ``gateway`` agent loop with real agents on the official ``openai`` client.

The rollout side is the scripted client of ``agent_helpers`` (exact, known ids); the agents are
real programs (``gw_agents.py``: subprocesses or in-process async functions) talking HTTP to
the gateway on 127.0.0.1. End-to-end training with the tiny model: ``test_gateway_train.py``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import gw_agents
import numpy as np
import pytest
from agent_helpers import ScriptedClient, make_row

from postrl.agent import AgentLoopManager
from postrl.agent.gateway import GatewayAgentLoop
from postrl.config.schema import AgentConfig, GatewayConfig
from postrl.rollout.types import SamplingParams

HERE = Path(__file__).resolve().parent
SP = SamplingParams(temperature=1.0, max_new_tokens=256, seed=3)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'


def _loop(tokenizer, script, max_model_len=None, **gw):
    client = ScriptedClient(tokenizer, script)
    cfg = AgentConfig(default_agent_loop="gateway", gateway=GatewayConfig(**gw))
    return client, GatewayAgentLoop(client, tokenizer, cfg, max_model_len=max_model_len)


def _run(loop, rows):
    async def go():
        try:
            return await asyncio.gather(*(loop.run(SP, **r) for r in rows))
        finally:
            await loop.aclose()

    return asyncio.run(go())


def _command(mode: str) -> str:
    return f"{sys.executable} {HERE / 'gw_agents.py'} {mode}"


def test_tool_calls_are_token_faithful_across_turns(tokenizer):
    """The agent calls the calculator through OpenAI tool calls, executes it and sends the
    result back: the second request's prompt is the first prompt + the sampled ids exactly,
    and only the tool message is tokenised (mask 0)."""
    client, loop = _loop(
        tokenizer,
        [CALL + "<|im_end|>", "The answer is 56088.<|im_end|>"],
        entrypoint="gw_agents:tool_agent",
    )
    row = make_row(tokenizer)
    (out,) = _run(loop, [row])
    assert out.metrics["agent/gateway_failures"] == 0.0
    assert out.metrics["agent/gateway_segments"] == 1.0
    assert out.metrics["agent/gateway_retokenized"] == 0.0
    assert out.segments == []
    p0, p1 = client.prompts
    g0, g1 = client.generated
    assert (
        out.prompt_ids
        == p0
        == tokenizer.encode(
            tokenizer.apply_chat_template(
                row["messages"], tools=[gw_agents.CALC], tokenize=False, add_generation_prompt=True
            )
        )
    )
    assert p1[: len(p0) + len(g0)] == p0 + g0  # reused as sampled, never re-tokenised
    obs = p1[len(p0) + len(g0) :]
    assert tokenizer.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out.response_ids == g0 + obs + g1
    assert out.response_mask == [1] * len(g0) + [0] * len(obs) + [1] * len(g1)
    lp = [-0.01 * (i + 1) for i in range(len(g0))]
    assert out.response_logprobs[: len(g0)] == pytest.approx(lp)
    assert out.response_logprobs[len(g0) : len(g0) + len(obs)] == [0.0] * len(obs)
    assert sum(n for n, _ in out.response_versions) == len(out.response_ids)
    assert out.extra["solution_str"] == "The answer is 56088."
    assert "reward" not in out.extra  # the dataset's function scores the final message


def test_rewritten_history_starts_a_segment_that_trains_as_its_own_row(tokenizer):
    """A rewritten history is a new segment; the run yields two rows sharing reward, uid and
    the sequence advantage, and the group baseline counts the run once."""
    from postrl.algos import bind_adv_estimator
    from postrl.reward import RewardLoop, RewardStage
    from postrl.trainer.stages import compute_advantage_stage

    client, loop = _loop(
        tokenizer,
        ["I think 7.<|im_end|>", "Yes, 7.<|im_end|>", "No idea.<|im_end|>"],
        entrypoint="gw_agents:rewrite_agent",
    )
    row = make_row(tokenizer)
    (out,) = _run(loop, [row])
    assert out.metrics["agent/gateway_segments"] == 2.0
    assert out.metrics["agent/gateway_retokenized"] == 1.0
    (seg,) = out.segments
    assert seg.prompt_ids == client.prompts[0] and seg.response_ids == client.generated[0]
    assert out.prompt_ids == client.prompts[1] and out.response_ids == client.generated[1]
    assert tokenizer.decode(out.prompt_ids).startswith(
        "<|im_start|>user\nEarlier you said: I think"
    )
    assert out.extra["reward"] == seg.extra["reward"] == 0.5

    other = dict(row, sample_index=1, request_id="r1")
    from postrl.agent.base import AgentLoopOutput

    single = AgentLoopOutput(list(row["raw_prompt_ids"]), [5, 6], [1, 1], [-0.1, -0.1])
    single.extra = {"reward": 1.0}
    mgr = AgentLoopManager(client, tokenizer, AgentConfig())
    batch = mgr.assemble([out, single], [row, other])
    assert len(batch) == 3
    assert batch.non_tensor_batch["segment"].tolist() == [0, 0, 1]
    assert batch.batch["response_mask"][2].sum() == len(seg.response_ids)
    with RewardLoop(num_workers=1) as rl:
        scored, _ = RewardStage(rl, tokenizer).finish(batch)
    scores = scored.batch["token_level_scores"].sum(-1).tolist()
    assert scores == pytest.approx([0.5, 1.0, 0.5])

    class Algo:
        adv_estimator, adv_estimator_kwargs = "grpo", {}
        gamma, lam, norm_adv_by_std_in_grpo = 1.0, 1.0, True

    adv = compute_advantage_stage(scored, Algo).batch["advantages"]
    # the group is two runs (0.5, 1.0), not three rows: (x - mean) / (std + eps), std unbiased
    fn = bind_adv_estimator("grpo", {})
    own, _ = fn(
        token_level_rewards=scored.batch["token_level_scores"][:2],
        response_mask=scored.batch["response_mask"][:2],
        index=np.array(["g", "g"], dtype=object),
        norm_adv_by_std_in_grpo=True,
    )
    assert adv[:2].tolist() == own.tolist()
    m = scored.batch["response_mask"][2].bool()
    assert adv[2][m].tolist() == pytest.approx([float(own[0][0])] * int(m.sum()))
    assert float(own[0][0]) < 0 < float(own[1][0])


@pytest.mark.parametrize(
    "mode,check",
    [
        ("reward_url", lambda o: o.extra["reward"] == 0.25),
        ("reward_stdout", lambda o: o.extra["reward"] == 0.75),
        ("stream", lambda o: "reward" not in o.extra),
    ],
)
def test_command_agents_and_rewards(tokenizer, mode, check):
    """A subprocess agent on the sync ``openai`` client: reward by URL, by the last stdout
    line, or none (the dataset's function); streaming gives the same text."""
    client, loop = _loop(tokenizer, ["Hello there.<|im_end|>"], command=_command(mode))
    (out,) = _run(loop, [make_row(tokenizer)])
    assert out.metrics["agent/gateway_failures"] == 0.0, out.extra
    assert check(out)
    assert out.response_ids == client.generated[0]
    assert out.response_mask == [1] * len(out.response_ids)
    assert out.extra["solution_str"] == "Hello there."


@pytest.mark.parametrize(
    "mode,reason",
    [("crash", "exit 1"), ("hang", "timeout"), ("exit3", "exit 3"), ("garbage", "garbage")],
)
def test_faulty_agents_give_a_masked_counted_trajectory(tokenizer, mode, reason, caplog):
    """Crash, hang (the deadline kills it), non-zero exit, garbage request: the prompt still
    yields a row, every token masked, the reward 0, the failure counted and logged."""
    timeout = 2 if mode == "hang" else 60
    client, loop = _loop(tokenizer, ["Hi.<|im_end|>"], command=_command(mode), timeout_s=timeout)
    row = make_row(tokenizer)
    with caplog.at_level("WARNING"):
        (out,) = _run(loop, [row])
    assert out.metrics["agent/gateway_failures"] == 1.0
    assert reason in out.extra["gateway_failure"]
    assert out.extra["reward"] == 0.0
    assert sum(out.response_mask) == 0 and len(out.response_ids) >= 1
    assert out.prompt_ids == (client.prompts[0] if client.prompts else list(row["raw_prompt_ids"]))
    assert any(reason in r.getMessage() for r in caplog.records)


def test_context_overflow_fails_the_trajectory(tokenizer):
    """A prompt that does not fit the rollout's context is refused (400,
    context_length_exceeded); the agent's run is masked with reason context_overflow."""
    row = make_row(tokenizer)
    client, loop = _loop(
        tokenizer,
        ["Hi.<|im_end|>"],
        max_model_len=len(row["raw_prompt_ids"]),
        command=_command("echo"),
    )
    (out,) = _run(loop, [row])
    assert out.extra["gateway_failure"] == "context_overflow"
    assert client.prompts == [] and sum(out.response_mask) == 0


def test_refusals_and_keys(tokenizer):
    """Unknown request keys and n=2 get a 400 naming them; a wrong or missing key a 401; a
    bad reward a 400; the key alone routes to its trajectory."""
    gw_agents.PROBES.clear()
    client, loop = _loop(tokenizer, ["Hi.<|im_end|>"], entrypoint="gw_agents:probe_agent")
    (out,) = _run(loop, [make_row(tokenizer)])
    p = gw_agents.PROBES
    assert p["unknown_key"] == 400 and "frobnicate" in p["unknown_key_msg"]
    assert p["n2"] == 400 and "n=1" in p["n2_msg"]
    assert p["wrong_key"] == 401 and p["no_key_root"] == 401
    assert p["bad_reward"] == 400 and p["by_key"] == 200
    # requests that reached the trajectory: n=2 (refused by its sampling) and the good one
    assert out.metrics["agent/gateway_requests"] == 2.0


def test_config_errors_name_the_fields(tokenizer):
    with pytest.raises(ValueError, match="exactly one of command"):
        _loop(tokenizer, ["x"])
    with pytest.raises(ValueError, match="not an async function"):
        _loop(tokenizer, ["x"], entrypoint="json:dumps")
    with pytest.raises(ValueError, match="max_concurrency"):
        _loop(tokenizer, ["x"], command="true", max_concurrency=0)
    # the same checks at startup, from the loop's registry entry, all at once
    from postrl.config import ConfigError, load_config, validate_config

    cfg = load_config(
        None,
        [
            "rollout.agent.default_agent_loop=gateway",
            "trainer.mode=fully_async",
            "trainer.backend=ray",
            "trainer.async.data_plane=object_store",
        ],
    )
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_files=False)
    assert "exactly one of command" in str(e.value)
    assert "data_plane=driver" in str(e.value)


def test_task_file_holds_the_row(tokenizer, tmp_path):
    """POSTRL_TASK is a JSON file with the row's messages, ground truth, source, extra, index."""
    out_file = tmp_path / "task.json"
    client, loop = _loop(tokenizer, ["Hi.<|im_end|>"], command=f'cp "$POSTRL_TASK" {out_file}')
    row = dict(make_row(tokenizer), index=np.int64(4), extra_info={"a": np.array([1, 2])})
    (out,) = _run(loop, [row])
    task = json.loads(out_file.read_text())
    assert task == {
        "messages": row["messages"],
        "ground_truth": "56088",
        "data_source": "tool_arith",
        "extra_info": {"a": [1, 2]},
        "index": 4,
    }
    assert out.extra["gateway_failure"] == "no_requests"  # it never asked the model


def test_max_concurrency_caps_running_agents(tokenizer):
    gw_agents.RUNNING.update(now=0, max=0)
    client, loop = _loop(tokenizer, ["x"], entrypoint="gw_agents:busy_agent", max_concurrency=2)
    rows = [make_row(tokenizer, request_id=f"r{i}") for i in range(6)]
    outs = _run(loop, rows)
    assert gw_agents.RUNNING["max"] == 2
    assert [o.extra["gateway_failure"] for o in outs] == ["no_requests"] * 6


def test_example_calculator_agent(tokenizer, monkeypatch):
    """examples/agents/calculator_agent.py (in-process form) on a tool-arith row of the
    `bound` style: a call without arguments evaluates the task's problem; the tool message is
    the observation; the final answer is the trajectory's solution."""
    monkeypatch.syspath_prepend(str(HERE.parents[1] / "examples" / "agents"))
    call = '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call><|im_end|>'
    client, loop = _loop(tokenizer, [call, "767<|im_end|>"], entrypoint="calculator_agent:run")
    row = dict(
        make_row(tokenizer, question="What is 13 * 59?"),
        extra_info={"tools_kwargs": {"calculator": {"create_kwargs": {"expression": "13 * 59"}}}},
    )
    (out,) = _run(loop, [row])
    assert out.metrics["agent/gateway_failures"] == 0.0
    g0, g1 = client.generated
    obs = client.prompts[1][len(client.prompts[0]) + len(g0) :]
    assert "<tool_response>\n767\n</tool_response>" in tokenizer.decode(obs)
    assert out.response_ids == g0 + obs + g1
    assert out.extra["solution_str"] == "767"


def test_token_route_serves_a_trajectory_and_checks_what_it_is_told(tokenizer):
    """``POST /t/inference/v1/generate`` (the ``verifiers`` loop's route): vLLM's response
    shape from the trajectory's sampling (``max_tokens`` may only lower it, seeds derived per
    call), the key and the routing id checked; ``match`` accepts a sequence built from the
    recorded calls and counts sampled positions no call produced."""
    import httpx

    from postrl.agent.gateway import GatewayServer
    from postrl.agent.gateway.token_session import TokenSession

    client = ScriptedClient(tokenizer, ["Hi!<|im_end|>", "Yes.<|im_end|>"])
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, seed=3, stop_token_ids=(258,))
    s = TokenSession("sid1", "sk-1", client, sp, "r0", max_requests=3, max_model_len=256)
    server = GatewayServer(max_model_len=256)

    async def go():
        await server.ensure_started()
        server.add_token_session(s)
        url = f"http://127.0.0.1:{server.port}/t"
        auth = {"Authorization": "Bearer sk-1"}

        def body(ids, **sp):
            return {
                "model": "m",
                "token_ids": ids,
                "sampling_params": {"extra_args": {"postrl_trajectory": "sid1"}, **sp},
            }

        try:
            async with httpx.AsyncClient(timeout=30) as h:
                card = (await h.get(url + "/v1/models")).json()["data"][0]
                r0 = await h.post(url + "/inference/v1/generate", json=body([5, 6]), headers=auth)
                bad_key = await h.post(
                    url + "/inference/v1/generate", json=body([5]), headers={"Authorization": "x"}
                )
                other = body([5])
                other["sampling_params"]["extra_args"]["postrl_trajectory"] = "nope"
                unknown = await h.post(url + "/inference/v1/generate", json=other, headers=auth)
                gen = url + "/inference/v1/generate"
                two = await h.post(gen, json=body([5], n=2), headers=auth)
                g0 = r0.json()["choices"][0]["token_ids"]
                p1 = [5, 6, *g0, 7, 8]
                r1 = await h.post(
                    url + "/inference/v1/generate",
                    json=body(p1, max_tokens=4, stop_token_ids=[9], logprobs=1),
                    headers=auth,
                )
                return card, r0, bad_key, unknown, two, r1
        finally:
            server.remove_token_session(s)
            await server.close()

    card, r0, bad_key, unknown, two, r1 = asyncio.run(go())
    assert card["max_model_len"] == 256
    assert r0.status_code == 200 and bad_key.status_code == 401 and unknown.status_code == 404
    assert two.status_code == 400 and "n=1" in two.json()["error"]["message"]
    ch = r0.json()["choices"][0]
    g0 = ch["token_ids"]
    assert g0 == tokenizer.encode("Hi!<|im_end|>", add_special_tokens=False)
    assert [e["token"] for e in ch["logprobs"]["content"]] == [f"token_id:{t}" for t in g0]
    assert ch["logprobs"]["content"][0]["logprob"] == pytest.approx(-0.01)
    s0, s1 = client.samplings[0], client.samplings[-1]
    assert (s0.max_new_tokens, s0.seed) == (32, 3)
    assert s1.max_new_tokens == 4 and s1.seed != 3  # lowered; call 2 derives its seed
    assert s1.stop_token_ids == (258, 9)
    g1 = r1.json()["choices"][0]["token_ids"]
    assert r1.json()["choices"][0]["finish_reason"] == "length" and len(g1) == 4

    seq = [5, 6, *g0, 7, 8, *g1]
    mask = [False] * 2 + [True] * len(g0) + [False] * 2 + [True] * len(g1)
    versions, unmatched = s.match(seq, mask)
    assert unmatched == 0
    assert versions == [(len(g0), -1), (2, -1), (len(g1), -1)]
    drifted = [5, 6, *g0, 7, 9, *g1]  # the client re-rendered the tool turn: the prompt differs
    assert s.match(drifted, mask)[1] == len(g1)
