"""OpenAI API request bodies and response pieces for ``postrl serve`` (pure, no HTTP).

What the official ``openai`` client sends and expects, for ``/v1/completions`` and
``/v1/chat/completions``: request models (unknown chat roles rejected), log-probabilities
with token *strings* (``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` for
completions; ``content[{token, logprob, bytes, top_logprobs}]`` for chat), stop-string
trimming, tool calls in OpenAI's shape, server-sent-event framing and error bodies
(``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import inspect
import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = [
    "ChatBody",
    "CompletionBody",
    "Message",
    "error_body",
    "sse",
    "completion_logprobs",
    "chat_logprobs",
    "render_messages",
    "trim_stop",
    "token_text",
    "tool_calls_of",
    "parse_tool_reply",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: bool = False


class OpenAICommon(BaseModel):
    """Fields shared by completions and chat completions (unknown fields are ignored)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None


class CompletionBody(OpenAICommon):
    """``POST /v1/completions``: ``logprobs`` is the number of alternatives (0-20)."""

    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ContentPart(BaseModel):
    """One part of a message's content list; only text parts are supported."""

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message. ``role`` must be one of OpenAI's roles (else 400)."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatBody(OpenAICommon):
    """``POST /v1/chat/completions``: ``logprobs`` on/off, ``top_logprobs`` alternatives."""

    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON (or the literal ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content)


def render_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content, tool-call arguments as dicts."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": _text(m.content)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # the template renders the string as it is
                calls.append({**c, "function": fn})
            d["tool_calls"] = calls
        out.append(d)
    return out


def trim_stop(text: str, stop_reason: Any) -> str:
    """Cut ``text`` before the stop string that ended it (OpenAI excludes it)."""
    if isinstance(stop_reason, str) and stop_reason and stop_reason in text:
        return text[: text.index(stop_reason)]
    return text


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token; a partial UTF-8 byte (decodes to U+FFFD) is named by its
    vocabulary entry instead, so distinct tokens keep distinct names."""
    text = tokenizer.decode([token_id])
    if "\ufffd" in text:
        return str(tokenizer.convert_ids_to_tokens(token_id))
    return text


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [token_text(tokenizer, t) for t in ids]


def completion_logprobs(
    tokenizer: Any, ids: list[int], lps: list[float], top: list[list[tuple[int, float]]] | None
) -> dict[str, Any]:
    """The completions ``logprobs`` object: token strings, their log-probs, alternatives."""
    tokens = _token_texts(tokenizer, ids)
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    alts = None
    if top is not None:
        alts = [{token_text(tokenizer, i): lp for i, lp in row} for row in top]
    return {
        "tokens": tokens,
        "token_logprobs": list(lps),
        "top_logprobs": alts,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Any, ids: list[int], lps: list[float], top: list[list[tuple[int, float]]] | None
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``content`` entries with token, bytes and alternatives."""
    content = []
    for j, (t, lp) in enumerate(zip(ids, lps)):
        text = token_text(tokenizer, t)
        alts = []
        for i, a in top[j] if top is not None else ():
            alt = token_text(tokenizer, i)
            alts.append({"token": alt, "logprob": a, "bytes": list(alt.encode())})
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alts}
        )
    return {"content": content}


def _parse(parser: Any, text: str, tools: list[dict[str, Any]] | None) -> Any:
    """``parser.parse(text, tools)``, or ``parse(text)`` for parsers without a ``tools``
    parameter (the schemas type XML-style parameter values)."""
    if tools is not None and "tools" in inspect.signature(parser.parse).parameters:
        return parser.parse(text, tools=tools)
    return parser.parse(text)


def _openai_calls(result: Any, parser: Any) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls``; ids are the model's own where its format carries them
    (``result.call_ids``), else the parser's ``new_call_id()`` (formats whose templates
    constrain ids), else ``call_<hex>``."""
    ids = list(getattr(result, "call_ids", None) or ())
    make = getattr(parser, "new_call_id", None) or (lambda: f"call_{uuid.uuid4().hex[:24]}")
    return [
        {
            "id": (ids[i] if i < len(ids) and ids[i] else None) or make(),
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for i, c in enumerate(result.calls)
    ]


def tool_calls_of(
    parser: Any, text: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """Parse ``text`` for tool calls: ``(remaining content or None, OpenAI tool_calls)``."""
    result = _parse(parser, text, tools)
    calls = _openai_calls(result, parser)
    if not calls:
        return text, []
    return (result.content.strip() or None), calls


def parse_tool_reply(
    parser: Any,
    tokenizer: Any,
    token_ids: list[int],
    text: str,
    stop_reason: Any,
    tools: list[dict[str, Any]] | None,
) -> tuple[str | None, list[dict[str, Any]]]:
    """A chat reply's ``(content, tool_calls)``. ``text`` is the reply decoded without special
    tokens; a parser that declares ``needs_special_tokens`` (its markers are special tokens:
    gpt-oss, kimi_k2, mistral, ...) reads the ids decoded with them, and its content (for
    gpt-oss: the final and preamble messages) comes back without the tokenizer's special
    tokens."""
    if not getattr(parser, "needs_special_tokens", False):
        return tool_calls_of(parser, text, tools)
    raw = trim_stop(tokenizer.decode(token_ids, skip_special_tokens=False), stop_reason)
    result = _parse(parser, raw, tools)
    content = result.content
    for t in sorted(set(getattr(tokenizer, "all_special_tokens", ())), key=len, reverse=True):
        content = content.replace(t, "")
    calls = _openai_calls(result, parser)
    return (content.strip() or None) if calls else content.strip(), calls
