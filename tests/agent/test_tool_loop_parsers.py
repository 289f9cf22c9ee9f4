"""The tool loop runs with the parser named by ``rollout.agent.tool_parser``: two calls of the
real calculator in one turn, written in each family's format, are executed; XML-style values
are typed by the tools' schemas (a string ``expression`` of ``"6"`` stays text)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from agent_helpers import ScriptedClient, make_row

from postrl.agent.tool_loop import ToolAgentLoop
from postrl.rollout.types import SamplingParams

IM_END = "<|im_end|>"
A, B = "6", "7*6"
# one turn with two calls per family (formats as in tests/tools/test_parsers.py)
TURNS = {
    "qwen3_coder": "".join(
        f"<tool_call>\n<function=calculator>\n<parameter=expression>\n{e}\n</parameter>\n"
        "</function>\n</tool_call>\n"
        for e in (A, B)
    ),
    "glm45": "".join(
        f"<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{e}</arg_value>\n"
        "</tool_call>"
        for e in (A, B)
    ),
    "kimi_k2": "<|tool_calls_section_begin|>"
    + "".join(
        f"<|tool_call_begin|>functions.calculator:{i}<|tool_call_argument_begin|>"
        + json.dumps({"expression": e})
        + "<|tool_call_end|>"
        for i, e in enumerate((A, B))
    )
    + "<|tool_calls_section_end|>",
    "gpt-oss": "".join(
        "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
        f"<|message|>{json.dumps({'expression': e})}<|call|>"
        for e in (A, B)
    ),
}


@pytest.mark.parametrize("parser", sorted(TURNS))
def test_tool_loop_uses_the_configured_parser(tokenizer, agent_config, parser):
    from postrl.tools import create_tools

    cfg = replace(agent_config, tool_parser=parser, check_token_faithfulness=False)
    client = ScriptedClient(tokenizer, [TURNS[parser] + IM_END, "6 and 42" + IM_END])
    loop = ToolAgentLoop(client, tokenizer, cfg, tools=create_tools(["calculator"]))
    sp = SamplingParams(temperature=1.0, max_new_tokens=512, seed=3)
    out = asyncio.run(asyncio.wait_for(loop.run(sp, **make_row(tokenizer)), timeout=60))
    assert out.metrics["agent/num_tool_calls"] == 2 and out.metrics["agent/tool_errors"] == 0
    tool_msgs = [m["content"] for m in out.extra["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == 2 and "6" in tool_msgs[0] and "42" in tool_msgs[1]
    assert out.extra["termination"] == "no_tool_call"
