"""``tool_arith``: large-number arithmetic where the ``calculator`` tool gives the exact answer.

Problems are 6–9 digit products, sums of three numbers and ``a * b - c`` — easy to get exactly
right with the tool, nearly impossible for a small model without it, so reward rises only if
the policy learns to call the tool and copy its result.

* :func:`generate_tool_arith` — RL rows in verl's parquet schema (``data_source="tool_arith"``,
  ``agent_name="tool_agent"``, the system message describes the tool and the ``<tool_call>``
  format, ``reward_model.ground_truth`` is the exact integer as a string).
* :func:`tool_arith_demonstrations` — full multi-turn conversations (user → assistant with a
  ``<tool_call>`` → tool result → assistant final answer) as SFT rows ``{"messages": [...]}``
  for a warm-up before RL.
* :func:`compute_tool_arith_score` — the reward: 1.0 when the last integer of the **final
  assistant turn** equals the ground truth. Integers inside ``<tool_call>`` and
  ``<tool_response>`` blocks and in earlier turns never count, so calling the tool and then
  stopping without answering scores 0.

Train and test splits are disjoint by construction (problems are partitioned by a hash).
"""

from __future__ import annotations

import copy
import json
import random
import re
from typing import Any

from postrl.tools.base import ToolResponse
from postrl.tools.calculator import CalculatorTool

__all__ = [
    "KINDS",
    "PROMPT_STYLES",
    "ProblemCalculatorTool",
    "SYSTEM_PROMPT",
    "compute_tool_arith_score",
    "final_answer_text",
    "generate_tool_arith",
    "tool_arith_demonstrations",
]

SYSTEM_PROMPT = (
    "You can use a calculator tool. To call it, write exactly:\n"
    "<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "<arithmetic expression>"}}\n'
    "</tool_call>\n"
    "The expression may use integers, + - * / // % ** and parentheses. The result comes back "
    "in a tool message. Then give the final answer as: The answer is <integer>."
)


#: problem kinds: ``a * b``, ``a + b + c``, ``a * b - c``.
KINDS: tuple[str, ...] = ("mul", "sum3", "mulsub")

#: Conversation styles:
#:
#: * ``full``: the system message above + "What is E? Use the calculator."; the call carries the
#:   expression; the final answer is "The answer is V.".
#: * ``short``: no system message, "What is E?" (the tool format is learned from the SFT
#:   demonstrations only: ~20 prompt tokens instead of ~450 for a byte-level model); otherwise
#:   as ``full``.
#: * ``bound``: as ``short``, but the call has no arguments
#:   (``{"name": "calculator", "arguments": {}}``) — the :class:`ProblemCalculatorTool` evaluates
#:   the episode's own problem, handed to it through the row's ``tools_kwargs`` — and the final
#:   answer is the bare number. For models too small to copy operands ~60 tokens back (see
#:   ``examples/grpo_tool_arith.yaml``): the policy still has to decide to call the tool and copy
#:   its result into the answer.
PROMPT_STYLES: tuple[str, ...] = ("full", "short", "bound")


def _split_seed(seed: int, split: str) -> int:
    return seed * 1_000_003 + {"train": 0, "test": 7919, "val": 7919}.get(split, 104729) + 17


def _problem(
    rng: random.Random, min_digits: int, max_digits: int, kinds: tuple[str, ...] = KINDS
) -> tuple[str, int]:
    def num() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randrange(10 ** (d - 1), 10**d)

    kind = rng.choice(kinds)
    if kind == "mul":
        a, b = num(), num()
        return f"{a} * {b}", a * b
    if kind == "sum3":
        a, b, c = num(), num(), num()
        return f"{a} + {b} + {c}", a + b + c
    a, b, c = num(), num(), num()
    return f"{a} * {b} - {c}", a * b - c


def _check_options(
    min_digits: int,
    max_digits: int,
    kinds: tuple[str, ...],
    prompt_style: str,
    result_digits: int = 0,
) -> None:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if result_digits < 0:
        raise ValueError(f"result_digits={result_digits!r}: must be >= 1 (or 0 for any length)")
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds={list(kinds)!r}: choose a non-empty subset of {list(KINDS)}")
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style={prompt_style!r}: choose one of {list(PROMPT_STYLES)}")


