"""``gsm8k`` / ``openai/gsm8k``: grade-school maths word problems.

The prediction is the number after the last ``####`` marker when present, otherwise the last
number in the response. Numbers may carry ``$``, thousands commas and a decimal part
(``"$1,234.50"`` -> 1234.5); a trailing period is punctuation. The ground truth is either the
bare answer (verl's preprocessed column, e.g. ``"72"``) or a full GSM8K solution ending in
``#### 72``. Comparison is numeric with tolerance ``1e-6 * max(1, |truth|)``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["compute_score", "extract_answer"]

_NUM = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?")
_MARKER = "####"


def _to_float(token: str) -> float | None:
    cleaned = token.replace("$", "").replace(",", "").replace(" ", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def _last_number(text: str) -> float | None:
    found = None
    for m in _NUM.finditer(text):
        value = _to_float(m.group(0))
        if value is not None:
            found = value
    return found


def extract_answer(text: str) -> float | None:
    """Number after the last ``####`` (if any), else the last number in ``text``, or None."""
    if _MARKER in text:
        tail = text.rsplit(_MARKER, 1)[1]
        m = _NUM.search(tail)
        if m is not None:
            return _to_float(m.group(0))
        return None
    return _last_number(text)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """1.0 when the extracted number equals the ground truth numerically, else 0.0."""
    truth = extract_answer(str(ground_truth))
    if truth is None:
        raise ValueError(f"gsm8k ground_truth {ground_truth!r} holds no number")
    pred = extract_answer(solution_str)
    ok = pred is not None and abs(pred - truth) <= 1e-6 * max(1.0, abs(truth))
    acc = float(ok)
    return {"score": acc, "acc": acc}
