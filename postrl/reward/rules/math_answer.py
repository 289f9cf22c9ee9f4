"""``math`` (and MATH dataset aliases): competition-maths answers checked with ``math-verify``.

With ``math-verify`` installed (``pip install postrl[math]``): the ground truth is parsed as
LaTeX (wrapped in ``$...$`` unless it already carries math delimiters or ``\\boxed``), the
response is parsed with math-verify's default extraction (last ``\\boxed{}``, LaTeX or plain
expression), and :func:`math_verify.verify` decides equivalence (symbolic and numeric, sets,
intervals, ...). math-verify's own signal-based timeouts work only on a process's main thread;
off the main thread they are disabled, which is why this entry is registered ``inline=False`` —
the reward loop runs it in a killable worker process whose main thread calls it.

Without ``math-verify``: a WARNING is logged once and a plain fallback is used — the content of
the last ``\\boxed{...}`` (brace-balanced) is normalised (whitespace, ``\\left``/``\\right``,
``\\!``, ``$``, a trailing period, ``\\dfrac``/``\\tfrac`` -> ``\\frac``) and compared as a string
with the normalised ground truth. This misses equivalent forms (``0.5`` vs ``\\frac12``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["compute_score", "last_boxed", "normalize_answer"]

log = logging.getLogger(__name__)
_WARNED = False
_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalize_answer(ans: str) -> str:
    """Cheap LaTeX normalisation for the string-compare fallback."""
    s = ans.strip().strip("$").strip()
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
    ):
        s = s.replace(old, new)
    s = "".join(s.split())
    return s.rstrip(".")


def _fallback(solution_str: str, ground_truth: str) -> bool:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        log.warning(
            "math-verify is not installed: the 'math' reward falls back to comparing the last "
            "\\boxed{} answer as a normalised string, which misses equivalent forms. Install it "
            "with `pip install postrl[math]`."
        )
    pred = last_boxed(solution_str)
    gold = last_boxed(ground_truth) or ground_truth
    return pred is not None and normalize_answer(pred) == normalize_answer(gold)


def _verify(solution_str: str, ground_truth: str) -> bool:
    from math_verify import parse, verify

    on_main = threading.current_thread() is threading.main_thread()
    timeout = _TIMEOUT_S if on_main else None
    gold_text = ground_truth
    if not any(tok in gold_text for tok in ("$", "\\boxed", "\\(", "\\[")):
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    pred = parse(solution_str, parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """1.0 when the response's final answer is equivalent to ``ground_truth``, else 0.0."""
    truth = str(ground_truth)
    try:
        import math_verify  # noqa: F401
    except ImportError:
        ok = _fallback(solution_str, truth)
    else:
        ok = _verify(solution_str, truth)
    acc = float(ok)
    return {"score": acc, "acc": acc}
