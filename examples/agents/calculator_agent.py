"""A plain OpenAI-client agent for tool-arith: it calls a calculator it executes itself.

It knows nothing of postrl. Run by the ``gateway`` agent loop once per trajectory::

    postrl train examples/agents/gateway_tool_arith.yaml

or by hand against any OpenAI-compatible server (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``POSTRL_TASK`` = a JSON file with ``messages``). The model sees the ``calculator`` function
through ``tools=``; every call it makes is evaluated here (integers and + - * / // % ** only)
and sent back as a ``tool`` message, until the model answers without a call or ``MAX_TURNS``
replies were made (``--max-turns N`` to change it); a call without an expression evaluates
the task's own problem (tool-arith's ``bound`` style). The dataset's reward function scores
the final answer.
"""

import ast
import json
import operator
import os
import sys

from openai import OpenAI

MAX_TURNS = 2  # a call, then the answer (the tool-arith recipe's max_assistant_turns)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression over integers.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    """The value of ``expression`` (only numbers and arithmetic), or an error message."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / // % ** are allowed")

    try:
        return str(ev(ast.parse(str(expression), mode="eval").body))
    except Exception as e:  # the model sees the error and may try again
        return f"Error: {e}"


def _problem(task: dict) -> str:
    """tool-arith's `bound` style calls the calculator without arguments: it evaluates the
    task's own problem (as postrl's ProblemCalculatorTool does for the built-in tool loop)."""
    kwargs = ((task.get("extra_info") or {}).get("tools_kwargs") or {}).get("calculator") or {}
    return (kwargs.get("create_kwargs") or {}).get("expression", "")


def _results(msg, problem: str) -> list[dict]:
    """The tool messages answering ``msg``'s calls."""
    out = []
    for call in msg.tool_calls:
        try:
            expression = json.loads(call.function.arguments).get("expression", "")
        except (json.JSONDecodeError, AttributeError):
            expression = ""
        expression = expression or problem  # a call without arguments: the task's own
        out.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return out


def main() -> None:
    """The command form: ``python calculator_agent.py [--max-turns N]``."""
    with open(os.environ["POSTRL_TASK"]) as f:
        task = json.load(f)
    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages = list(task["messages"])
    turns = (
        int(sys.argv[sys.argv.index("--max-turns") + 1]) if "--max-turns" in sys.argv else MAX_TURNS
    )
    for _ in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        messages += _results(msg, _problem(task))


async def run(base_url, api_key, task, task_path, reward_url, max_turns: int = MAX_TURNS):
    """The in-process form (``rollout.agent.gateway.entrypoint=calculator_agent:run`` with
    ``examples/agents`` on ``PYTHONPATH``): the same agent on ``AsyncOpenAI``, without a
    process and an ``openai`` import per trajectory."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = list(task["messages"])
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        messages += _results(msg, _problem(task))


if __name__ == "__main__":
    main()
