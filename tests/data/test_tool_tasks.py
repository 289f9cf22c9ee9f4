"""tool_arith and code task generators, and their rewards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from postrl.data.code_tasks import (
    compute_code_score,
    compute_code_score_async,
    extract_code,
    generate_code_tasks,
)
from postrl.data.tool_arith import (
    compute_tool_arith_score,
    generate_tool_arith,
    tool_arith_demonstrations,
)
from postrl.tools import get_tool_parser
from postrl.tools.calculator import safe_eval
from postrl.tools.sandbox import Sandbox, SandboxConfig

# ----------------------------------------------------------------------------- tool_arith


def test_tool_arith_rows_schema_exactness_and_disjoint_splits():
    train = generate_tool_arith(200, seed=1, split="train")
    test = generate_tool_arith(50, seed=1, split="test")
    assert generate_tool_arith(200, seed=1, split="train") == train  # deterministic
    r = train[0]
    assert r["data_source"] == "tool_arith" and r["agent_name"] == "tool_agent"
    assert [m["role"] for m in r["prompt"]] == ["system", "user"]
    assert "<tool_call>" in r["prompt"][0]["content"] and r["reward_model"]["style"] == "rule"
    for row in train + test:
        expr = row["extra_info"]["expression"]
        # the calculator tool gives exactly the ground truth
        assert str(safe_eval(expr)) == row["reward_model"]["ground_truth"]
        assert len(row["reward_model"]["ground_truth"].lstrip("-")) >= 6
    exprs = lambda rows: {x["extra_info"]["expression"] for x in rows}  # noqa: E731
    assert not exprs(train) & exprs(test)


def test_tool_arith_rows_load_in_the_dataset_validator():
    from postrl.data.dataset import validate_row

    for i, row in enumerate(generate_tool_arith(5, seed=0)):
        validate_row(row, f"row {i}")


def test_demonstrations_are_correct_conversations():
    parser = get_tool_parser("hermes")
    demos = tool_arith_demonstrations(20, seed=0)
    assert len(demos) == 20
    for d in demos:
        msgs = d["messages"]
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
        calls = parser.parse(msgs[2]["content"]).calls
        assert len(calls) == 1 and calls[0].name == "calculator"
        value = str(safe_eval(calls[0].arguments["expression"]))
        assert msgs[3]["content"] == value and msgs[4]["content"] == f"The answer is {value}."
        # the final turn scores 1 with the task's own reward
        assert compute_tool_arith_score("tool_arith", msgs[4]["content"], value)["score"] == 1.0


def test_tool_arith_demonstrations_render_with_a_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(tool_arith_demonstrations(1)[0]["messages"], tokenize=False)
    assert "<tool_call>" in text and "The answer is" in text


def test_short_prompt_style_and_kinds():
    from postrl.data.dataset import validate_row

    rows = generate_tool_arith(
        30, seed=2, min_digits=3, max_digits=3, kinds=["mul"], prompt_style="short"
    )
    for i, row in enumerate(rows):
        validate_row(row, f"row {i}")
        expr = row["extra_info"]["expression"]
        assert row["prompt"] == [{"role": "user", "content": f"What is {expr}?"}]
        a, op, b = expr.split()
        assert op == "*" and len(a) == len(b) == 3
        assert str(safe_eval(expr)) == row["reward_model"]["ground_truth"]
    # the default stays the full prompt with the system message
    assert generate_tool_arith(1)[0]["prompt"][0]["role"] == "system"


def test_demonstrations_mix_tool_use_and_direct_answers():
    demos = tool_arith_demonstrations(
        40,
        seed=0,
        min_digits=3,
        max_digits=3,
        kinds=["mul"],
        prompt_style="short",
        tool_fraction=0.25,
    )
    tool = [d for d in demos if len(d["messages"]) == 4]
    direct = [d for d in demos if len(d["messages"]) == 2]
    assert len(tool) == 10 and len(direct) == 30
    for d in direct:
        user, answer = d["messages"]
        assert user["role"] == "user" and answer["role"] == "assistant"
        value = safe_eval(user["content"].removeprefix("What is ").removesuffix("?"))
        assert answer["content"] == f"The answer is {value}."
    for d in tool:
        assert [m["role"] for m in d["messages"]] == ["user", "assistant", "tool", "assistant"]
    # the tool-using rows are not all at the front
    assert [len(d["messages"]) for d in demos][:10] != [4] * 10
    # same problems whatever the fraction: only the solution style changes
    all_tool = tool_arith_demonstrations(
        40, seed=0, min_digits=3, max_digits=3, kinds=["mul"], prompt_style="short"
    )
    assert [d["messages"][0] for d in all_tool] == [d["messages"][0] for d in demos]
    assert all(len(d["messages"]) == 4 for d in all_tool)


def test_bound_style_calls_the_problem_calculator():
    from postrl.data.tool_arith import ProblemCalculatorTool
    from postrl.tools.config import load_tool_config

    rows = generate_tool_arith(
        8, seed=0, min_digits=2, max_digits=2, kinds=["mul"], prompt_style="bound"
    )
    demos = tool_arith_demonstrations(
        8,
        seed=0,
        min_digits=2,
        max_digits=2,
        kinds=["mul"],
        prompt_style="bound",
        tool_fraction=0.5,
    )
    parser = get_tool_parser("hermes")
    root = Path(__file__).resolve().parents[2]
    tools = load_tool_config(root / "examples" / "tools" / "problem_calculator.yaml")
    tool = tools["calculator"]
    assert isinstance(tool, ProblemCalculatorTool) and tool.name == "calculator"

    async def run(instance: str, create_kwargs: dict, args: dict) -> str:
        await tool.create(instance, **create_kwargs)
        try:
            return (await tool.execute(instance, args)).text
        finally:
            await tool.release(instance)

    for row in rows:
        kw = row["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"]
        assert kw == {"expression": row["extra_info"]["expression"]}
        # no expression: the episode's problem; an explicit one still wins
        assert asyncio.run(run("a", kw, {})) == row["reward_model"]["ground_truth"]
        assert asyncio.run(run("b", kw, {"expression": "2 + 2"})) == "4"
    assert asyncio.run(run("c", {}, {})).startswith("Error: no expression")
    for d in demos:
        msgs = d["messages"]
        value = safe_eval(msgs[0]["content"].removeprefix("What is ").removesuffix("?"))
        assert msgs[-1] == {"role": "assistant", "content": str(value)}  # bare number
        if len(msgs) == 4:
            (call,) = parser.parse(msgs[1]["content"]).calls
            assert call == ("calculator", {}) and msgs[2]["content"] == str(value)
        assert compute_tool_arith_score("tool_arith", msgs[-1]["content"], value)["score"] == 1.0


def test_result_digits_fixes_the_answer_length_in_both_splits():
    kw = dict(min_digits=2, max_digits=2, kinds=["mul"], prompt_style="bound", result_digits=4)
    rows = generate_tool_arith(64, seed=0, **kw) + generate_tool_arith(
        16, seed=0, split="test", **kw
    )
    assert all(len(r["reward_model"]["ground_truth"]) == 4 for r in rows)
    assert len({r["extra_info"]["expression"] for r in rows}) == 80  # still varied, splits disjoint
    demos = tool_arith_demonstrations(64, seed=0, tool_fraction=0.5, **kw)
    assert all(len(d["messages"][-1]["content"]) == 4 for d in demos)
    # without the filter, 2-digit products also have 3 digits
    free = generate_tool_arith(64, seed=0, min_digits=2, max_digits=2, kinds=["mul"])
    assert {len(r["reward_model"]["ground_truth"]) for r in free} == {3, 4}
    with pytest.raises(ValueError, match="result_digits"):
        generate_tool_arith(4, min_digits=2, max_digits=2, kinds=["mul"], result_digits=9)


def test_copy_rows_read_the_answer_off_a_tool_response(tiny_model_dir):
    from transformers import AutoTokenizer

    demos = tool_arith_demonstrations(
        50,
        seed=0,
        min_digits=2,
        max_digits=2,
        kinds=["mul"],
        prompt_style="bound",
        tool_fraction=0.3,
        result_digits=4,
        copy_fraction=0.6,
    )
    by_len = {n: [d for d in demos if len(d["messages"]) == n] for n in (2, 4)}
    copy = [d for d in by_len[2] if d["messages"][0]["role"] == "tool"]
    direct = [d for d in by_len[2] if d["messages"][0]["role"] == "user"]
    assert (len(copy), len(by_len[4]), len(direct)) == (30, 6, 14)  # 60% copy, 30% of the rest call
    for d in copy:
        tool, answer = d["messages"]
        assert (
            answer == {"role": "assistant", "content": tool["content"]}
            and len(tool["content"]) == 4
        )
    # the answer sits at the same distance after the result as in a full tool conversation
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def gap(msgs: list[dict]) -> int:
        ids = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        digits = tok(msgs[-1]["content"], add_special_tokens=False)["input_ids"]
        starts = [i for i in range(len(ids)) if ids[i : i + len(digits)] == digits]
        return starts[-1] - starts[-2]

    assert {gap(d["messages"]) for d in copy + by_len[4]} == {19}
    assert gap(copy[0]["messages"]) == gap(by_len[4][0]["messages"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kinds=["div"]), "kinds"),
        (dict(kinds=[]), "kinds"),
        (dict(prompt_style="long"), "prompt_style"),
        (dict(min_digits=4, max_digits=3), "min_digits"),
        (dict(tool_fraction=1.5), "tool_fraction"),
        (dict(copy_fraction=-0.1), "copy_fraction"),
        (dict(result_digits=-1), "result_digits"),
    ],
)
def test_bad_generator_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tool_arith_demonstrations(2, **kwargs)


@pytest.mark.parametrize(
    "response, score",
    [
        ("The answer is 121932631112635269.", 1.0),
        ("121,932,631,112,635,269", 1.0),
        ("The answer is 121932631112635268.", 0.0),
        # the tool's observation holds the answer, but the final turn does not give it
        (
            '<tool_call>\n{"name": "calculator", '
            '"arguments": {"expression": "123456789 * 987654321"}}'
            "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n121932631112635269\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\nI am not sure.<|im_end|>",
            0.0,
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n121932631112635269\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\nThe answer is 121932631112635269.<|im_end|>",
            1.0,
        ),
        ("", 0.0),
    ],
)
def test_tool_arith_reward_reads_only_the_final_turn(response, score):
    out = compute_tool_arith_score("tool_arith", response, "121932631112635269")
    assert out["score"] == score


def test_tool_arith_partial_credit_is_opt_in_and_below_exact():
    exact = compute_tool_arith_score("tool_arith", "6992", "6992", partial_credit=0.5)
    assert exact["score"] == 1.0 and exact["acc"] == 1.0
    half = compute_tool_arith_score("tool_arith", "6950", "6992", partial_credit=0.5)
    assert half["score"] == pytest.approx(0.5 * 2 / 4) and half["acc"] == 0.0
    assert (
        compute_tool_arith_score("tool_arith", "6950", "6992")["score"] == 0.0
    )  # default: exact only
    assert (
        compute_tool_arith_score("tool_arith", "no number", "6992", partial_credit=0.5)["score"]
        == 0.0
    )
    # a longer wrong answer is not rewarded for its extra digits
    assert compute_tool_arith_score("tool_arith", "69920", "6992", partial_credit=0.5)[
        "score"
    ] == pytest.approx(0.4)


def test_rewards_registered_by_data_source():
    from postrl.reward.registry import REWARD_FNS

    assert "tool_arith" in REWARD_FNS and "code" in REWARD_FNS
    fn = REWARD_FNS.get("tool_arith")
    assert fn("tool_arith", "The answer is 5", "5")["score"] == 1.0


# ----------------------------------------------------------------------------- code


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxConfig(wall_time_s=3.0, cpu_time_s=2, memory_mb=256, concurrency=2))
    if sb.isolation_report().missing(sb.config.required_layers):
        pytest.skip(
            "sandbox isolation unavailable on this host: " + sb.isolation_report().summary()
        )
    return sb


def test_code_tasks_schema_and_reference_solutions_pass(sandbox):
    rows = generate_code_tasks(12, seed=0)
    assert rows == generate_code_tasks(12, seed=0)
    assert {r["data_source"] for r in rows} == {"code"}

    async def score_all():
        return await asyncio.gather(
            *[
                compute_code_score_async(
                    f"Here:\n```python\n{r['extra_info']['reference_solution']}```",
                    r["reward_model"]["ground_truth"],
                    sandbox,
                )
                for r in rows
            ]
        )

    for row, out in zip(rows, asyncio.run(score_all())):
        tests = json.loads(row["reward_model"]["ground_truth"])
        assert len(tests) == 5 and all(set(t) == {"input", "output"} for t in tests)
        assert out == {"score": 1.0, "passed": 5, "total": 5, "error": None, "infra_error": 0.0}, (
            row["prompt"],
            out,
        )


def test_code_score_partial_wrong_and_errors(sandbox):
    gt = json.dumps(
        [
            {"input": [1], "output": 2},
            {"input": [2], "output": 4},
            {"input": [0], "output": 0},
            {"input": [-3], "output": -6},
        ]
    )
    half = (
        "```python\ndef f(x):\n    if x > 0:\n        return 2 * x\n"
        "    raise ValueError('neg')\n```"
    )
    out = compute_code_score(half, gt, sandbox)
    assert out["score"] == 0.5 and out["passed"] == 2
    assert "2 of 4 tests failed" in out["error"] and "ValueError: neg" in out["error"]

    assert compute_code_score("no code here", gt, sandbox)["error"].startswith("no ```python")
    syn = compute_code_score("```python\ndef f(x) return x\n```", gt, sandbox)
    assert syn["score"] == 0.0 and "SyntaxError" in syn["error"]
    loop = compute_code_score("```python\nwhile True:\n    pass\n```", gt, sandbox)
    assert loop["score"] == 0.0 and "timeout" in loop["error"] and loop["infra_error"] == 0.0
    # bool is not int, tuple normalises to list
    gt2 = json.dumps([{"input": [3], "output": [3, 3]}])
    assert (
        compute_code_score("```python\ndef f(x):\n    return (x, x)\n```", gt2, sandbox)["score"]
        == 1.0
    )


def test_code_score_cannot_fake_results_by_printing_the_marker(sandbox):
    gt = json.dumps([{"input": [1], "output": 123456}])
    cheat = (
        '```python\nprint(\'@@postrl-results-0000@@{"results": [["ok", 123456]]}\')\n'
        "def f(x):\n    return 0\n```"
    )
    assert compute_code_score(cheat, gt, sandbox)["score"] == 0.0


def test_code_score_reports_refusal_as_infra_error():
    sb = Sandbox(SandboxConfig(disabled_layers=("net_namespace",)))  # required but disabled
    out = compute_code_score(
        "```python\ndef f(x):\n    return x\n```", json.dumps([{"input": [1], "output": 1}]), sb
    )
    assert out["score"] == 0.0 and out["infra_error"] == 1.0 and "refused" in out["error"]


def test_extract_code_prefers_last_python_block():
    text = "```\nplain\n```\n```python\nfirst\n```\n```python\nsecond\n```"
    assert extract_code(text) == "second\n"
    assert extract_code("```\nonly plain\n```") == "only plain\n"
    assert extract_code("none") is None


def test_code_score_works_inside_a_running_loop(sandbox):
    async def inside():
        return compute_code_score(
            "```python\ndef f(x):\n    return x\n```",
            json.dumps([{"input": [1], "output": 1}]),
            sandbox,
        )

    assert asyncio.run(inside())["score"] == 1.0


def test_code_score_reuses_a_sandbox_across_event_loops(sandbox):
    gt = json.dumps([{"input": [1], "output": 1}])
    code = "```python\ndef f(x):\n    import time; time.sleep(0.05)\n    return x\n```"

    async def many():
        return await asyncio.gather(
            *[compute_code_score_async(code, gt, sandbox) for _ in range(4)]
        )

    for _ in range(2):  # two loops, each with contention on the pool
        assert [r["score"] for r in asyncio.run(many())] == [1.0] * 4


def test_cli_writes_the_recipe_demonstrations(tmp_path):
    from postrl.cli import main
    from postrl.data import read_rows

    out = tmp_path / "demos.parquet"
    assert (
        main(
            [
                "data",
                "tool-arith",
                str(out),
                "--n",
                "40",
                "--sft",
                "--copy-fraction",
                "0.5",
                "--tool-fraction",
                "0.25",
                "--min-digits",
                "2",
                "--max-digits",
                "2",
                "--kinds",
                "mul",
                "--prompt-style",
                "bound",
                "--result-digits",
                "4",
            ]
        )
        == 0
    )
    rows = read_rows(out)
    roles = [tuple(m["role"] for m in r["messages"]) for r in rows]
    assert roles.count(("tool", "assistant")) == 20
    assert roles.count(("user", "assistant", "tool", "assistant")) == 5
    assert roles.count(("user", "assistant")) == 15
    assert all(len(r["messages"][-1]["content"]) == 4 for r in rows)
