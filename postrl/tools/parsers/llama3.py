"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calls.

Format (Meta's ``llama3_1/prompt_format.md`` "JSON based tool calling" and the Llama-3.1-8B-
Instruct chat template; vLLM's ``llama3_json`` tool parser reads the same)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}};
    {"name": "get_time", "parameters": {}}<|eom_id|>

Rules:

* after ``<|python_tag|>`` (anywhere in the reply): JSON objects separated by ``;``, each a call
  with ``name`` and ``parameters`` (``arguments`` accepted too; an extra ``"type": "function"``
  key is ignored);
* without the tag, a reply that *starts* (after whitespace) with a JSON object having a
  ``name`` key is a call, several separated by ``;`` as above; a reply starting with any
  other JSON (a JSON answer) is content;
* invalid JSON after the tag, a call object cut off by the end of the text, or text after
  ``<|python_tag|>`` that is not JSON (Llama's built-in python-syntax tools,
  ``brave_search.call(...)``, are not supported) is a
  :class:`~postrl.tools.parsers.base.ParseError`. Text after the calls (``<|eot_id|>``) is
  content. ``<|python_tag|>`` is a special token: the server decodes with special tokens kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from postrl.tools.parsers.base import (
    TOOL_PARSERS,
    BlockScanner,
    add_object_call,
    json_value_end,
)

__all__ = ["Llama3JsonToolParser"]

TAG = "<|python_tag|>"
_LOOKS_LIKE_CALL = re.compile(r'\{\s*"name"\s*:')
_DECODER = json.JSONDecoder()
_KEYS = ("parameters", "arguments")


@dataclass
class _State:
    in_fence: bool = False
    at_start: bool = True
    memo: dict = field(default_factory=dict)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _objects_end(text: str, i: int, memo: dict | None = None) -> int | None:
    """End of ``{...}; {...}`` starting at ``text[i] == "{"``; None while undecided."""
    while True:
        e = json_value_end(text, i, memo)
        if e is None:
            return None
        k = _skip_ws(text, e)
        if k == len(text):
            return None  # a ';' and another call may follow
        if text[k] != ";":
            return e
        k2 = _skip_ws(text, k + 1)
        if k2 == len(text):
            return None
        if text[k2] != "{":
            return k + 1
        i = k2


def _decode_objects(body: str) -> tuple[list[object], str]:
    """JSON values separated by ``;`` from the start of ``body``; and the undecodable rest."""
    objs: list[object] = []
    i = _skip_ws(body, 0)
    while i < len(body):
        try:
            obj, i = _DECODER.raw_decode(body, i)
        except json.JSONDecodeError:
            break
        objs.append(obj)
        i = _skip_ws(body, i)
        if i < len(body) and body[i] == ";":
            i = _skip_ws(body, i + 1)
        else:
            break
    return objs, body[i:]


@TOOL_PARSERS.register("llama3_json")
class Llama3JsonToolParser(BlockScanner):
    """Parser for Llama 3.x JSON tool calls (see the module docstring)."""

    starts = (TAG,)
    needs_special_tokens = True
    expected = '<|python_tag|>{"name": ..., "parameters": {...}}'

    def new_state(self) -> _State:
        """Fresh state: a bare JSON call is only recognised at the start of the reply."""
        return _State()

    def step(self, text, pos, final, state, sink) -> int:
        """A bare JSON call at the start, else content and ``<|python_tag|>`` blocks."""
        if state.at_start:
            i = _skip_ws(text, pos)
            if i == len(text) and not final:
                return pos
            if i < len(text) and text[i] == "{":
                return self._bare(text, pos, i, final, state, sink)
            state.at_start = False
        return super().step(text, pos, final, state, sink)

    def _bare(self, text, pos, i, final, state, sink) -> int:
        end = _objects_end(text, i, state.memo)
        if end is None and not final:
            return pos
        end = len(text) if end is None else end
        objs, rest = _decode_objects(text[i:end])
        state.at_start = False
        first = objs[0] if objs else None
        if not (isinstance(first, dict) and "name" in first):
            if first is None and _LOOKS_LIKE_CALL.match(text, i):
                sink.error(text[i:end], "tool call is not valid JSON (cut off?)")
            else:
                sink.content(text[pos:end])
            return end
        sink.content(text[pos:i])
        self._calls(objs, rest, text[i:end], sink)
        return end

    @staticmethod
    def _calls(objs, rest: str, raw: str, sink) -> None:
        for obj in objs:
            add_object_call(obj, raw, sink, _KEYS)
        if rest.strip().rstrip(";").strip():
            sink.error(raw, f"text after the tool calls is not a JSON call: {rest[:80]!r}")

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """After the last ``;``-separated JSON object (non-JSON: up to the next special
        token)."""
        i = _skip_ws(text, body)
        if i == len(text):
            return None
        if text[i] != "{":
            j = text.find("<|", i)
            return None if j < 0 else j
        return _objects_end(text, i, state.memo if state is not None else None)

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """The JSON objects after the tag (a reply ending right after them is complete)."""
        if not body.lstrip().startswith("{"):
            sink.error(raw, "expected a JSON call after <|python_tag|>")
            return
        objs, rest = _decode_objects(body)
        if not objs:
            sink.error(raw, "tool call is not valid JSON")
            return
        self._calls(objs, rest, raw, sink)
