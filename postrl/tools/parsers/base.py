"""Shared types and the scanning engine of the tool-call parsers.

Every parser turns decoded assistant text into a :class:`ParseResult` (calls in order, one
:class:`ParseError` per malformed call, the content outside calls) and never raises. Parsers
are written once, as a *step* function over a text buffer that only commits what more text
cannot change; :func:`parse_text` runs the steps over a whole text and
:class:`StreamingToolParser` over text deltas, so a call split across deltas at any character
gives exactly the result of parsing the whole text (the tests split transcripts at every
offset).

A parser class declares:

* ``step(text, pos, final, state, sink) -> new_pos`` — consume from ``pos``: content goes to
  ``sink.content``, calls to ``sink.call``, malformed calls to ``sink.error``; return ``pos``
  unchanged to wait for more text (only when ``final`` is false);
* ``new_state()`` — the per-message scanning state;
* ``needs_special_tokens`` — True when its markers are special tokens that a decode with
  ``skip_special_tokens=True`` would delete (the server then decodes with them);
* ``expected`` — the call syntax shown to the model in error observations.

Most families are "blocks between markers" and use :class:`BlockScanner`.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from postrl.registry import Registry

__all__ = [
    "TOOL_PARSERS",
    "BlockScanner",
    "ParseError",
    "ParseResult",
    "StreamDelta",
    "StreamingToolParser",
    "ToolCall",
    "ToolParser",
    "coerce_value",
    "get_tool_parser",
    "json_value_end",
    "parse_text",
    "partial_suffix",
    "tool_properties",
]

#: format name -> parser class (constructed with keyword options).
TOOL_PARSERS: Registry[type] = Registry("tool-call parser")

HERMES_SYNTAX = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


class ToolCall(NamedTuple):
    """One parsed call; unpacks as ``name, arguments``."""

    name: str
    arguments: dict[str, Any]


class ParseError(NamedTuple):
    """A block that looked like a call but could not be parsed."""

    raw: str
    message: str
    expected: str = HERMES_SYNTAX
    """The family's call syntax, shown to the model with the error."""

    def __str__(self) -> str:
        """The error observation shown to the model."""
        return f"Error: {self.message}. Call tools as {self.expected}"


@dataclass
class ParseResult:
    """Output of a parser: calls in order, errors, the text with call blocks removed.

    ``content`` is what an OpenAI server returns as ``message.content`` (stripped);
    ``reasoning`` holds reasoning-channel text of formats that mark it (gpt-oss ``analysis``);
    ``ignored_in_code`` counts call blocks inside markdown code fences that were not counted;
    ``call_ids[i]`` is the id the model wrote for ``calls[i]`` in formats that carry one
    (Kimi's ``functions.NAME:IDX``, Mistral's ``id``/``[CALL_ID]``), else None.
    """

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""
    ignored_in_code: int = 0
    reasoning: str = ""
    call_ids: list[str | None] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """True when there is at least one call or one malformed call to answer."""
        return bool(self.calls or self.errors)


class ToolParser(Protocol):
    """What a registered parser offers (see the module docstring)."""

    needs_special_tokens: bool
    expected: str

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParseResult:
        """Calls, errors and content of a whole reply."""
        ...

    def stream(self, tools: list[dict[str, Any]] | None = None) -> StreamingToolParser:
        """An incremental parser for one reply."""
        ...

    def new_state(self) -> Any:
        """Fresh per-reply scanning state."""
        ...

    def step(self, text: str, pos: int, final: bool, state: Any, sink: _Sink) -> int:
        """Consume from ``pos``; return the new position (``pos`` = wait for more text)."""
        ...


def get_tool_parser(name: str, **options: Any) -> Any:
    """Instantiate the parser registered as ``name`` (unknown names list the choices)."""
    return TOOL_PARSERS.get(name)(**options)


# ----------------------------------------------------------------------------- sink


class _Strip:
    """Streams ``"".join(pieces).strip()``: drops leading whitespace, holds trailing."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def push(self, s: str) -> str:
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        t = s.rstrip()
        if not t:
            self.pending += s
            return ""
        out, self.pending = self.pending + t, s[len(t) :]
        return out


class _Sink:
    """Collects what steps emit; ``tools`` maps a tool name to its parameter schemas."""

    def __init__(self, expected: str, tools: list[dict[str, Any]] | None) -> None:
        self.expected = expected
        self.props = tool_properties(tools)
        self.typed = tools is not None
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.calls: list[ToolCall] = []
        self.call_ids: list[str | None] = []
        self.errors: list[ParseError] = []
        self.ignored_in_code = 0

    def content(self, s: str) -> None:
        if s:
            self.content_parts.append(s)

    def reasoning(self, s: str) -> None:
        if s:
            self.reasoning_parts.append(s)

    def call(self, name: str, arguments: dict[str, Any], call_id: str | None = None) -> None:
        self.calls.append(ToolCall(name, arguments))
        self.call_ids.append(call_id)

    def error(self, raw: str, message: str) -> None:
        self.errors.append(ParseError(raw, message, self.expected))

    def schema(self, tool: str, param: str) -> dict[str, Any] | None:
        """The JSON schema of ``tool``'s parameter ``param`` (None: unknown)."""
        return self.props.get(tool, {}).get(param)

    def value(self, tool: str, param: str, raw: str) -> Any:
        """A parameter value given as text, typed by the tool's schema (see coerce_value)."""
        return coerce_value(raw, self.schema(tool, param))