def _problems(
    n: int,
    seed: int,
    split: str,
    min_digits: int,
    max_digits: int,
    kinds: tuple[str, ...] = KINDS,
    result_digits: int = 0,
) -> list[tuple[str, int]]:
    rng = random.Random(_split_seed(seed, split))
    want_test = split != "train"
    out: list[tuple[str, int]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(
                f"could not draw {n} {split}-split problems with {min_digits}-"
                f"{max_digits} digits, kinds {list(kinds)} and result_digits="
                f"{result_digits}; allow more digits or set result_digits=0"
            )
        expr, value = _problem(rng, min_digits, max_digits, kinds)
        if result_digits and len(str(value)) != result_digits:
            continue
        if (hash_split(expr) == "test") == want_test:
            out.append((expr, value))
    return out


def hash_split(expr: str) -> str:
    """Deterministic split of a problem: 20% of expressions are test-only."""
    return "test" if sum(map(ord, expr)) * 2654435761 % 2**32 % 5 == 0 else "train"


def _prompt(expr: str, prompt_style: str) -> list[dict[str, str]]:
    if prompt_style != "full":
        return [{"role": "user", "content": f"What is {expr}?"}]
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {expr}? Use the calculator."},
    ]


def generate_tool_arith(
    n: int,
    seed: int = 0,
    split: str = "train",
    min_digits: int = 6,
    max_digits: int = 9,
    kinds: tuple[str, ...] | list[str] = KINDS,
    prompt_style: str = "full",
    result_digits: int = 0,
) -> list[dict[str, Any]]:
    """``n`` RL rows in verl's schema (see module docstring).

    ``min_digits``/``max_digits`` bound each operand, ``kinds`` picks the problem kinds (a subset
    of :data:`KINDS`), ``prompt_style`` one of :data:`PROMPT_STYLES`; ``result_digits`` > 0 keeps
    only problems whose exact result has that many characters (e.g. 4 for 2-digit products of
    at least 1000): every conversation then has the same layout, so the result sits at a fixed
    distance before the final answer — easier to copy for a tiny model (it helped at SFT lr
    3e-3; at 1e-3 the recipe does without it, see ``docs/tools.md``)."""
    kinds = tuple(kinds)
    _check_options(min_digits, max_digits, kinds, prompt_style, result_digits)
    rows = []
    for i, (expr, value) in enumerate(
        _problems(n, seed, split, min_digits, max_digits, kinds, result_digits)
    ):
        rows.append(
            {
                "data_source": "tool_arith",
                "prompt": _prompt(expr, prompt_style),
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(value)},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "expression": expr,
                    "answer": str(value),
                    "tools_kwargs": {"calculator": {"create_kwargs": {"expression": expr}}},
                },
                "agent_name": "tool_agent",
            }
        )
    return rows


def tool_arith_demonstrations(
    n: int,
    seed: int = 0,
    min_digits: int = 6,
    max_digits: int = 9,
    kinds: tuple[str, ...] | list[str] = KINDS,
    prompt_style: str = "full",
    tool_fraction: float = 1.0,
    result_digits: int = 0,
    copy_fraction: float = 0.0,
) -> list[dict[str, Any]]:
    """``n`` SFT rows ``{"messages": [...]}``: one correct conversation each.

    A ``copy_fraction`` of them (rounded) are *tool-reading* rows: a tool message holding a
    problem's result, then the assistant's final answer with that result (tool → assistant
    "The answer is V.") — no question, no call: they only teach reading the answer off a tool
    response, at the same distance as in a full conversation (a tiny model learns that copy far
    faster from these short rows than from the few answer tokens of full demonstrations). Of the
    other rows, a ``tool_fraction`` (rounded, at random positions) call the calculator and copy
    its result (user → assistant ``<tool_call>`` → tool → assistant "The answer is V."); the rest
    answer directly (user → assistant "The answer is V."). A fraction below 1 gives a
    warm-started policy that calls the tool only sometimes, so RL has a tool-use rate to raise:
    the direct answers are correct in the data, but a small model cannot compute them itself.
    Drawn from the train split (a different stream than :func:`generate_tool_arith` with the
    same seed), so they never contain a test problem. Other options as in
    :func:`generate_tool_arith`.
    """
    kinds = tuple(kinds)
    _check_options(min_digits, max_digits, kinds, prompt_style, result_digits)
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction={tool_fraction!r}: must be in [0, 1]")
    if not 0.0 <= copy_fraction <= 1.0:
        raise ValueError(f"copy_fraction={copy_fraction!r}: must be in [0, 1]")
    problems = _problems(n, seed + 7_777_777, "train", min_digits, max_digits, kinds, result_digits)
    n_copy = round(copy_fraction * n)
    n_tool = round(tool_fraction * (n - n_copy))
    kind = ["tool"] * n_tool + ["direct"] * (n - n_copy - n_tool) + ["copy"] * n_copy
    if n_tool < n:
        random.Random(seed + 31).shuffle(kind)
    rows = []
    for (expr, value), row_kind in zip(problems, kind):
        bound = prompt_style == "bound"
        answer = {
            "role": "assistant",
            "content": str(value) if bound else f"The answer is {value}.",
        }
        if row_kind == "copy":
            rows.append(
                {
                    "messages": [
                        {"role": "tool", "name": "calculator", "content": str(value)},
                        answer,
                    ]
                }
            )
            continue
        if row_kind == "direct":
            rows.append({"messages": [*_prompt(expr, prompt_style), answer]})
            continue
        call = json.dumps(
            {"name": "calculator", "arguments": {} if bound else {"expression": expr}}
        )
        rows.append(
            {
                "messages": [
                    *_prompt(expr, prompt_style),
                    {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                    {"role": "tool", "name": "calculator", "content": str(value)},
                    answer,
                ]
            }
        )
    return rows


_BLOCKS = re.compile(
    r"<tool_call>.*?(?:</tool_call>|\Z)|<tool_response>.*?(?:</tool_response>|\Z)", re.DOTALL
)
_ASSISTANT_START = re.compile(
    r"<\|im_start\|>assistant|<\|start_header_id\|>assistant"
    r"<\|end_header_id\|>"
)
_INT = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)")


