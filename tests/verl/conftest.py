"""Fixtures: parquet files in the exact layout verl's ``examples/data_preprocess/gsm8k.py`` and
``math_dataset.py`` write (under ``$HOME/data/{gsm8k,math}/``). The launch commands are in
``verl_commands.py``."""

from __future__ import annotations

import pytest

from postrl.data import write_parquet

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def gsm8k_rows(n: int, split: str) -> list[dict]:
    """Rows with the columns and values verl's gsm8k preprocessing produces."""
    rows = []
    for i in range(n):
        a, b = i + 2, 3 * i + 1
        question = f"Tom has {a} apples and buys {b} more. How many now?"
        answer = f"He has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {
                    "style": "rule",
                    "ground_truth": answer.split("#### ")[1].replace(",", ""),
                },
                "extra_info": {"split": split, "index": i, "answer": answer, "question": question},
            }
        )
    return rows


def math_rows(n: int, split: str) -> list[dict]:
    """Rows as verl's math_dataset.py writes them (ground truth = the last boxed answer)."""
    rows = []
    for i in range(n):
        problem = f"Compute ${i} + \\frac{{1}}{{2}}$."
        rows.append(
            {
                "data_source": "DigitalLearningGmbH/MATH-lighteval",
                "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": f"{i}\\frac{{1}}{{2}}"},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


@pytest.fixture(scope="session")
def verl_home(tmp_path_factory):
    """A fake ``$HOME`` holding ``data/gsm8k/{train,test}.parquet`` and ``data/math/...``."""
    home = tmp_path_factory.mktemp("home")
    for name, make in (("gsm8k", gsm8k_rows), ("math", math_rows)):
        write_parquet(make(16, "train"), home / "data" / name / "train.parquet")
        write_parquet(make(4, "test"), home / "data" / name / "test.parquet")
    return home
