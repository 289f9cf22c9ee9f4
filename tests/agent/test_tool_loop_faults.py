"""Faulty tools, tool rewards/lifecycle, other templates, and the drift check catching a bug."""

from __future__ import annotations

import asyncio
import copy
import logging
import time

import pytest
from agent_helpers import ScriptedClient, make_row

from postrl.agent.tool_loop import ToolAgentLoop
from postrl.rollout.types import SamplingParams
from postrl.tools import BaseTool, ToolResponse, create_tools

IM_END = "<|im_end|>"
SP = SamplingParams(temperature=1.0, max_new_tokens=256, seed=3)


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def schema(name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {"type": "object", "properties": {}},
        },
    }


class Raises(BaseTool):
    async def execute(self, instance_id, parameters):
        raise RuntimeError("boom")


class Hangs(BaseTool):
    async def execute(self, instance_id, parameters):
        await asyncio.sleep(3600)


class NonString(BaseTool):
    async def execute(self, instance_id, parameters):
        return ToolResponse(12345)  # type: ignore[arg-type]


class Huge(BaseTool):
    async def execute(self, instance_id, parameters):
        return "x" * 10_000_000


class Rewarding(BaseTool):
    """Reward 0.25 per call, 1.0 at the end; records its lifecycle."""

    log: list[tuple[str, str]] = []

    async def create(self, instance_id, **kwargs):
        self.log.append(("create", instance_id, kwargs))
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters):
        return ToolResponse("ok", reward_delta=0.25)

    async def calc_reward(self, instance_id):
        return 1.0

    async def release(self, instance_id):
        self.log.append(("release", instance_id, {}))
        await super().release(instance_id)


def run(tokenizer, cfg, script, tools, row=None, **kw):
    client = ScriptedClient(tokenizer, list(script))
    loop = ToolAgentLoop(client, tokenizer, cfg, tools=tools, **kw)
    out = asyncio.run(asyncio.wait_for(loop.run(SP, **(row or make_row(tokenizer))), timeout=30))
    return out, client, loop


@pytest.mark.parametrize(
    "cls,needle",
    [(Raises, "boom"), (Hangs, "did not finish"), (NonString, "returned int"), (Huge, "truncated")],
)
def test_faulty_tool_becomes_error_observation(tokenizer, agent_config, cls, needle):
    tools = {"bad": cls(tool_schema=schema("bad"))}
    t0 = time.monotonic()
    out, client, _ = run(
        tokenizer, agent_config, [call("bad") + IM_END, "done" + IM_END], tools, tool_timeout_s=0.5
    )
    assert time.monotonic() - t0 < 10
    obs = [m for m in out.extra["messages"] if m["role"] == "tool"][0]["content"]
    assert needle in obs
    assert len(obs) <= agent_config.max_tool_response_length
    assert len(client.generated) == 2  # the trajectory went on
    if cls is not Huge:
        assert out.metrics["agent/tool_errors"] == 1
        assert any(k.startswith("tool/errors/") for k in out.metrics)
    else:
        assert out.metrics["tool/truncated"] == 1
    assert out.metrics["agent/token_drift_ratio"] == 0.0


def test_tool_reward_and_lifecycle(tokenizer, agent_config):
    Rewarding.log = []
    tools = {"rw": Rewarding(tool_schema=schema("rw"))}
    row = make_row(tokenizer)
    row["extra_info"] = {"tools_kwargs": {"rw": {"create_kwargs": {"secret": 7}}}}
    out, _, _ = run(
        tokenizer,
        agent_config,
        [call("rw") + "\n" + call("rw") + IM_END, "end" + IM_END],
        tools,
        row=row,
    )
    assert out.extra["tool_reward"] == pytest.approx(0.25 * 2 + 1.0)
    kinds = [k for k, _, _ in Rewarding.log]
    assert kinds == [
        "create",
        "release",
    ]  # created once per trajectory (with its kwargs), released at the end
    assert Rewarding.log[0][2] == {"secret": 7}
    assert Rewarding.log[0][1] == Rewarding.log[1][1]


def test_tools_released_when_generation_fails(tokenizer, agent_config):
    Rewarding.log = []

    class Failing(ScriptedClient):
        async def generate(self, prompt_ids, sampling, request_id, trajectory_id=None):
            if self.prompts:
                raise RuntimeError("engine died")
            return await super().generate(prompt_ids, sampling, request_id, trajectory_id)

    loop = ToolAgentLoop(
        Failing(tokenizer, [call("rw") + IM_END]),
        tokenizer,
        agent_config,
        tools={"rw": Rewarding(tool_schema=schema("rw"))},
    )
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(loop.run(SP, **make_row(tokenizer)))
    assert [k for k, _, _ in Rewarding.log] == ["create", "release"]


def test_tools_from_config_file(tokenizer, agent_config, tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n")
    from dataclasses import replace

    cfg = replace(agent_config, tool_config_path=str(path))
    out, _, loop = run(
        tokenizer, cfg, [call("calculator", expression="6*7") + IM_END, "42" + IM_END], None
    )
    assert list(loop.tools) == ["calculator"]
    assert "42" in [m for m in out.extra["messages"] if m["role"] == "tool"][0]["content"]


def test_drift_check_catches_missing_separator(tokenizer, agent_config, caplog):
    """The classic assistant→tool boundary bug (dropping the template's "\\n" after <|im_end|>)."""
    client = ScriptedClient(
        tokenizer, [call("calculator", expression="1+1") + IM_END, "2" + IM_END]
    )
    loop = ToolAgentLoop(client, tokenizer, agent_config, tools=create_tools(["calculator"]))
    good = loop.delta.observation
    loop.delta.observation = lambda msgs, gen: good(msgs, gen)[1:]  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="postrl.agent.tool_loop"):
        out = asyncio.run(loop.run(SP, **make_row(tokenizer)))
    assert out.metrics["agent/token_drift_ratio"] > 0
    assert any("token drift" in r.message for r in caplog.records)


# Other ChatML-token templates: no separator after the end-of-turn token, and a default system
# prompt inserted when the conversation has none (Qwen2.5 behaviour).
NO_SEP = (
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + m['content'] + '<|im_end|>' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize(
    "template", [NO_SEP, DEFAULT_SYSTEM], ids=["no_separator", "grouped_tools_default_system"]
)
def test_other_templates_have_zero_drift(tokenizer, agent_config, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    turn = call("calculator", expression="2+3") + call("calculator", expression="4*5") + IM_END
    row = make_row(tok, system=None)  # DEFAULT_SYSTEM then inserts its own system turn
    out, client, loop = run(
        tok, agent_config, [turn, "5, 20" + IM_END], create_tools(["calculator"]), row=row
    )
    assert out.metrics["agent/num_tool_calls"] == 2
    assert out.metrics["agent/token_drift_ratio"] == 0.0
    assert out.metrics["agent/retokenize_drift_ratio"] == 0.0
    gen1, gen2 = client.generated
    assert out.response_mask == [1] * len(gen1) + [0] * (
        len(out.response_ids) - len(gen1) - len(gen2)
    ) + [1] * len(gen2)
