"""ToolAgentLoop with a scripted client, the real tiny tokenizer and the real calculator tool."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from agent_helpers import ScriptedClient, make_row

from postrl.agent import AGENT_LOOPS
from postrl.agent.tool_loop import ToolAgentLoop
from postrl.rollout.types import SamplingParams

IM_END = "<|im_end|>"
SP = SamplingParams(temperature=1.0, max_new_tokens=256, seed=3)


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def calc_tools():
    from postrl.tools import create_tools

    return create_tools(["calculator"])


def run_loop(tokenizer, cfg, script, tools=None, sampling=SP, **kw):
    client = ScriptedClient(tokenizer, list(script))
    loop = ToolAgentLoop(
        client, tokenizer, cfg, tools=calc_tools() if tools is None else tools, **kw
    )
    row = make_row(tokenizer)
    out = asyncio.run(asyncio.wait_for(loop.run(sampling, **row), timeout=60))
    return out, client, row


def assert_well_formed(out):
    n = len(out.response_ids)
    assert len(out.response_mask) == n and len(out.response_logprobs) == n
    assert set(out.response_mask) <= {0, 1}
    assert all(
        lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m == 0
    )


def policy_positions(client, out):
    """Expected mask from the client's record: each generation's ids sit at a known offset."""
    mask = [0] * len(out.response_ids)
    base = len(client.prompts[0])
    for prompt, gen in zip(client.prompts, client.generated, strict=True):
        start = len(prompt) - base
        assert out.response_ids[start : start + len(gen)] == gen
        mask[start : start + len(gen)] = [1] * len(gen)
    return mask


def test_registered_lazily():
    assert AGENT_LOOPS.get("tool_agent") is ToolAgentLoop


def test_calculator_round_trip_is_token_exact(tokenizer, agent_config):
    script = [
        "Let me compute. " + call("calculator", expression="123*456") + IM_END,
        "The answer is 56088." + IM_END,
    ]
    out, client, row = run_loop(tokenizer, agent_config, script)
    assert_well_formed(out)
    gen1, gen2 = client.generated
    obs = client.prompts[1][len(row["raw_prompt_ids"]) + len(gen1) :]
    # token-in/token-out: turn 2's prompt is exactly prompt + turn-1 ids + observation ids
    assert client.prompts[1] == row["raw_prompt_ids"] + gen1 + obs
    # trained ids == generated + observation ids; mask exactly 1 on generated ids
    assert out.prompt_ids == row["raw_prompt_ids"]
    assert out.response_ids == gen1 + obs + gen2
    assert out.response_mask == [1] * len(gen1) + [0] * len(obs) + [1] * len(gen2)
    assert out.response_logprobs[: len(gen1)] == [-0.01 * (i + 1) for i in range(len(gen1))]
    obs_text = tokenizer.decode(obs)
    assert obs_text.startswith("\n<|im_start|>user\n<tool_response>\n") and "56088" in obs_text
    assert obs_text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the full sequence is what the chat template gives for the conversation
    msgs = out.extra["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[-1]["content"] == "The answer is 56088."
    templ = tokenizer.encode(
        tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False
    )
    assert (
        out.prompt_ids + out.response_ids + tokenizer.encode("\n", add_special_tokens=False)
        == templ
    )
    assert out.metrics["agent/token_drift_ratio"] == 0.0
    assert out.metrics["agent/num_tool_calls"] == 1
    assert out.metrics["agent/tool_errors"] == 0
    assert out.metrics["agent/num_assistant_turns"] == 2
    assert out.metrics["agent/tool_time_s"] >= 0
    assert out.num_turns == 4 and out.finish_reason == "stop"
    assert out.extra["termination"] == "no_tool_call"
    # a distinct seed per turn, derived from the row's
    assert client.samplings[0].seed == 3 and client.samplings[1].seed != 3


def test_multiple_calls_in_one_turn(tokenizer, agent_config):
    turn = (
        call("calculator", expression="2+3") + "\n" + call("calculator", expression="7*6") + IM_END
    )
    out, client, _ = run_loop(tokenizer, agent_config, [turn, "5 and 42" + IM_END])
    assert out.metrics["agent/num_tool_calls"] == 2 and out.metrics["agent/tool_errors"] == 0
    tool_msgs = [m for m in out.extra["messages"] if m["role"] == "tool"]
    assert (
        len(tool_msgs) == 2 and "5" in tool_msgs[0]["content"] and "42" in tool_msgs[1]["content"]
    )
    assert out.response_mask == policy_positions(client, out)
    assert out.metrics["agent/token_drift_ratio"] == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "calculator", "arguments": {</tool_call>',  # broken JSON
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {"expression": "1+1"}}</tool_call>',  # no name
    ],
)
def test_malformed_call_becomes_error_observation(tokenizer, agent_config, bad):
    out, client, _ = run_loop(tokenizer, agent_config, [bad + IM_END, "sorry" + IM_END])
    assert_well_formed(out)
    assert out.metrics["agent/tool_errors"] >= 1
    assert len(client.generated) == 2  # the loop went on after the error observation
    tool_msgs = [m for m in out.extra["messages"] if m["role"] == "tool"]
    assert tool_msgs and "error" in tool_msgs[0]["content"].lower()
    assert out.response_mask == policy_positions(client, out)
    assert out.metrics["agent/token_drift_ratio"] == 0.0


def test_unknown_tool(tokenizer, agent_config):
    out, _, _ = run_loop(
        tokenizer, agent_config, [call("weather", city="Paris") + IM_END, "ok" + IM_END]
    )
    assert out.metrics["agent/tool_errors"] == 1
    content = [m for m in out.extra["messages"] if m["role"] == "tool"][0]["content"]
    assert "weather" in content and "calculator" in content  # names the bad tool and the choices


def test_bad_arguments_counted(tokenizer, agent_config):
    out, _, _ = run_loop(
        tokenizer,
        agent_config,
        [call("calculator", expression="__import__('os')") + IM_END, "x" + IM_END],
    )
    assert out.metrics["agent/tool_errors"] == 1 and out.metrics["agent/token_drift_ratio"] == 0.0


def test_max_assistant_turns(tokenizer, agent_config):
    cfg = replace(agent_config, max_assistant_turns=2, max_user_turns=10)
    out, client, _ = run_loop(tokenizer, cfg, [call("calculator", expression="1+1") + IM_END])
    assert len(client.generated) == 2
    assert (
        out.metrics["agent/num_assistant_turns"] == 2 and out.metrics["agent/num_tool_calls"] == 1
    )
    assert out.extra["termination"] == "max_assistant_turns"
    assert out.num_turns == 1 + 2 + 1
    assert out.response_mask == policy_positions(client, out)
    assert out.metrics["agent/token_drift_ratio"] == 0.0


def test_max_user_turns(tokenizer, agent_config):
    cfg = replace(agent_config, max_assistant_turns=10, max_user_turns=1)
    out, client, _ = run_loop(tokenizer, cfg, [call("calculator", expression="1+1") + IM_END])
    assert len(client.generated) == 2 and out.metrics["agent/num_tool_calls"] == 1
    assert out.extra["termination"] == "max_user_turns"


def test_generation_cut_by_length_ends_trajectory(tokenizer, agent_config):
    sp = replace(SP, max_new_tokens=10)
    out, client, _ = run_loop(
        tokenizer, agent_config, [call("calculator", expression="1+1") + IM_END], sampling=sp
    )
    assert len(client.generated) == 1 and len(out.response_ids) == 10
    assert out.finish_reason == "length" and out.response_mask == [1] * 10
    assert out.metrics["agent/token_drift_ratio"] == 0.0


@pytest.mark.parametrize("budget", [40, 90, 130, 200])
def test_response_budget(tokenizer, agent_config, budget):
    """Never more than the budget; an observation that leaves no room ends with "length"."""
    script = [call("calculator", expression="12+30") + IM_END]
    out, client, _ = run_loop(tokenizer, agent_config, script, max_response_length=budget)
    assert_well_formed(out)
    assert len(out.response_ids) <= budget
    assert out.finish_reason == "length"
    assert out.response_mask == policy_positions(client, out)
    assert out.metrics["agent/token_drift_ratio"] == 0.0


def test_max_model_len_caps_budget(tokenizer, agent_config):
    row = make_row(tokenizer)
    cap = len(row["raw_prompt_ids"]) + 60
    out, client, _ = run_loop(
        tokenizer, agent_config, [call("calculator", expression="1+1") + IM_END], max_model_len=cap
    )
    assert len(out.prompt_ids) + len(out.response_ids) < cap
    assert all(len(p) + len(g) < cap for p, g in zip(client.prompts, client.generated, strict=True))