def final_answer_text(solution_str: str) -> str:
    """The last assistant turn of a decoded multi-turn response, minus tool call/response blocks.

    Turn boundaries are recognised for ChatML (Qwen) and Llama-3 templates; text without any
    marker is taken whole (single-turn responses)."""
    starts = [m.end() for m in _ASSISTANT_START.finditer(solution_str)]
    tail = solution_str[starts[-1] :] if starts else solution_str
    return _BLOCKS.sub(" ", tail)


def compute_tool_arith_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    partial_credit: float = 0.0,
    **kwargs: Any,
) -> dict[str, float]:
    """verl-signature reward: ``score`` = 1.0 iff the final turn's last integer is the answer.

    ``partial_credit`` (a reward kwarg, default 0): a wrong answer scores ``partial_credit ×``
    the fraction of the answer's digit positions (left-aligned, over the longer of the two) that
    match — a denser signal for models that copy only part of a number. ``acc`` (what
    validation reports) stays exact."""
    ints = _INT.findall(final_answer_text(solution_str))
    target = int(str(ground_truth).strip().replace(",", ""))
    got = ints[-1].replace(",", "") if ints else ""
    acc = float(bool(got) and int(got) == target)
    score = acc
    if not acc and partial_credit and got:
        want = str(target)
        score = partial_credit * sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
    used_tool = float("<tool_call>" in solution_str)
    return {"score": score, "acc": acc, "used_tool": used_tool}


def _register() -> None:
    """Register the reward under ``tool_arith`` unless an entry (e.g. a lazy one) exists."""
    try:
        from postrl.reward.registry import REWARD_FNS
    except ImportError:  # pragma: no cover - reward package absent
        return
    if "tool_arith" not in REWARD_FNS:
        REWARD_FNS.add("tool_arith", compute_tool_arith_score, batch=False, inline=True)


class ProblemCalculatorTool(CalculatorTool):
    """``calculator`` whose ``expression`` defaults to the episode's problem.

    A call without an ``expression`` evaluates the one the row handed to :meth:`create`
    (``extra_info.tools_kwargs.calculator.create_kwargs.expression``, written by
    :func:`generate_tool_arith`); a call with one behaves like :class:`CalculatorTool`. Used by
    the ``bound`` style. Tool config: ``class_name: postrl.data.tool_arith:ProblemCalculatorTool``.
    """

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """``calculator(expression: str = <this problem>)``."""
        schema = copy.deepcopy(CalculatorTool.default_schema())
        fn = schema["function"]
        fn["description"] = (
            "Evaluate an arithmetic expression exactly; without an expression, "
            "evaluate the current problem."
        )
        fn["parameters"]["required"] = []
        return schema

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        """Evaluate ``parameters['expression']``, or the episode's problem when it is absent."""
        if "expression" not in parameters:
            expr = self._instances.get(instance_id, {}).get("expression")
            if not isinstance(expr, str):
                return ToolResponse(
                    "Error: no expression given and this episode has no problem "
                    "(tools_kwargs.calculator.create_kwargs.expression)",
                    metrics={"tool/errors/bad_arguments": 1.0},
                    error="bad_arguments",
                )
            parameters = {**parameters, "expression": expr}
        return await super().execute(instance_id, parameters)


_register()
