"""``deepseek_v3`` / ``deepseek_v31``: DeepSeek's full-width tool-call tokens.

Formats (the chat templates in DeepSeek-V3 / R1-0528 and DeepSeek-V3.1 ``tokenizer_config.json``;
vLLM's ``deepseek_v3`` and ``deepseek_v31`` tool parsers read the same). The bars are U+FF5C
``｜`` and the spaces U+2581 ``▁``, not ASCII. V3 / R1 — a type word, the name, the arguments
in a ``json`` code fence, calls separated by a newline::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Beijing"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 — the name, then the bare JSON arguments, calls chained without separator (one line)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Beijing"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

Both names accept both forms (after ``<｜tool▁sep｜>``: JSON = V3.1, else V3), so a checkpoint
that mixes them still parses. The section markers are removed from the content; a call without
``<｜tool▁sep｜>``, with invalid JSON or without ``<｜tool▁call▁end｜>`` is a
:class:`~postrl.tools.parsers.base.ParseError`. V3.2's DSML format is not covered.
"""

from __future__ import annotations

import re
from typing import Any

from postrl.tools.parsers.base import (
    TOOL_PARSERS,
    BlockScanner,
    end_marker_block,
    json_args_call,
)

__all__ = ["DeepSeekV3ToolParser"]

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"

_FENCED = re.compile(r"^([^\n]*)\n\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


@TOOL_PARSERS.register("deepseek_v31")
@TOOL_PARSERS.register("deepseek_v3")
class DeepSeekV3ToolParser(BlockScanner):
    """Parser for DeepSeek V3 / R1 and V3.1 tool calls (see the module docstring)."""

    starts = (CALL_BEGIN,)
    drops = (CALLS_BEGIN, CALLS_END)
    needs_special_tokens = True
    expected = (
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}NAME\n```json\n{{...}}\n```{CALL_END}{CALLS_END}"
    )

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """The call ends after ``<｜tool▁call▁end｜>``."""
        return end_marker_block(text, body, CALL_END)

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """V3 ``function<sep>NAME\\n```json ...```  `` or V3.1 ``NAME<sep>{json}``."""
        if not complete:
            sink.error(raw, f"unterminated tool call: missing {CALL_END}")
            return
        left, sep, right = body[: -len(CALL_END)].partition(SEP)
        if not sep:
            sink.error(raw, f"tool call has no {SEP}")
            return
        if right.lstrip().startswith("{") or not right.strip():
            json_args_call(left, right, raw, sink)  # V3.1
            return
        m = _FENCED.match(right.strip("\n"))
        if m is None:
            sink.error(raw, "V3 tool call must be NAME, a newline and a ```json fenced object")
            return
        json_args_call(m.group(1), m.group(2), raw, sink)
