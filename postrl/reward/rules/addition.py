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

__all__ = ["compute_score", "digit_agreement", "last_integer"]

_INT = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)")


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (see module docstring for the grammar), or None."""
    matches = _INT.findall(text)
    if not matches:
        return None
    return int(matches[-1].replace(",", ""))


def digit_agreement(answer: int | None, target: int) -> float:
    """Share of digit positions, aligned from the units, where ``answer`` has ``target``'s digit,
    over the longer of the two (so extra or missing digits count as wrong); 0.0 for no answer
    or a sign mismatch."""
    if answer is None or (answer < 0) != (target < 0):
        return 0.0
    a, t = str(abs(answer))[::-1], str(abs(target))[::-1]
    return sum(x == y for x, y in zip(a, t)) / max(len(a), len(t))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    partial_credit: float = 0.0,
) -> dict[str, float]:
    """1.0 when the last integer of ``solution_str`` equals ``ground_truth``; otherwise
    ``partial_credit × digit_agreement`` (0.0 by default: exact match only). ``acc`` is always
    the exact match. Pass it as ``reward.reward_kwargs.partial_credit`` (e.g. 0.5): a dense
    reward under which more GRPO groups differ (the digits right), for hard sums."""
    if not 0.0 <= partial_credit < 1.0:
        raise ValueError(f"addition reward: partial_credit={partial_credit} must be in [0, 1)")
    target = int(str(ground_truth).strip().replace(",", ""))
    answer = last_integer(solution_str)
    acc = float(answer == target)
    score = acc if acc or not partial_credit else partial_credit * digit_agreement(answer, target)
    return {"score": score, "acc": acc}
