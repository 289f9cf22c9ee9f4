"""``calculator``: exact arithmetic over an AST whitelist (no ``eval``).

Allowed: integer/float literals, ``+ - * / // % **``, unary ``+``/``-``, parentheses. Integer
arithmetic is exact at any size (Python ints), so 9-digit products come back exactly; ``/``
returns an exact integer when the division is exact and a float otherwise. Names, calls,
attributes, subscripts, comparisons and anything else are rejected with a message. Resource
bounds: the expression length, the exponent of ``**`` and the size of every intermediate result
(in digits) are capped, so ``9**9**9`` is refused instead of hanging the trainer.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from postrl.tools.base import BaseTool, ToolResponse

__all__ = ["CalculatorError", "CalculatorTool", "safe_eval"]

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


def _digits(x: int | float) -> float:
    return math.log10(abs(x)) + 1 if isinstance(x, int) and x else 1.0


def safe_eval(
    expression: str, *, max_length: int = 1000, max_exponent: int = 10_000, max_digits: int = 10_000
) -> int | float:
    """Evaluate an arithmetic expression without ``eval``.

    Raises:
        CalculatorError: disallowed syntax, division by zero, or a bound exceeded.
    """
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not a valid expression: {e.msg}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > max_exponent:
                    raise CalculatorError(f"exponent {right} exceeds the bound {max_exponent}")
                if (
                    isinstance(left, int)
                    and isinstance(right, int)
                    and right > 0
                    and _digits(left) * right > max_digits + right
                ):
                    raise CalculatorError(f"result would exceed {max_digits} digits")
            if isinstance(node.op, ast.Mult) and _digits(left) + _digits(right) > max_digits + 1:
                raise CalculatorError(f"result would exceed {max_digits} digits")
            if (
                isinstance(node.op, ast.Div)
                and isinstance(left, int)
                and isinstance(right, int)
                and right
                and left % right == 0
            ):
                return left // right
            try:
                out = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result too large for a float") from None
            if isinstance(out, complex):
                raise CalculatorError("complex result (negative base with fractional exponent)")
            return out
        raise CalculatorError(
            f"{type(node).__name__} is not allowed; use numbers, + - * / // "
            "% ** and parentheses only"
        )

    return ev(tree)


class CalculatorTool(BaseTool):
    """Exact arithmetic tool. Config: ``max_exponent``, ``max_digits``, ``max_length``."""

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """``calculator(expression: str)``."""
        return {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression exactly. "
                "Supports + - * / // % ** and parentheses on integers and decimals.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "e.g. '123456789 * 987654321'",
                        }
                    },
                    "required": ["expression"],
                },
            },
        }

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        """Evaluate ``parameters['expression']``; errors come back as text, not exceptions."""
        expr = parameters.get("expression")
        if not isinstance(expr, str):
            return ToolResponse(
                "Error: 'expression' must be a string",
                metrics={"tool/errors/bad_arguments": 1.0},
                error="bad_arguments",
            )
        kw = {
            k: int(self.config[k])
            for k in ("max_exponent", "max_digits", "max_length")
            if k in self.config
        }
        try:
            return ToolResponse(str(safe_eval(expr, **kw)))
        except CalculatorError as e:
            return ToolResponse(
                f"Error: {e}", metrics={"tool/calculator/errors": 1.0}, error="bad_expression"
            )
