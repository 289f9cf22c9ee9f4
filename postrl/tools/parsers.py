"""Tool-call parsers: decoded assistant text -> tool calls + parse errors (never an exception).

Registry ``TOOL_PARSERS`` maps a format name to a parser class with
``parse(text) -> ParseResult``. Shipped: ``hermes`` (Qwen2.5/Qwen3, Hermes-2-Pro, ...)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

Rules of the ``hermes`` parser:

* every ``<tool_call>...</tool_call>`` block is one call, in order; several per turn are fine;
* the body must be a JSON object with a string ``name`` and an object ``arguments`` (a JSON
  *string* holding an object is accepted too, as some models emit it; ``parameters`` is accepted
  as an alias). Anything else — invalid JSON, missing name, an unterminated ``<tool_call>`` at
  the end of a truncated generation — becomes a :class:`ParseError` entry, and the agent loop
  answers it with an error observation;
* **blocks inside markdown code fences (```) do not count** by default: a model that quotes or
  explains the format must not trigger execution, and Hermes-style chat templates never put
  real calls inside fences. They are counted in ``ParseResult.ignored_in_code``. Pass
  ``calls_in_code_blocks=True`` to count them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from postrl.registry import Registry

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "ParseError",
    "ParseResult",
    "ToolCall",
    "get_tool_parser",
]

#: format name -> parser class (constructed with keyword options).
TOOL_PARSERS: Registry[type] = Registry("tool-call parser")


class ToolCall(NamedTuple):
    """One parsed call; unpacks as ``name, arguments``."""

    name: str
    arguments: dict[str, Any]


class ParseError(NamedTuple):
    """A block that looked like a call but could not be parsed."""

    raw: str
    message: str

    def __str__(self) -> str:
        """The error observation shown to the model."""
        return (
            f'Error: {self.message}. Call tools as <tool_call>{{"name": ..., '
            f'"arguments": {{...}}}}</tool_call>'
        )


@dataclass
class ParseResult:
    """Output of a parser: calls in order, errors, the text with call blocks removed."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""
    ignored_in_code: int = 0

    @property
    def has_calls(self) -> bool:
        """True when there is at least one call or one malformed call to answer."""
        return bool(self.calls or self.errors)


_FENCE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)


@TOOL_PARSERS.register("hermes")
class HermesToolParser:
    """Parser for ``<tool_call>{json}</tool_call>`` blocks (see module docstring)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, calls_in_code_blocks: bool = False) -> None:
        self.calls_in_code_blocks = calls_in_code_blocks
        self._block = re.compile(
            re.escape(self.start_tag) + r"(.*?)(?:" + re.escape(self.end_tag) + r"|\Z)", re.DOTALL
        )

    def parse(self, text: str) -> ParseResult:
        """Extract calls and errors from ``text``."""
        result = ParseResult()
        fenced = [] if self.calls_in_code_blocks else [m.span() for m in _FENCE.finditer(text)]
        kept: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            if any(a <= m.start() < b for a, b in fenced):
                result.ignored_in_code += 1
                continue
            kept.append(text[pos : m.start()])
            pos = m.end()
            raw = m.group(0)
            if not raw.endswith(self.end_tag):
                result.errors.append(
                    ParseError(raw, f"unterminated {self.start_tag}: missing {self.end_tag}")
                )
                continue
            call = self._parse_body(m.group(1), raw, result.errors)
            if call is not None:
                result.calls.append(call)
        kept.append(text[pos:])
        result.content = "".join(kept).strip()
        return result

    @staticmethod
    def _parse_body(body: str, raw: str, errors: list[ParseError]) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(ParseError(raw, f"tool call is not valid JSON: {e}"))
            return None
        if not isinstance(obj, dict):
            errors.append(
                ParseError(raw, "tool call must be a JSON object with 'name' and 'arguments'")
            )
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            errors.append(ParseError(raw, "tool call has no string 'name'"))
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                errors.append(ParseError(raw, f"'arguments' string is not valid JSON: {e}"))
                return None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            errors.append(
                ParseError(raw, f"'arguments' must be a JSON object, got {type(args).__name__}")
            )
            return None
        return ToolCall(name, args)


def get_tool_parser(name: str, **options: Any) -> Any:
    """Instantiate the parser registered as ``name`` (unknown names list the choices)."""
    return TOOL_PARSERS.get(name)(**options)
