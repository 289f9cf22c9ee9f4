"""``openai/gsm8k`` exactly as verl scores it (``verl.utils.reward_score.gsm8k``, strict mode).

verl's ``examples/data_preprocess/gsm8k.py`` writes the ground truth as the text after
``#### `` with commas removed, and asks the model to "output the final answer after ####".
The rule: look at the last 300 characters of the response only; the answer is the LAST
``#### <number>`` there (``####``, ONE space, then ``-?[0-9.,]+``), commas and ``$`` removed;
it must equal the ground truth *as a string* (``"72"`` matches ``"72"`` but not ``"72.0"``).
Score ``1.0`` when equal, ``format_score`` (default 0.0) when an answer was found but differs,
``0.0`` when there is none. ``acc`` is 1.0 only when correct.

postrl's own ``gsm8k`` entry (:mod:`postrl.reward.rules.gsm8k`) is the lenient variant: the
last number wins when there is no marker and comparison is numeric.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["compute_score", "extract_strict"]

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")


def extract_strict(text: str) -> str | None:
    """The last ``#### N`` answer within the final ``CLIP_CHARS`` characters, or None."""
    found = _STRICT.findall(text[-CLIP_CHARS:])
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """verl's strict GSM8K score (see the module docstring)."""
    answer = extract_strict(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    if answer == str(ground_truth):
        return {"score": float(score), "acc": 1.0}
    return {"score": float(format_score), "acc": 0.0}
