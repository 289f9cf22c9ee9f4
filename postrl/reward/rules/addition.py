"""``addition``: prompts "What is A+B?", ground truth the decimal string of the sum.

The answer is the LAST integer in the response. An integer is ``-?\\d+``; the minus sign counts
only when it is not preceded by a digit (so ``"123-456"`` yields ``456``, a binary minus, while
``"= -5"`` yields ``-5``). Thousands separators are accepted only in strict groups of three
(``"1,234"`` -> 1234; ``"1,23"`` -> two integers, 1 and 23). Score 1.0 if the integer equals the
ground truth, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["compute_score", "last_integer"]

_INT = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)")


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (see module docstring for the grammar), or None."""
    matches = _INT.findall(text)
    if not matches:
        return None
    return int(matches[-1].replace(",", ""))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """1.0 when the last integer of ``solution_str`` equals ``ground_truth``, else 0.0."""
    target = int(str(ground_truth).strip().replace(",", ""))
    acc = float(last_integer(solution_str) == target)
    return {"score": acc, "acc": acc}
