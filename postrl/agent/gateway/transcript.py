"""The token-faithful transcript of one gateway trajectory: segments of exact ids.

An OpenAI agent sends the whole conversation with every request. The gateway never trains on a
re-tokenisation of it; it keeps what it rendered and what the engine sampled:

* the **first** request of a segment renders ``apply_chat_template(messages, tools,
  add_generation_prompt=True)`` once: that is the segment's ``prompt_ids``;
* each reply's sampled ids (with their log-probs and policy versions) are appended with mask 1,
  exactly as sampled — including a stop string's tokens or an end-of-turn token the text
  returned to the agent does not show;
* a later request **extends** the segment when its messages start with the segment's messages
  (the prompt messages, then every assistant reply as the gateway returned it and every
  observation since), the tools are unchanged and what follows is not an assistant message.
  Only the new messages (tool results, user turns) are tokenised, as a chat-template delta
  (:class:`~postrl.agent.tool_loop.ChatDelta`, the tool loop's machinery: the end-of-turn
  token the model sampled is not repeated), appended with mask 0, log-prob 0, version -1;
* any other request (the agent rewrote or summarised its history, changed the tools, runs a
  second conversation) **starts a new segment**, rendered from its messages. A trajectory with
  several segments trains as several rows that share the run's reward and group
  (``AgentLoopOutput.segments``).

Messages are compared by role, text and tool calls (name and parsed arguments); the ids of
tool calls and message fields the chat template does not read are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from postrl.agent.base import AgentLoopOutput

__all__ = ["ContextOverflowError", "Segment", "Transcript", "normalize_message"]


class ContextOverflowError(ValueError):
    """A request's context (prompt so far + room to answer) exceeds the trajectory's budget."""


def _args(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a) if a.strip() else {}
        except json.JSONDecodeError:
            return a
    return a


def normalize_message(m: dict[str, Any]) -> tuple[Any, ...]:
    """What of a message reaches the chat template: role, text, tool calls (name, arguments)."""
    calls = tuple(
        (
            str((c.get("function") or {}).get("name", "")),
            json.dumps(_args((c.get("function") or {}).get("arguments")), sort_keys=True),
        )
        for c in (m.get("tool_calls") or ())
    )
    return (m.get("role"), m.get("content") or "", m.get("name") or "", calls)


@dataclass
class Segment:
    """One contiguous conversation: its prompt ids and the ids appended since, token-exact."""

    prompt_ids: list[int]
    messages: list[tuple[Any, ...]]
    tools_key: str
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[tuple[int, int]] = field(default_factory=list)
    last_generated: list[int] = field(default_factory=list)
    replies: int = 0
    observations: int = 0

    @property
    def length(self) -> int:
        """Tokens in context (prompt + response)."""
        return len(self.prompt_ids) + len(self.response_ids)

    def output(self, finish_reason: str) -> AgentLoopOutput:
        """This segment as one trajectory row."""
        return AgentLoopOutput(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_mask=list(self.response_mask),
            response_logprobs=list(self.response_logprobs),
            response_versions=list(self.response_versions),
            num_turns=1 + self.replies + self.observations,
            finish_reason=finish_reason,
        )


class Transcript:
    """The segments of one trajectory (see the module docstring).

    Args:
        delta: the tokenizer's :class:`~postrl.agent.tool_loop.ChatDelta` (renders and encodes).
        max_len: most tokens a segment may hold (prompt + response + 1, the rollout's KV
            capacity); ``None``: no limit.
        render_tools: render a request's ``tools`` into a new segment's prompt
            (``rollout.agent.gateway.render_tools``).
    """

    def __init__(self, delta: Any, max_len: int | None = None, render_tools: bool = True) -> None:
        self.delta = delta
        self.max_len = max_len
        self.render_tools = render_tools
        self.segments: list[Segment] = []
        self.tokenized = 0
        """Ids made by tokenising text (segment prompts and observation deltas)."""
        self.new_segments = 0
        """Requests that did not extend the transcript (a segment started after the first)."""

    @property
    def current(self) -> Segment | None:
        """The segment the next reply is appended to."""
        return self.segments[-1] if self.segments else None

    def prepare(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, room: int
    ) -> list[int]:
        """The prompt ids of a request (extending the current segment or starting one).

        ``room`` is the fewest new tokens the request must be able to generate (1).

        Raises:
            ContextOverflowError: the prompt leaves no room within ``max_len``; nothing is
                recorded.
        """
        norm = [normalize_message(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        seg = self.current
        if seg is not None and self._extends(seg, norm, tools_key):
            new = messages[len(seg.messages) :]
            obs = self.delta.observation(new, seg.last_generated)
            self._check(seg.length + len(obs) + room)
            seg.response_ids += obs
            seg.response_mask += [0] * len(obs)
            seg.response_logprobs += [0.0] * len(obs)
            if obs:
                seg.response_versions.append((len(obs), -1))
            seg.messages = norm
            seg.observations += 1
            self.tokenized += len(obs)
            return seg.prompt_ids + seg.response_ids
        kw = {"tools": tools} if tools and self.render_tools else {}
        ids = self.delta.encode(self.delta.render(messages, add_generation_prompt=True, **kw))
        self._check(len(ids) + room)
        if seg is not None:
            self.new_segments += 1
            if not seg.replies:  # a segment nothing was sampled in: nothing to train
                self.segments.pop()
        self.segments.append(Segment(prompt_ids=ids, messages=norm, tools_key=tools_key))
        self.tokenized += len(ids)
        return list(ids)

    def record(
        self,
        ids: list[int],
        logprobs: list[float] | None,
        versions: list[tuple[int, int]],
        reply: dict[str, Any],
    ) -> None:
        """Append one reply's sampled ids (mask 1) and the assistant message returned for it."""
        seg = self.current
        assert seg is not None, "record() before prepare()"
        seg.response_ids += ids
        seg.response_mask += [1] * len(ids)
        seg.response_logprobs += list(logprobs) if logprobs else [0.0] * len(ids)
        seg.response_versions += versions
        seg.last_generated = list(ids)
        seg.messages = seg.messages + [normalize_message(reply)]
        seg.replies += 1

    def room(self) -> int | None:
        """Tokens the current segment may still grow by (``None``: no limit)."""
        if self.max_len is None:
            return None
        return self.max_len - 1 - (self.current.length if self.current else 0)

    def _check(self, needed: int) -> None:
        if self.max_len is not None and needed >= self.max_len:
            raise ContextOverflowError(
                f"this request needs {needed} tokens of context, more than the trajectory's "
                f"budget of {self.max_len - 1} (the rollout's max_model_len); shorten the "
                "conversation or raise rollout.max_model_len / data.max_prompt_length"
            )

    @staticmethod
    def _extends(seg: Segment, norm: list[tuple[Any, ...]], tools_key: str) -> bool:
        k = len(seg.messages)
        return (
            seg.replies > 0
            and tools_key == seg.tools_key
            and len(norm) > k
            and seg.messages[-1][0] == "assistant"
            and norm[:k] == seg.messages
            and all(m[0] != "assistant" for m in norm[k:])
        )
