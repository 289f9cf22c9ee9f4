"""``math_dapo`` / ``math_dapo_reasoning`` / ``aime*`` as verl scores them
(``verl.utils.reward_score.math_dapo``): Minerva-style ``Answer:`` lines, +1 / -1 rewards.

Only the last 300 characters of the response are read. The answer is the text after the LAST
``Answer:`` (any case, spaces allowed around the colon) up to the end of its line; it and the
ground truth are normalised as in Lewkowycz et al. 2022 ("Solving Quantitative Reasoning
Problems with Language Models", appendix D: keep what follows the last ``=``, drop units and
filler words, ``\\text{..}``/``\\textbf{..}``/``\\overline{..}``/``\\boxed{..}`` wrappers, ``$``
and spaces, expand ``\\fracab``/``\\sqrta`` shorthands, remove thousands commas from integers)
and compared as strings. Without an ``Answer:`` line, the last ``\\boxed{...}`` in the final 100
characters is compared with the ground truth verbatim. Score ``1.0`` when correct, ``-1.0``
otherwise (also when no answer is found); ``acc`` is 1.0/0.0 and ``pred`` the extracted answer.
"""

from __future__ import annotations

import re
from typing import Any

from postrl.reward.rules.hendrycks_math import closing_brace

__all__ = ["compute_score", "normalize_final_answer"]

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_INVALID = "[INVALID]"
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip


def normalize_final_answer(answer: str) -> str:
    """Minerva's answer normalisation (see the module docstring)."""
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for wrapper in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + wrapper + r"\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _last_boxed(text: str) -> str | None:
    idx = text.rfind("\\boxed{")
    if idx < 0:
        return None
    j = closing_brace(text, idx)
    return None if j is None else text[idx + len("\\boxed{") : j]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    strict_box_verify: bool = False,
) -> dict[str, Any]:
    """+1.0 for a correct final answer, -1.0 otherwise (see the module docstring)."""
    text = solution_str[-300:]
    gt = str(ground_truth)
    correct, pred = False, None
    if not strict_box_verify:
        found = _ANSWER.findall(text)
        pred = normalize_final_answer(found[-1] if found else _INVALID)
        correct = pred == normalize_final_answer(gt)
    if strict_box_verify or pred == _INVALID:
        boxed = _last_boxed(text[-100:])
        if boxed is not None:
            pred, correct = boxed, boxed == gt
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
