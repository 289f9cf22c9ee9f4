"""``mistral``: ``[TOOL_CALLS]`` calls of Mistral models, old (JSON array) and new (name + args).

Formats (mistral-common's tokenizers; vLLM's ``mistral`` tool parser reads the same):

* tokenizer v3 / v7 (Mistral-7B-Instruct-v0.3, Mixtral, Nemo): one JSON array of calls::

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]

* tokenizer v11 (Mistral-Small-3.2): ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{json}`` per call;
* tokenizer v13+ (Magistral, Ministral-3, Devstral-2): ``[TOOL_CALLS]NAME[ARGS]{json}`` per
  call, several calls chained without separator.

Rules: text before the first ``[TOOL_CALLS]`` (and after the calls) is content; each JSON array
element / each ``NAME[ARGS]{...}`` is one call, the arguments a JSON object; a form where
``[ARGS]`` was dropped by the decoder (``NAME{json}``) is accepted too. A ``[TOOL_CALLS]``
followed by anything else, invalid JSON, or JSON cut off by the end of the text is a
:class:`~postrl.tools.parsers.base.ParseError`. ``[TOOL_CALLS]`` is a control token: the server
decodes with special tokens kept (``needs_special_tokens``). The ids the model wrote (``"id"``,
``[CALL_ID]``) are kept in ``ParseResult.call_ids``; ``new_call_id()`` makes the 9-character
ids Mistral's templates require for calls written without one.
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from postrl.tools.parsers.base import (
    TOOL_PARSERS,
    BlockScanner,
    add_object_call,
    json_args_call,
    json_value_end,
)

__all__ = ["MistralToolParser"]

BOT = "[TOOL_CALLS]"
_NAME_FORM = re.compile(
    r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([^\s\[\]{}]*)\s*)?(?:\[ARGS\])?\s*(?=\{)"
)


@TOOL_PARSERS.register("mistral")
class MistralToolParser(BlockScanner):
    """Parser for Mistral's ``[TOOL_CALLS]`` (see the module docstring)."""

    starts = (BOT,)
    needs_special_tokens = True
    expected = '[TOOL_CALLS]NAME[ARGS]{"key": "value"}'

    @staticmethod
    def new_call_id() -> str:
        """An id for a call the model wrote without one: Mistral's chat templates accept only
        9 alphanumeric characters."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """After the JSON array (v3) or the JSON object following ``NAME[ARGS]`` (v11+)."""
        i = body
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return None
        if (
            text[i] == "["
            and not text.startswith("[CALL_ID]", i)
            and not text.startswith("[ARGS]", i)
        ):
            return json_value_end(text, i, state.memo if state is not None else None)
        brace = text.find("{", i)
        if brace < 0:
            return None
        m = _NAME_FORM.match(text, i)
        if m is None or m.end() != brace:
            return brace  # not a name form: the block (an error) ends before the brace
        return json_value_end(text, brace, state.memo if state is not None else None)

    def parse_block(self, raw, body, marker, complete, sink) -> None:
        """A JSON array of calls, or one ``NAME[ARGS]{json}`` call."""
        if not complete:
            sink.error(raw, "tool call cut off before its JSON ended")
            return
        text = body.strip()
        if text.startswith("[") and not text.startswith(("[CALL_ID]", "[ARGS]")):
            try:
                calls = json.loads(text)
            except json.JSONDecodeError as e:
                sink.error(raw, f"tool calls are not a valid JSON array: {e}")
                return
            for obj in calls if isinstance(calls, list) else [calls]:
                add_object_call(obj, raw, sink, ("arguments", "parameters"))
            return
        m = _NAME_FORM.match(body)
        if m is None:
            sink.error(raw, "expected NAME[ARGS]{...} or a JSON array after [TOOL_CALLS]")
            return
        json_args_call(m.group(1), body[m.end() :], raw, sink, m.group(2) or None)
