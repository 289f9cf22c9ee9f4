"""``kimi_k2``: Kimi K2's section tokens with ``functions.NAME:IDX`` call ids.

Format (the moonshotai Kimi-K2-Instruct chat template and its ``docs/tool_call_guidance.md``;
vLLM's ``kimi_k2`` tool parser reads the same; one line)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}
    <|tool_call_end|>
    <|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|>
    <|tool_calls_section_end|>

Rules:

* each ``<|tool_call_begin|>...<|tool_call_end|>`` is one call; the function name is the call
  id ``functions.NAME:IDX`` without the ``functions.`` prefix and the ``:IDX`` counter (an id
  without them is taken as the name); the arguments are the JSON object after
  ``<|tool_call_argument_begin|>``;
* the call id is kept (``ParseResult.call_ids``): the chat template writes the ids of earlier
  calls back into the prompt, and Kimi expects its own ``functions.NAME:IDX`` there;
* the section markers (and the singular ``<|tool_call_section_begin|>`` spelling some
  checkpoints emit) are removed from the content;
* a call without ``<|tool_call_argument_begin|>``, with invalid JSON or without
  ``<|tool_call_end|>`` is a :class:`~postrl.tools.parsers.base.ParseError`.

The markers are special tokens: the OpenAI server decodes with special tokens kept
(``needs_special_tokens``).
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

__all__ = ["KimiK2ToolParser"]

_ARGS = "<|tool_call_argument_begin|>"
_END = "<|tool_call_end|>"
_IDX = re.compile(r":\d+\s*$")


@TOOL_PARSERS.register("kimi_k2")
class KimiK2ToolParser(BlockScanner):
    """Parser for Kimi K2's tool-call tokens (see the module docstring)."""

    starts = ("<|tool_call_begin|>",)
    drops = (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_section_begin|>",
        "<|tool_call_section_end|>",
    )
    needs_special_tokens = True
    expected = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0"
        "<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>"
    )

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """The call ends after ``<|tool_call_end|>``."""
        return end_marker_block(text, body, _END)

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """``functions.NAME:IDX<|tool_call_argument_begin|>{json}``."""
        if not complete:
            sink.error(raw, f"unterminated <|tool_call_begin|>: missing {_END}")
            return
        head, sep, args = body[: -len(_END)].partition(_ARGS)
        if not sep:
            sink.error(raw, f"tool call has no {_ARGS}")
            return
        call_id = head.strip()
        name = _IDX.sub("", call_id).removeprefix("functions.")
        json_args_call(name, args, raw, sink, call_id or None)
