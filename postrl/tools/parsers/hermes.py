"""``hermes``: JSON calls in ``<tool_call>`` tags (Qwen2.5, Qwen3 up to 2507, Hermes-2/3-Pro).

Format (Qwen2.5/Qwen3 chat templates; NousResearch Hermes-2-Pro function-calling prompt)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

Rules:

* every ``<tool_call>...</tool_call>`` block is one call, in order; several per turn are fine;
* the body must be a JSON object with a string ``name`` and an object ``arguments`` (a JSON
  *string* holding an object is accepted too, as some models emit it; ``parameters`` is accepted
  as an alias). Anything else — invalid JSON, missing name, an unterminated ``<tool_call>`` at
  the end of a truncated generation — becomes a :class:`ParseError` entry, and the agent loop
  answers it with an error observation;
* **blocks inside markdown code fences (```) do not count** by default: a model that quotes or
  explains the format must not trigger execution, and Hermes-style chat templates never put
  real calls inside fences. They are counted in ``ParseResult.ignored_in_code``. Pass
  ``calls_in_code_blocks=True`` to count them. A fence opens at a ``````` in the content (not
  inside a call) and closes at the next one.
"""

from __future__ import annotations

from typing import Any

from postrl.tools.parsers.base import (
    TOOL_PARSERS,
    BlockScanner,
    end_marker_block,
    json_object_call,
)

__all__ = ["HermesToolParser"]


@TOOL_PARSERS.register("hermes")
class HermesToolParser(BlockScanner):
    """Parser for ``<tool_call>{json}</tool_call>`` blocks (see the module docstring).

    Args:
        calls_in_code_blocks: count blocks inside markdown code fences as calls.
    """

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    starts = (start_tag,)

    def __init__(self, calls_in_code_blocks: bool = False) -> None:
        self.calls_in_code_blocks = calls_in_code_blocks
        self.fence = not calls_in_code_blocks

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """The block ends after ``</tool_call>``."""
        return end_marker_block(text, body, self.end_tag)

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """One JSON call (or the reason it is not one)."""
        if not complete:
            sink.error(raw, f"unterminated {self.start_tag}: missing {self.end_tag}")
            return
        json_object_call(body[: -len(self.end_tag)], raw, sink)
