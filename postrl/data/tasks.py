"""Synthetic tasks and converters that write parquet in verl's schema.

Every row has ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model = {style, ground_truth}`` and ``extra_info``; the generators are seeded and
deterministic. ``addition`` and ``countdown`` are small enough for a tiny model on a CPU;
``convert_gsm8k`` reads a GSM8K/MATH-style file the user already has locally.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "TASKS",
    "generate_addition",
    "generate_countdown",
    "convert_gsm8k",
    "write_parquet",
    "read_rows",
    "sft_rows_from_rl_rows",
    "preference_pairs",
]


def _split_seed(seed: int, split: str) -> int:
    # Different splits of the same seed must not share prompts by construction.
    return seed * 1_000_003 + {"train": 0, "test": 7919, "val": 7919}.get(split, 104729)


def generate_addition(
    n: int, seed: int = 0, split: str = "train", max_digits: int = 2
) -> list[dict[str, Any]]:
    """Rows asking "What is A+B?" with 0 <= A, B < 10**max_digits; ground truth "A+B".

    Train and test splits are disjoint: the (A, B) pairs are partitioned by a hash of the pair.
    """
    rng = random.Random(_split_seed(seed, split))
    hi = 10**max_digits
    rows = []
    want_test = split != "train"
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(
                f"cannot draw {n} distinct-split addition problems with max_digits={max_digits}"
            )
        a, b = rng.randrange(hi), rng.randrange(hi)
        if ((a * 131 + b * 17) % 5 == 0) != want_test:  # 20% of pairs are test-only
            continue
        rows.append(
            {
                "data_source": "addition",
                "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": len(rows), "answer": str(a + b)},
            }
        )
    return rows


def _countdown_solve(numbers: list[int], rng: random.Random) -> tuple[int, str]:
    """Build a random expression using every number once; return (value, expression)."""
    nums = numbers[:]
    rng.shuffle(nums)
    expr, value = str(nums[0]), nums[0]
    for x in nums[1:]:
        ops = ["+", "-", "*"]
        if x != 0 and value % x == 0:
            ops.append("/")
        op = rng.choice(ops)
        expr = f"({expr}{op}{x})"
        value = {"+": value + x, "-": value - x, "*": value * x, "/": value // x if x else value}[
            op
        ]
    return value, expr


def generate_countdown(
    n: int, seed: int = 0, split: str = "train", num_count: int = 3, max_num: int = 20
) -> list[dict[str, Any]]:
    """Countdown rows: reach ``target`` using each of ``numbers`` once with + - * /.

    Targets are built from a random expression so every row is solvable; the reference
    expression is kept in ``extra_info.solution``.
    """
    rng = random.Random(_split_seed(seed, split) + 1)
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(1, max_num) for _ in range(num_count)]
        target, expr = _countdown_solve(numbers, rng)
        if target <= 0 or target > 1000:
            continue
        content = (
            f"Using the numbers {numbers}, create an equation that equals {target}. "
            "Use each number once with + - * /. Put the equation in <answer></answer>."
        )
        rows.append(
            {
                "data_source": "countdown",
                "prompt": [{"role": "user", "content": content}],
                "ability": "math",
                "reward_model": {
                    "style": "rule",
                    "ground_truth": {"target": target, "numbers": numbers},
                },
                "extra_info": {"split": split, "index": len(rows), "solution": expr},
            }
        )
    return rows


_GSM_ANSWER = re.compile(r"####\s*(.+)$", re.S)


def convert_gsm8k(
    input_path: str | Path, split: str = "train", data_source: str = "gsm8k"
) -> list[dict[str, Any]]:
    """Convert a local GSM8K (``question``/``answer`` with ``#### N``) or MATH-style
    (``problem``/``solution`` or ``answer``) jsonl/parquet file to verl rows."""
    src = read_rows(input_path)
    rows = []
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    for i, r in enumerate(src):
        q = r.get("question", r.get("problem"))
        a = r.get("answer", r.get("solution"))
        if not isinstance(q, str) or not q.strip():
            raise ValueError(
                f"{input_path}: row {i} has no non-empty 'question' (or 'problem') field"
            )
        if not isinstance(a, str):
            raise ValueError(f"{input_path}: row {i} has no string 'answer' (or 'solution') field")
        m = _GSM_ANSWER.search(a)
        gt = m.group(1).strip().replace(",", "") if m else a.strip()
        rows.append(
            {
                "data_source": data_source if m else "math",
                "prompt": [{"role": "user", "content": f"{q.strip()} {instruction}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {"split": split, "index": i, "answer": a},
            }
        )
    return rows


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read a parquet or jsonl file into a list of dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix in (".jsonl", ".json"):
        out = []
        for ln, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{ln}: invalid JSON ({e})") from e
        return out
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to parquet (parent dirs created). Dict-valued ground truths are kept as JSON
    structs by pyarrow; heterogeneous ``extra_info`` dicts are unified by pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([_no_empty_structs(r) for r in rows]), path)
    return path


def _no_empty_structs(value: Any) -> Any:
    # Parquet cannot store a struct with no fields: an empty dict is written as null.
    if isinstance(value, dict):
        return {k: _no_empty_structs(v) for k, v in value.items()} if value else None
    if isinstance(value, list):
        return [_no_empty_structs(v) for v in value]
    return value


def sft_rows_from_rl_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SFT rows (``messages`` with the reference answer) from RL rows that carry an answer."""
    out = []
    for r in rows:
        gt = r["reward_model"]["ground_truth"]
        answer = r.get("extra_info", {}).get("solution") if isinstance(gt, dict) else gt
        if isinstance(gt, dict):
            answer = f"<answer>{answer}</answer>"
        out.append({"messages": [*r["prompt"], {"role": "assistant", "content": str(answer)}]})
    return out


def preference_pairs(
    rows: list[dict[str, Any]], seed: int = 0, max_offset: int = 9
) -> list[dict[str, Any]]:
    """Preference pairs (``prompt``, ``chosen``, ``rejected``; the rows ``postrl rm`` trains on)
    from RL rows with a numeric ``reward_model.ground_truth`` (e.g. addition): ``chosen`` is the
    correct answer, ``rejected`` a wrong one (off by 1..``max_offset``, never negative)."""
    rng = random.Random(seed)
    out = []
    for i, r in enumerate(rows):
        gt = str(r["reward_model"]["ground_truth"])
        if not gt.lstrip("-").isdigit():
            raise ValueError(
                f"row {i}: ground_truth {gt!r} is not an integer; "
                "preference_pairs needs numeric answers"
            )
        wrong = int(gt) + rng.choice([-1, 1]) * rng.randint(1, max_offset)
        if wrong < 0:
            wrong = int(gt) + rng.randint(1, max_offset)
        out.append({"prompt": list(r["prompt"]), "chosen": gt, "rejected": str(wrong)})
    return out


def _lazy(target: str) -> Callable[..., list[dict[str, Any]]]:
    def gen(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        import importlib

        mod, _, attr = target.partition(":")
        return getattr(importlib.import_module(mod), attr)(n, seed=seed, split=split)

    gen.__doc__ = f"Generator loaded from {target}."
    return gen


#: task name -> generator(n, seed, split)
TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "addition": generate_addition,
    "countdown": generate_countdown,
    "tool-arith": _lazy("postrl.data.tool_arith:generate_tool_arith"),
    "code": _lazy("postrl.data.code_tasks:generate_code_tasks"),
}
