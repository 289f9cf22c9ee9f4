"""``countdown``: combine the given numbers with + - * / to reach a target (TinyZero's task).

Ground truth: ``{"target": int, "numbers": [int, ...]}``.

Extraction: the content of the LAST ``<answer>...</answer>`` when present, otherwise the last
line of the response that contains only digits, whitespace, ``+ - * / ( )`` and an optional
``= ...`` tail. A trailing ``= value`` is dropped (``"3*4+5 = 17"`` -> ``"3*4+5"``).

Safety: the expression is parsed with :mod:`ast` and walked by hand, never ``eval``-ed. Only
integer literals, binary ``+ - * /``, unary ``-``/``+`` and parentheses are accepted (no names,
calls, attributes, ``**``, ``//`` or ``%``), the text is capped at ``MAX_EXPR_CHARS`` characters
and every literal at ``MAX_LITERAL_DIGITS`` digits, so no input can make scoring slow. Arithmetic
is exact (:class:`fractions.Fraction`), then compared with ``|value - target| <= 1e-6``.

Score: 1.0 when the expression uses each given number exactly once (as a multiset) and equals the
target; ``format_score`` (default 0.0) when it parses but is wrong, uses the wrong numbers or
divides by zero; 0.0 when no expression is found or it does not parse. ``acc`` is 1.0 only when
correct.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

__all__ = ["compute_score", "extract_equation", "evaluate_equation", "MAX_EXPR_CHARS"]

MAX_EXPR_CHARS = 256
MAX_LITERAL_DIGITS = 12

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EXPR_LINE = re.compile(r"^[\d\s+\-*/().]+(?:=[\d\s.\-]*)?$")
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class _Rejected(ValueError):
    """The expression uses a construct outside the allowed grammar."""


def extract_equation(text: str) -> str | None:
    """The candidate equation in ``text`` (see module docstring), ``= tail`` removed, or None."""
    answers = _ANSWER.findall(text)
    if answers:
        candidate = answers[-1]
    else:
        candidate = None
        for line in reversed(text.strip().splitlines()):
            line = line.strip()
            if line and any(c.isdigit() for c in line) and _EXPR_LINE.match(line):
                candidate = line
                break
        if candidate is None:
            return None
    candidate = candidate.split("=", 1)[0].strip()
    return candidate or None


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if len(str(abs(node.value))) > MAX_LITERAL_DIGITS:
            raise _Rejected("literal too long")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _walk(node.left, used), _walk(node.right, used)
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    raise _Rejected(f"disallowed syntax {type(node).__name__}")


def evaluate_equation(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of ``expr`` and the integer literals it uses.

    Raises:
        ValueError: the text is too long, does not parse, or uses a disallowed construct.
        ZeroDivisionError: the expression divides by zero.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise _Rejected(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as e:
        raise _Rejected(f"does not parse: {e}") from e
    used: list[int] = []
    return _walk(tree, used), used


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    format_score: float = 0.0,
) -> dict[str, float]:
    """Score one countdown answer (see module docstring); ``format_score`` rewards form only."""
    target = ground_truth["target"]
    numbers = [int(n) for n in ground_truth["numbers"]]
    expr = extract_equation(solution_str)
    if expr is None:
        return {"score": 0.0, "acc": 0.0}
    try:
        value, used = evaluate_equation(expr)
    except _Rejected:
        return {"score": 0.0, "acc": 0.0}
    except ZeroDivisionError:
        return {"score": float(format_score), "acc": 0.0}
    correct = Counter(used) == Counter(numbers) and abs(value - Fraction(target)) <= Fraction(
        1, 10**6
    )
    if correct:
        return {"score": 1.0, "acc": 1.0}
    return {"score": float(format_score), "acc": 0.0}
