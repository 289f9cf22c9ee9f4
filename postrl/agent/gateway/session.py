"""One trajectory's side of the gateway: its secret, its transcript, its chat completions.

A :class:`GatewaySession` answers ``POST .../v1/chat/completions`` for one agent run: it turns
the request into prompt ids through its :class:`~postrl.agent.gateway.transcript.Transcript`
(token-faithful), samples through the agent loop's rollout client (whatever backend the fleet
uses, with the policy versions of the tokens), parses tool calls with the configured parser and
returns OpenAI's ``chat.completion`` object. Requests of one session are served one at a time,
in arrival order.

Request fields (everything else is refused with a 400 naming the field):

* ``messages`` (required), ``model`` (ignored: the policy answers whatever name is sent);
* ``tools``, ``tool_choice`` (``"none"`` disables parsing; ``"auto"``/``"required"``/a named
  function parse calls alike — nothing forces the model), ``parallel_tool_calls`` (ignored);
* ``n`` (must be 1), ``temperature``, ``top_p``, ``seed``, ``stop``, ``max_tokens`` /
  ``max_completion_tokens`` (capped at ``rollout.response_length``), ``logprobs``
  (``top_logprobs`` must be 0 or absent), ``stream``, ``stream_options``, ``user``,
  ``presence_penalty`` / ``frequency_penalty`` (must be 0), ``response_format`` (text only).

Sampling fields the agent omits come from the trajectory's rollout sampling (``rollout.*``);
request 0 uses the trajectory's seed and request ``k > 0`` ``derive_seed(seed, k)``, as the tool
loop seeds its turns (the same prompt ids sample the same tokens through either loop).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import replace
from typing import Any

from pydantic import ConfigDict

from postrl.agent.base import token_versions
from postrl.agent.gateway.transcript import ContextOverflowError, Transcript
from postrl.agent.manager import derive_seed
from postrl.rollout.openai_compat import (
    ChatBody,
    chat_logprobs,
    render_messages,
    tool_calls_of,
    trim_stop,
)

__all__ = ["GatewayChatBody", "GatewaySession", "SessionClosedError"]


class SessionClosedError(RuntimeError):
    """A request reached a trajectory that already ended (or failed)."""


class GatewayChatBody(ChatBody):
    """``ChatBody`` with unknown top-level keys refused (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    parallel_tool_calls: bool | None = None


class GatewaySession:
    """The gateway state of one trajectory.

    Args:
        sid: the session id (the path segment of its base URL; unguessable).
        key: the session's API key.
        client: the rollout client (``generate(prompt_ids, sampling, request_id,
            trajectory_id)``).
        tokenizer: the policy tokenizer.
        transcript: the trajectory's :class:`Transcript`.
        sampling: the trajectory's ``SamplingParams`` (defaults of every request).
        request_id: the trajectory's id (rollout request ids derive from it).
        parser: a tool-call parser (``parse(text)``), or None.
        max_requests: requests allowed; the next one fails the trajectory.
    """

    def __init__(
        self,
        sid: str,
        key: str,
        client: Any,
        tokenizer: Any,
        transcript: Transcript,
        sampling: Any,
        request_id: str,
        parser: Any,
        max_requests: int,
    ) -> None:
        self.sid, self.key = sid, key
        self.client = client
        self.tokenizer = tokenizer
        self.transcript = transcript
        self.sampling = sampling
        self.request_id = request_id
        self.parser = parser
        self.max_requests = max_requests
        self.requests = 0
        self.rewards: list[float] = []
        self.failure = ""
        self.final_text: str | None = None
        self.closed = False
        self._lock = asyncio.Lock()

    def fail(self, reason: str) -> None:
        """Mark the trajectory failed (the first reason wins)."""
        self.failure = self.failure or reason

    def add_reward(self, body: Any) -> float:
        """Record ``{"reward": r}`` (a number); raises ``ValueError`` naming what is wrong."""
        if self.closed:
            raise SessionClosedError(f"trajectory {self.request_id} has already ended")
        if not isinstance(body, dict) or set(body) != {"reward"}:
            raise ValueError('the reward body must be exactly {"reward": <number>}')
        r = body["reward"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ValueError(f"reward must be a finite number, got {r!r}")
        self.rewards.append(float(r))
        return float(r)

    def _sampling(self, body: GatewayChatBody) -> Any:
        if body.n != 1:
            raise ValueError("n: only n=1 is supported (one trajectory per request)")
        if body.presence_penalty or body.frequency_penalty:
            raise ValueError("presence_penalty/frequency_penalty are not supported (leave them 0)")
        if body.top_logprobs:
            raise ValueError("top_logprobs: the gateway returns the sampled tokens' log-probs only")
        if body.response_format and body.response_format.get("type") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        sp = self.sampling
        fields = body.model_fields_set
        kw: dict[str, Any] = {}
        if "temperature" in fields:
            kw["temperature"] = body.temperature
        if "top_p" in fields:
            kw["top_p"] = body.top_p
        if body.stop:
            kw["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        asked = body.max_completion_tokens or body.max_tokens
        kw["max_new_tokens"] = min(asked or sp.max_new_tokens, sp.max_new_tokens)
        if body.seed is not None:
            kw["seed"] = body.seed
        elif sp.seed is not None and self.requests > 1:  # as the tool loop seeds its turns
            kw["seed"] = derive_seed(sp.seed, self.requests - 1)
        return replace(sp, **kw)

    async def chat(self, body: GatewayChatBody) -> dict[str, Any]:
        """Answer one chat request (non-streamed shape; the server streams it when asked)."""
        async with self._lock:
            if self.closed:
                raise SessionClosedError(f"trajectory {self.request_id} has already ended")
            self.requests += 1
            if self.requests > self.max_requests:
                self.fail("too_many_requests")
                raise ValueError(
                    f"this trajectory made more than rollout.agent.gateway.max_requests="
                    f"{self.max_requests} requests"
                )
            sp = self._sampling(body)
            messages = render_messages(body.messages)
            use_tools = bool(body.tools) and body.tool_choice != "none"
            if use_tools and self.parser is None:
                raise ValueError(
                    "tools: this gateway has no tool parser (rollout.agent.tool_parser)"
                )
            try:
                ids = self.transcript.prepare(messages, body.tools, room=1)
            except ContextOverflowError:
                self.fail("context_overflow")
                raise
            room = self.transcript.room()
            if room is not None:
                sp = replace(sp, max_new_tokens=max(1, min(sp.max_new_tokens, room)))
            out = await self.client.generate(
                ids,
                sp,
                request_id=f"{self.request_id}-c{self.requests}",
                trajectory_id=self.request_id,
            )
            return self._reply(out, sp, body, use_tools, len(ids))

    def _reply(
        self, out: Any, sp: Any, body: GatewayChatBody, use_tools: bool, n_prompt: int
    ) -> dict[str, Any]:
        tok = self.tokenizer
        gen = [int(t) for t in out.token_ids]
        stops = set(sp.stop_token_ids) | {tok.eos_token_id}
        end = len(gen)
        while end and gen[end - 1] in stops:  # the end-of-turn token is not content
            end -= 1
        # special tokens stay in the text (tool-call tags may be special tokens), as the tool
        # loop parses them
        text = trim_stop(tok.decode(gen[:end], skip_special_tokens=False), out.stop_reason)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = out.finish_reason
        if use_tools:
            content, calls = tool_calls_of(self.parser, text, body.tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
        lps = list(out.log_probs) if out.log_probs else []
        self.transcript.record(gen, lps, token_versions(out, len(gen)), message)
        self.final_text = text
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(tok, gen, lps, None) if body.logprobs else None,
            "finish_reason": finish,
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or "postrl",
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": len(gen),
                "total_tokens": n_prompt + len(gen),
            },
        }
