"""MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``)
as verl scores it by default (``verl.utils.reward_score.math_reward``): Hendrycks et al.'s
string normalisation of the last ``\\boxed{}`` answer.

verl's ``examples/data_preprocess/math_dataset.py`` writes the ground truth as the content of
the solution's last ``\\boxed{...}``. The response's answer is its last ``\\boxed{...}`` (brace
balanced) or ``\\boxed X`` (up to the next ``$``); ``\\fbox{}`` is found but never matches (as in
verl). Both strings are normalised (Hendrycks et al. 2021, "Measuring Mathematical Problem
Solving With the MATH Dataset", the evaluation script's ``strip_string``): newlines, ``\\!``,
``\\left``/``\\right``, degrees, ``\\$``, a trailing ``\\text{ unit}``, ``\\%`` and spaces are
removed; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``.5`` -> ``0.5``; a short ``k = `` prefix is
dropped; ``\\sqrt2`` -> ``\\sqrt{2}``, ``\\frac12`` -> ``\\frac{1}{2}``; ``0.5`` and an integer
``a/b`` become ``\\frac{..}{..}``. Equal normalised strings score 1.0, else 0.0. When a step
cannot apply (two ``\\text{ `` units, a dangling ``\\sqrt``/``\\frac``), the raw strings are
compared instead, as the original does. ``acc`` equals the score.

For symbolic equivalence (``0.5`` vs ``1/2`` in any form) use data_source ``math``
(math-verify, :mod:`postrl.reward.rules.math_answer`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["compute_score", "last_boxed_answer", "normalize", "is_equiv"]


class _CannotNormalize(ValueError):
    """A normalisation step does not apply; compare the raw strings."""


def last_boxed_answer(text: str) -> str | None:
    """The answer inside the last ``\\boxed{...}`` / ``\\boxed X``; None if none (or fbox)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    idx = text.rfind("\\boxed")
    is_fbox = idx < 0
    if is_fbox:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    j = closing_brace(text, idx)
    if j is None:
        return None
    whole = text[idx : j + 1]
    if is_fbox or not whole.startswith("\\boxed{"):
        return None  # verl's remove_boxed rejects these
    return whole[len("\\boxed{") : -1]


def closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the first ``{`` at or after ``start`` (None: unbalanced)."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _fix_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    out = parts[0]
    for p in parts[1:]:
        if not p:
            raise _CannotNormalize("dangling \\sqrt")
        out += "\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:])
    return out


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        if not p:
            raise _CannotNormalize("dangling \\frac")
        out += "\\frac"
        if p[0] == "{":
            out += p
        elif len(p) < 2:
            return s  # the original gives up on the whole string here
        elif p[1] != "{":
            out += "{" + p[0] + "}{" + p[1] + "}" + p[2:]
        else:
            out += "{" + p[0] + "}" + p[1:]
    return out


def _fix_slash(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalize(s: str) -> str:
    """Hendrycks' ``strip_string`` (see the module docstring).

    Raises:
        _CannotNormalize: a step does not apply (the caller compares raw strings).
    """
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:
        units = s.split("\\text{ ")
        if len(units) != 2:
            raise _CannotNormalize("more than one \\text{ unit")
        s = units[0]
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    """Normalised equality (raw equality when normalisation does not apply)."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalize(a) == normalize(b)
    except _CannotNormalize:
        return a == b


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """1.0 when the last boxed answer equals ``ground_truth`` after normalisation, else 0.0."""
    answer = last_boxed_answer(solution_str)
    ok = answer is not None and is_equiv(answer, str(ground_truth))
    return {"score": float(ok), "acc": float(ok)}
