"""``glm45``: GLM-4.5 / 4.6 (and the compact 4.7+) ``<arg_key>``/``<arg_value>`` calls.

Format (the zai-org GLM-4.5 chat template; vLLM's ``glm45`` tool parser reads the same)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 and later write the same without newlines
(``<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>``);
both parse.

Rules:

* each ``<tool_call>...</tool_call>`` block is one call; the function name is the text before
  the first newline or ``<arg_key>``;
* keys are stripped; values are kept verbatim (the template writes strings raw and everything
  else as JSON) and typed by the tool's JSON schema when ``tools`` are passed, else JSON-decoded
  when valid JSON (:func:`~postrl.tools.parsers.base.coerce_value`);
* a block with no name, text left over that is not a key/value pair, or no ``</tool_call>`` is
  a :class:`~postrl.tools.parsers.base.ParseError`; blocks inside markdown code fences are
  content (counted in ``ignored_in_code``).
"""

from __future__ import annotations

import re
from typing import Any

from postrl.tools.parsers.base import TOOL_PARSERS, BlockScanner, end_marker_block

__all__ = ["GLM45ToolParser"]

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END = re.compile(r"\n|<arg_key>")


@TOOL_PARSERS.register("glm45")
class GLM45ToolParser(BlockScanner):
    """Parser for GLM-4.5's ``<arg_key>``/``<arg_value>`` calls (see the module docstring).

    Args:
        calls_in_code_blocks: count blocks inside markdown code fences as calls.
    """

    starts = ("<tool_call>",)
    end_tag = "</tool_call>"
    expected = "<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"

    def __init__(self, calls_in_code_blocks: bool = False) -> None:
        self.fence = not calls_in_code_blocks

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """The block ends after ``</tool_call>``."""
        return end_marker_block(text, body, self.end_tag)

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """Name, then key/value pairs."""
        if not complete:
            sink.error(raw, f"unterminated <tool_call>: missing {self.end_tag}")
            return
        body = body[: -len(self.end_tag)]
        m = _NAME_END.search(body)
        cut = m.start() if m else len(body)
        name = body[:cut].strip()
        if not name:
            sink.error(raw, "tool call has no function name after <tool_call>")
            return
        rest = body[cut:]
        args = {}
        for p in _PAIR.finditer(rest):
            key = p.group(1).strip()
            args[key] = sink.value(name, key, p.group(2))
        leftover = _PAIR.sub("", rest).strip()
        if leftover:
            sink.error(raw, f"unexpected text in the call of {name!r}: {leftover[:80]!r}")
            return
        sink.call(name, args)