def _drive(parser: Any, text: str, final: bool, state: Any, sink: _Sink) -> int:
    """Run ``parser.step`` from 0 until it waits; returns the consumed length."""
    pos = 0
    while pos < len(text):
        new = parser.step(text, pos, final, state, sink)
        if new <= pos:
            if not final:
                break
            sink.content(text[pos:])  # a step that cannot progress at the end: keep the text
            return len(text)
        pos = new
    return pos


def parse_text(parser: Any, text: str, tools: list[dict[str, Any]] | None = None) -> ParseResult:
    """Run ``parser``'s steps over a whole text."""
    sink = _Sink(parser.expected, tools)
    _drive(parser, text, True, parser.new_state(), sink)
    return ParseResult(
        calls=sink.calls,
        errors=sink.errors,
        content="".join(sink.content_parts).strip(),
        ignored_in_code=sink.ignored_in_code,
        reasoning="".join(sink.reasoning_parts).strip(),
        call_ids=sink.call_ids,
    )


@dataclass
class StreamDelta:
    """What one :meth:`StreamingToolParser.feed` released: content and reasoning text (their
    concatenations over a reply equal ``ParseResult.content``/``reasoning``) and the calls and
    errors completed by this delta, in order."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    call_ids: list[str | None] = field(default_factory=list)


class StreamingToolParser:
    """Incremental parsing of one reply: ``feed(delta)`` per text delta, ``finish()`` at the
    end. Text that could still start a call is held back until it is decided; a call is
    emitted once complete. ``result()`` after ``finish()`` equals ``parser.parse(text)``.

    Args:
        parser: a registered parser instance.
        tools: OpenAI tool schemas (they type parameter values of XML-style formats).
    """

    def __init__(self, parser: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.parser = parser
        self._sink = _Sink(parser.expected, tools)
        self._state = parser.new_state()
        self._buf = ""
        self._content = _Strip()
        self._reasoning = _Strip()
        self._out: list[str] = []
        self._out_reasoning: list[str] = []
        self._n = (0, 0, 0, 0)
        self.finished = False

    def feed(self, delta: str) -> StreamDelta:
        """Add ``delta`` and return what it completed."""
        if self.finished:
            raise RuntimeError("StreamingToolParser.feed after finish(); start a new stream")
        self._buf += delta
        used = _drive(self.parser, self._buf, False, self._state, self._sink)
        self._buf = self._buf[used:]
        return self._emit(final=False)

    def finish(self) -> StreamDelta:
        """End of the reply: decide what was held back (unterminated calls become errors)."""
        if not self.finished:
            _drive(self.parser, self._buf, True, self._state, self._sink)
            self._buf = ""
            self.finished = True
        return self._emit(final=True)

    def _emit(self, final: bool) -> StreamDelta:
        s = self._sink
        c0, r0, k0, e0 = self._n
        content = "".join(self._content.push(p) for p in s.content_parts[c0:])
        reasoning = "".join(self._reasoning.push(p) for p in s.reasoning_parts[r0:])
        self._n = (len(s.content_parts), len(s.reasoning_parts), len(s.calls), len(s.errors))
        self._out.append(content)
        self._out_reasoning.append(reasoning)
        return StreamDelta(content, reasoning, s.calls[k0:], s.errors[e0:], s.call_ids[k0:])

    def result(self) -> ParseResult:
        """Everything parsed so far (the whole reply's result after ``finish()``)."""
        s = self._sink
        return ParseResult(
            calls=list(s.calls),
            call_ids=list(s.call_ids),
            errors=list(s.errors),
            content="".join(self._out),
            ignored_in_code=s.ignored_in_code,
            reasoning="".join(self._out_reasoning),
        )


# ----------------------------------------------------------------------------- scanning


def partial_suffix(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of a marker
    (text to hold back: the next delta may complete the marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text) - start), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: tuple[str, ...], pos: int) -> tuple[int, str]:
    """Earliest occurrence of any marker at or after ``pos``: ``(index, marker)`` or
    ``(-1, "")``; at equal positions the longer marker wins."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, pos, best + len(m) if best >= 0 else len(text))
        if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(which))):
            best, which = i, m
    return best, which


_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[{}\[\]]')
_STR_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*')  # a string's text up to its quote


def json_value_end(text: str, start: int, memo: dict | None = None) -> int | None:
    """End index of the JSON object/array opening at ``text[start]`` (``{`` or ``[``), found
    by bracket matching outside strings; None when the text ends first.

    ``memo`` (a dict kept across calls on a growing text, e.g. a stream's state) resumes the
    scan where the last incomplete one stopped when the text still starts with what was
    scanned — the scan state depends only on that text — so streaming stays linear.
    """
    pos, depth, in_str = start, 0, False
    saved = memo.get("json") if memo is not None else None
    if saved is not None and text.startswith(saved[0], start):
        pos, depth, in_str = start + len(saved[0]), saved[1], saved[2]
    while True:
        if in_str:  # inside a string: find its closing quote
            body_end = _STR_BODY.match(text, pos).end()
            if body_end == len(text) or text[body_end] != '"':  # the text ends in the string
                if memo is not None:
                    memo["json"] = (text[start:body_end], depth, True)
                return None
            pos, in_str = body_end + 1, False
        m = _JSON_TOKEN.search(text, pos)
        if m is None:
            if memo is not None:
                memo["json"] = (text[start:], depth, False)
            return None
        tok = m.group()
        if tok == '"':  # an unterminated string: continue inside it
            pos, in_str = m.end(), True
            continue
        pos = m.end()
        if tok[0] == '"':
            continue
        depth += 1 if tok in "{[" else -1
        if depth == 0:
            return pos


# ----------------------------------------------------------------------------- schemas


def tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``{tool name: {parameter: JSON schema}}`` from OpenAI tool schemas (``{"type":
    "function", "function": {...}}``) or bare function schemas."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = dict(props) if isinstance(props, dict) else {}
    return out


def _json_or(raw: str, default: Any) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return default


_MISSING = object()


def _as_type(raw: str, kind: str) -> Any:
    """``raw`` as JSON-schema type ``kind``, or _MISSING when it is not one."""
    s = raw.strip()
    if kind == "string":
        return raw
    if kind == "null":
        return None if s in ("null", "None") else _MISSING
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _MISSING)
    if kind in ("integer", "number"):
        v = _json_or(s, _MISSING)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return _MISSING
        if kind == "integer" and isinstance(v, float):
            return int(v) if v.is_integer() else _MISSING
        return v
    if kind in ("object", "array"):
        v = _json_or(s, _MISSING)
        if v is _MISSING:  # older templates render Python literals ({'a': True})
            try:
                v = ast.literal_eval(s)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return _MISSING
        want = dict if kind == "object" else list
        return v if isinstance(v, want) else _MISSING
    return _MISSING


def coerce_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter value written as text (XML-style formats), typed.

    With a schema that names a ``type`` (or a list of types, or ``anyOf``/``oneOf`` of typed
    schemas), the first type the text fits wins, ``string`` last (a string-typed ``"3"`` stays
    ``"3"``); text that fits none stays a string. Without a schema the text is JSON-decoded if
    it is valid JSON, else kept as a string.
    """
    kinds: list[str] = []
    if isinstance(schema, dict):
        t = schema.get("type")
        kinds = [t] if isinstance(t, str) else [k for k in t or () if isinstance(k, str)]
        for sub in schema.get("anyOf", ()) or schema.get("oneOf", ()) or ():
            if isinstance(sub, dict) and isinstance(sub.get("type"), str):
                kinds.append(sub["type"])
        if "enum" in schema and not kinds:
            return raw
    if not kinds:
        return _json_or(raw, raw)
    for kind in sorted(kinds, key=lambda k: k == "string"):
        v = _as_type(raw, kind)
        if v is not _MISSING:
            return v
    return raw


def json_call_args(args: Any, raw: str, sink: _Sink) -> dict[str, Any] | None:
    """Validate ``arguments`` decoded from JSON: an object, a JSON string holding one, or
    null (= no arguments); anything else is recorded as an error (None)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            sink.error(raw, f"'arguments' string is not valid JSON: {e}")
            return None
    if args is None:
        return {}
    if not isinstance(args, dict):
        sink.error(raw, f"'arguments' must be a JSON object, got {type(args).__name__}")
        return None
    return args


def json_object_call(body: str, raw: str, sink: _Sink, args_keys=("arguments", "parameters")):
    """A ``{"name": ..., "arguments": {...}}`` object (hermes, llama3, mistral v3) → call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        sink.error(raw, f"tool call is not valid JSON: {e}")
        return
    add_object_call(obj, raw, sink, args_keys)


def add_object_call(obj: Any, raw: str, sink: _Sink, args_keys=("arguments", "parameters")):
    """Record ``obj`` (decoded JSON) as a call (its string ``id``, if any, kept), or the
    reason it is not one."""
    if not isinstance(obj, dict):
        sink.error(raw, "tool call must be a JSON object with 'name' and 'arguments'")
        return
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        sink.error(raw, "tool call has no string 'name'")
        return
    args = next((obj[k] for k in args_keys if k in obj), {})
    args = json_call_args(args, raw, sink)
    if args is not None:
        sink.call(name, args, obj["id"] if isinstance(obj.get("id"), str) else None)


def json_args_call(name: str, body: str, raw: str, sink: _Sink, call_id: str | None = None) -> None:
    """A call whose name is known and whose arguments are the JSON text ``body``."""
    name = name.strip()
    if not name:
        sink.error(raw, "tool call has no function name")
        return
    try:
        args = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        sink.error(raw, f"arguments of {name!r} are not valid JSON: {e}")
        return
    args = json_call_args(args, raw, sink)
    if args is not None:
        sink.call(name, args, call_id)


# ----------------------------------------------------------------------------- blocks


_FENCE = "```"


@dataclass
class _BlockState:
    in_fence: bool = False
    memo: dict = field(default_factory=dict)


class BlockScanner:
    """Content with call blocks that open with a marker; the shared step of most families.

    A subclass sets ``starts`` (markers opening a block), optionally ``drops`` (structural
    markers removed from content, e.g. a calls-section wrapper) and ``fence`` (blocks inside
    markdown code fences are content, counted in ``ignored_in_code``), and implements
    ``block_end(text, body_start, marker, state) -> end index | None`` (None: not complete
    yet; ``state.memo`` may keep scanning progress across deltas) and
    ``parse_block(raw, body, marker, complete, sink)``.
    """

    starts: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()
    fence: bool = False
    needs_special_tokens: bool = False
    expected: str = HERMES_SYNTAX

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParseResult:
        """Calls, errors and content of a whole reply (never raises)."""
        return parse_text(self, text, tools)

    def stream(self, tools: list[dict[str, Any]] | None = None) -> StreamingToolParser:
        """An incremental parser for one reply."""
        return StreamingToolParser(self, tools)

    def new_state(self) -> Any:
        """Fresh per-reply scanning state."""
        return _BlockState()

    def block_end(self, text: str, body: int, marker: str, state: Any = None) -> int | None:
        """Index just after the block that opened with ``marker`` (body starts at ``body``)."""
        raise NotImplementedError

    def parse_block(self, raw: str, body: str, marker: str, complete: bool, sink: _Sink):
        """Record the call(s) or error(s) of one block (``complete``: its end was found)."""
        raise NotImplementedError

    def step(self, text: str, pos: int, final: bool, state: Any, sink: _Sink) -> int:
        """Content up to the next marker, then one whole block (see the class docstring)."""
        if state.in_fence:
            return self._fenced(text, pos, final, state, sink)
        markers = self.starts + self.drops + ((_FENCE,) if self.fence else ())
        i, m = find_first(text, markers, pos)
        if i < 0:
            end = len(text) if final else len(text) - partial_suffix(text, markers, pos)
            sink.content(text[pos:end])
            return end
        sink.content(text[pos:i])
        if m == _FENCE:
            state.in_fence = True
            sink.content(m)
            return i + len(m)
        if m in self.drops:
            return i + len(m)
        body = i + len(m)
        end = self.block_end(text, body, m, state)
        if end is None and not final:
            return i  # wait for the rest of the block
        raw = text[i : end if end is not None else len(text)]
        inner = text[body : end if end is not None else len(text)]
        self.parse_block(raw, inner, m, end is not None, sink)
        return end if end is not None else len(text)

    def _fenced(self, text: str, pos: int, final: bool, state: Any, sink: _Sink) -> int:
        j = text.find(_FENCE, pos)
        if j >= 0:
            end = j + len(_FENCE)
            state.in_fence = False
        else:
            held = partial_suffix(text, (_FENCE, *self.starts), pos)
            end = len(text) if final else len(text) - held
        chunk = text[pos:end]
        # blocks inside fences are quoted text, counted; partial markers were held back, so
        # no marker straddles two chunks
        sink.ignored_in_code += sum(chunk.count(s) for s in self.starts)
        sink.content(chunk)
        return end


def end_marker_block(text: str, body: int, end_marker: str) -> int | None:
    """Block end for formats closed by ``end_marker``."""
    j = text.find(end_marker, body)
    return None if j < 0 else j + len(end_marker)
