"""``gpt-oss``: OpenAI's harmony format (gpt-oss-20b / gpt-oss-120b).

Format (openai/harmony ``docs/format.md``, "Receiving tool calls"; the gpt-oss chat template).
The reply is a sequence of messages ``[<|start|>assistant]HEADER<|message|>BODY<|end|>`` —
the first one's ``<|start|>assistant`` is the end of the prompt — ended by ``<|call|>`` after a
tool call and ``<|return|>`` after the answer (one line)::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"location": "Tokyo"}<|call|>

Rules:

* a message whose header names a recipient ``to=functions.NAME`` (in the channel part, as
  above, or in the role part: ``<|start|>assistant to=functions.NAME<|channel|>commentary
  json<|message|>``) is a call of ``NAME``; its body must be a JSON object. A recipient outside
  ``functions.`` (built-in ``browser.search``, ``python``) is a call of the full recipient name;
* ``final`` messages and ``commentary`` messages without a recipient (preambles) are content,
  one message per line; ``analysis`` messages are ``ParseResult.reasoning``;
* text outside any harmony message is content; a call whose ``<|call|>`` was stripped by the
  caller (it is a stop token) still counts when its body is a complete JSON object; a call
  with invalid JSON, or whose header or body is cut off, is a
  :class:`~postrl.tools.parsers.base.ParseError`.

Several calls in one reply are consecutive messages (the model usually stops at the first
``<|call|>``). The markers are special tokens: the server decodes with them kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from postrl.tools.parsers.base import (
    TOOL_PARSERS,
    StreamingToolParser,
    find_first,
    json_args_call,
    parse_text,
    partial_suffix,
)

__all__ = ["GptOssToolParser"]

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_OPENERS = (START, CHANNEL, " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


@dataclass
class _State:
    mode: str = "start"  # start | text | body
    kind: str = ""  # content | reasoning | call (of the body being read)
    name: str = ""
    header: str = ""
    wrote_content: bool = False
    wrote_reasoning: bool = False


@TOOL_PARSERS.register("gpt-oss")
class GptOssToolParser:
    """Parser for harmony replies (see the module docstring)."""

    needs_special_tokens = True
    expected = (
        "<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json"
        "<|message|>{...}<|call|>"
    )

    def parse(self, text: str, tools=None):
        """Calls, errors, content and reasoning of a whole reply (never raises)."""
        return parse_text(self, text, tools)

    def stream(self, tools=None) -> StreamingToolParser:
        """An incremental parser for one reply."""
        return StreamingToolParser(self, tools)

    def new_state(self) -> _State:
        """Fresh state: the reply starts at a message header."""
        return _State()

    def step(self, text, pos, final, state, sink) -> int:
        """One piece of the message sequence (header, body or text outside messages)."""
        if state.mode == "body":
            return self._body(text, pos, final, state, sink)
        if state.mode == "start":
            rest = text[pos : pos + 16]
            if any(rest.startswith(o) for o in _OPENERS):
                return self._header(text, pos, final, state, sink)
            if not final and any(o.startswith(rest) for o in _OPENERS):
                return pos  # could still become a header
            state.mode = "text"
        return self._text(text, pos, final, state, sink)

    def _text(self, text, pos, final, state, sink) -> int:
        i, m = find_first(text, (START, CHANNEL, *ENDS), pos)
        if i < 0:
            end = (
                len(text)
                if final
                else len(text) - partial_suffix(text, (START, CHANNEL, *ENDS), pos)
            )
            self._write(text[pos:end], "content", state, sink, new=False)
            return end
        self._write(text[pos:i], "content", state, sink, new=False)
        state.mode = "start"
        return i + len(m) if m in ENDS else i

    def _header(self, text, pos, final, state, sink) -> int:
        j = text.find(MESSAGE, pos)
        if j < 0:
            if not final:
                return pos
            header = text[pos:]
            if _RECIPIENT.search(header):
                sink.error(header, "tool call cut off in its header (no <|message|>)")
            return len(text)
        header = text[pos:j]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        state.header = header
        if recipient:
            state.kind, state.name = "call", recipient.group(1).removeprefix("functions.")
        elif channel and channel.group(1) == "analysis":
            state.kind = "reasoning"
        else:
            state.kind = "content"
        state.mode = "body"
        if state.kind != "call":
            self._write("", state.kind, state, sink, new=True)
        return j + len(MESSAGE)

    def _body(self, text, pos, final, state, sink) -> int:
        i, m = find_first(text, ENDS, pos)
        if state.kind == "call":
            if i < 0 and not final:
                return pos
            end = len(text) if i < 0 else i
            raw = state.header + MESSAGE + text[pos:end] + m
            self._call(state.name, text[pos:end], raw, i >= 0, sink)
            state.mode = "start"
            return end + len(m)
        if i < 0:
            end = len(text) if final else len(text) - partial_suffix(text, ENDS, pos)
            self._write(text[pos:end], state.kind, state, sink, new=False)
            return end
        self._write(text[pos:i], state.kind, state, sink, new=False)
        state.mode = "start"
        return i + len(m)

    @staticmethod
    def _call(name: str, body: str, raw: str, terminated: bool, sink) -> None:
        if not terminated:
            try:
                ok = isinstance(json.loads(body), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                sink.error(raw, f"tool call of {name!r} cut off before <|call|>")
                return
        json_args_call(name, body, raw, sink)

    @staticmethod
    def _write(s: str, kind: str, state: _State, sink, new: bool) -> None:
        """Content/reasoning text; a new message starts on a new line."""
        flag = "wrote_content" if kind == "content" else "wrote_reasoning"
        out = sink.content if kind == "content" else sink.reasoning
        if new:
            if getattr(state, flag):
                out("\n")
            return
        if s:
            out(s)
            setattr(state, flag, True)
