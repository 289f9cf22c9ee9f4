"""``qwen3_coder``: XML function/parameter calls (Qwen3-Coder, Qwen3.5 and later Qwen models).

Format (the Qwen3-Coder-30B-A3B-Instruct and Qwen3.5 chat templates; vLLM's ``qwen3_coder``
tool parser reads the same)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Zürich
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Rules:

* each ``<function=NAME>...</function>`` inside a ``<tool_call>`` block is one call (a bare
  ``<function=...>...</function>`` without the wrapper, which these models sometimes emit,
  counts too); several blocks per turn are fine;
* parameter values are raw text, not JSON: exactly one leading and one trailing newline (the
  template's markup) are removed, other whitespace is kept. Values are typed by the tool's JSON
  schema when the caller passes ``tools`` (a ``string`` parameter keeps ``"3"`` as text, an
  ``integer`` one gets ``3``); without a schema a value that is valid JSON is decoded, else it
  stays a string (:func:`~postrl.tools.parsers.base.coerce_value`);
* a missing ``</parameter>`` ends the value at the next ``<parameter=`` or ``</function>``;
* a block without ``<function=...>``, an empty name or an unterminated block is a
  :class:`~postrl.tools.parsers.base.ParseError`; blocks inside markdown code fences are
  content (counted in ``ignored_in_code``), as for ``hermes``.
"""

from __future__ import annotations

import re
from typing import Any

from postrl.tools.parsers.base import TOOL_PARSERS, BlockScanner, end_marker_block

__all__ = ["Qwen3CoderToolParser"]

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAM = re.compile(
    r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)


@TOOL_PARSERS.register("qwen3_coder")
class Qwen3CoderToolParser(BlockScanner):
    """Parser for Qwen3-Coder's XML calls (see the module docstring).

    Args:
        calls_in_code_blocks: count blocks inside markdown code fences as calls.
    """

    starts = ("<tool_call>", "<function=")
    expected = (
        "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    _ends = {"<tool_call>": "</tool_call>", "<function=": "</function>"}

    def __init__(self, calls_in_code_blocks: bool = False) -> None:
        self.fence = not calls_in_code_blocks

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """``<tool_call>`` blocks end after ``</tool_call>``, bare functions after
        ``</function>``."""
        return end_marker_block(text, body, self._ends[marker])

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """Every ``<function=...>`` of the block is one call."""
        if not complete:
            sink.error(raw, f"unterminated {marker}: missing {self._ends[marker]}")
            return
        functions = list(_FUNCTION.finditer(raw))
        if not functions:
            sink.error(raw, "tool call has no <function=NAME> element")
            return
        for f in functions:
            name = f.group(1).strip()
            if not name:
                sink.error(raw, "tool call has an empty function name")
                continue
            args = {}
            for p in _PARAM.finditer(f.group(2)):
                value = p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[p.group(1).strip()] = sink.value(name, p.group(1).strip(), value)
            sink.call(name, args)
