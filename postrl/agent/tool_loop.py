"""The multi-turn tool agent loop (``tool_agent``): generate → call tools → observe → generate ….

State machine (one trajectory)::

    PENDING ──► GENERATING ──(no tool call / EOS-less stop / turn or token budget)──► TERMINATED
                   ▲   │
                   │   └─(tool calls parsed)─► PROCESSING_TOOLS ─(user turns, budget)─► TERMINATED
                   └───────────(observation tokens appended)─────┘

Token-in/token-out, no re-tokenisation: the prompt of generation *k* is ``prompt_ids`` followed by
every response id so far, exactly as sampled. Only *observations* are tokenised, once, when they
are appended. An observation is the chat template's rendering of the tool messages **delta**::

    delta = render(base + tool_msgs, add_generation_prompt=True)[len(head):]

where ``base = [user "U", assistant MARKER]`` and ``head`` is ``render(base)`` cut right after
``MARKER``. For ChatML the delta is
``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n…\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.
Its first token is the end-of-turn token the model itself sampled (``<|im_end|>``), so it is
dropped; the rest — including the template's ``\\n`` after ``<|im_end|>`` — is appended with
``response_mask = 0``, log-prob 0 and policy version -1 (policy tokens carry the version of the
weights that sampled them, per resumed segment: ``AgentLoopOutput.response_versions``). The
delta is exact whenever the template renders a message independently of the messages after it
and the tokenizer splits at the end-of-turn special token (ChatML/Qwen, Llama-3, Mistral-style
templates); the faithfulness check below proves it per trajectory.

Token-faithfulness check (``check_token_faithfulness``): rebuild the conversation (prompt
messages, assistant turns, tool messages) and render it with ``apply_chat_template``;
``agent/token_drift_ratio`` compares ``prompt_ids + response_ids`` with that rendering tokenised
around the turns' *sampled* ids (the loop's own boundaries; must be 0), and
``agent/retokenize_drift_ratio`` with the fully re-tokenised conversation (assistant turns
decoded to text; > 0 when the model samples non-canonical or invalid-UTF-8 byte sequences —
harmless for training, which uses the sampled ids). Both are the fraction of differing positions
over the longer length; the template's closing suffix after a final turn is not counted. The
first ``token_drift_ratio`` mismatch is logged once per loop with both decodings.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from postrl.agent.base import AgentLoopBase, AgentLoopOutput, register_agent_loop, token_versions
from postrl.agent.manager import derive_seed

logger = logging.getLogger(__name__)

__all__ = ["AgentState", "ChatDelta", "ToolAgentLoop", "token_drift"]

_MARKER = "\x1fPOSTRL_ASSISTANT_MARKER\x1f"


class AgentState(enum.Enum):
    """States of one tool-loop trajectory."""

    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


class ChatDelta:
    """Tokenises tool observations as chat-template deltas (see the module docstring).

    Args:
        tokenizer: HF tokenizer with a chat template.

    Raises:
        ValueError: the template does not render the marker assistant message verbatim or does
            not extend the rendered prefix when tool messages are added (delta not valid).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARKER}]
        rendered = self.render(self._base, add_generation_prompt=False)
        cut = rendered.rfind(_MARKER)
        if cut < 0:
            raise ValueError(
                "chat template does not render assistant content verbatim; the tool loop cannot "
                "compute observation deltas for it (use a ChatML/Qwen-style template)"
            )
        self._head = rendered[: cut + len(_MARKER)]
        #: tokens the template closes an assistant turn with (e.g. ``<|im_end|>``, ``\n``).
        self.turn_suffix_ids = self.encode(rendered[cut + len(_MARKER) :])

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kw: Any) -> str:
        """``apply_chat_template`` as text."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )

    def encode(self, text: str) -> list[int]:
        """Tokenise ``text`` without adding BOS/EOS (special tokens in the text are kept)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def observation(self, tool_messages: list[dict[str, Any]], generated: list[int]) -> list[int]:
        """Ids to append after an assistant turn that produced ``generated``.

        Leading delta tokens the model already sampled (its end-of-turn token) are skipped; when
        the turn did not end with them (stop string), they are part of the observation.
        """
        full = self.render(self._base + tool_messages, add_generation_prompt=True)
        if not full.startswith(self._head):
            raise ValueError(
                "chat template rendering of earlier messages changes when tool messages are "
                "added; delta invalid"
            )
        ids = self.encode(full[len(self._head) :])
        k = min(len(self.turn_suffix_ids), len(ids))
        while k > 0 and not (len(generated) >= k and generated[-k:] == ids[:k]):
            k -= 1
        return ids[k:]

    def closing(self, generated: list[int]) -> list[int]:
        """Ids the template would add after a final assistant turn that produced ``generated``."""
        suf = self.turn_suffix_ids
        k = len(suf)
        while k > 0 and not (len(generated) >= k and generated[-k:] == suf[:k]):
            k -= 1
        return suf[k:]


def token_drift(actual: list[int], expected: list[int]) -> tuple[float, int]:
    """Fraction of mismatching positions over ``max(len)`` and the first mismatch (-1 if none)."""
    n = max(len(actual), len(expected))
    if n == 0:
        return 0.0, -1
    m = min(len(actual), len(expected))
    diffs = [i for i in range(m) if actual[i] != expected[i]]
    mismatches = len(diffs) + (n - m)
    first = diffs[0] if diffs else (m if n > m else -1)
    return mismatches / n, first


@dataclass
class _Trajectory:
    """Mutable state of one trajectory (private to :class:`ToolAgentLoop`)."""

    request_id: str
    instance_id: str
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    budget: int
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[tuple[int, int]] = field(default_factory=list)
    last_generated: list[int] = field(default_factory=list)
    assistant_idx: list[int] = field(default_factory=list)
    turn_contents: list[list[int]] = field(default_factory=list)
    last_calls: list[Any] = field(default_factory=list)
    last_parse_errors: list[str] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    finish_reason: str = "stop"
    termination: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time_s: float = 0.0
    tool_reward: float = 0.0
    tool_metrics: dict[str, float] = field(default_factory=dict)
    instances: dict[str, Any] = field(default_factory=dict)

    def append(
        self,
        ids: list[int],
        logprobs: list[float] | None,
        policy: bool,
        versions: list[tuple[int, int]] | None = None,
    ) -> None:
        """Append policy (mask 1; ``versions``: their ``(num_tokens, policy_version)``
        segments) or observation (mask 0, log-prob 0, version -1) ids."""
        self.response_ids += ids
        self.response_mask += [1 if policy else 0] * len(ids)
        self.response_logprobs += list(logprobs) if (policy and logprobs) else [0.0] * len(ids)
        if ids:
            self.response_versions += versions if policy and versions else [(len(ids), -1)]


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn generation with tool calls in the format of ``rollout.agent.tool_parser``
    (Hermes ``<tool_call>{json}</tool_call>`` by default; see ``postrl.tools.parsers``).

    Args:
        client: rollout client (``generate(prompt_ids, sampling, request_id, trajectory_id)``).
        tokenizer: the policy's HF tokenizer (its chat template renders observations).
        config: :class:`postrl.config.AgentConfig`.
        tools: ``{name: tool}``; default: loaded from ``config.tool_config_path``.
        max_response_length: total response-token budget per trajectory (policy + observation
            ids); default ``max_new_tokens × max_assistant_turns + max_tool_response_length ×
            max_user_turns`` (the trainer's KV sizing).
        max_model_len: the rollout's per-sequence capacity; the budget never lets
            ``prompt + response`` reach it.
        tool_timeout_s: wall-clock limit of one tool call (the executor turns overruns into an
            error observation).
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        config: Any,
        tools: dict[str, Any] | None = None,
        max_response_length: int | None = None,
        max_model_len: int | None = None,
        tool_timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, tokenizer, config, **kwargs)
        from postrl.tools import ToolExecutor, get_tool_parser, load_tools

        if tools is None:
            tools = load_tools(config.tool_config_path) if config.tool_config_path else {}
        self.tools: dict[str, Any] = dict(tools)
        if not self.tools:
            logger.warning(
                "tool_agent loop has no tools (rollout.agent.tool_config_path is empty); "
                "every call will be an error"
            )
        self.parser = get_tool_parser(config.tool_parser)
        self.executor = ToolExecutor(
            self.tools,
            timeout_s=tool_timeout_s,
            max_tool_response_length=config.max_tool_response_length,
        )
        # the tools' schemas type parameter values of XML-style formats (qwen3_coder, glm45)
        typed = "tools" in inspect.signature(self.parser.parse).parameters
        self._parse_kwargs = {"tools": self.executor.schemas()} if typed else {}
        self.delta = ChatDelta(tokenizer)
        self.max_response_length = max_response_length
        self.max_model_len = max_model_len
        self._drift_logged = False

    # ------------------------------------------------------------------ public
    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of the configured tools (for prompts: ``tools=`` of the
        template)."""
        return self.executor.schemas()

    async def run(self, sampling: Any, **row: Any) -> AgentLoopOutput:
        """Run the state machine for one row; tools are released even if generation fails."""
        traj = self._start(sampling, row)
        state = AgentState.PENDING
        try:
            tools_kwargs = (
                (row.get("extra_info") or {}).get("tools_kwargs")
                if isinstance(row.get("extra_info"), dict)
                else None
            )
            if tools_kwargs:
                await self.executor.create(traj.instance_id, tools_kwargs)
            state = AgentState.GENERATING
            while state is not AgentState.TERMINATED:
                if state is AgentState.GENERATING:
                    state = await self._generate(traj, sampling, row)
                else:
                    state = await self._process_tools(traj)
        finally:
            await self._release(traj)
        return self._finish(traj)

    # ------------------------------------------------------------------ states
    def _start(self, sampling: Any, row: dict[str, Any]) -> _Trajectory:
        cfg = self.config
        prompt_ids = [int(t) for t in row["raw_prompt_ids"]]
        budget = self.max_response_length or (
            sampling.max_new_tokens * max(1, cfg.max_assistant_turns)
            + cfg.max_tool_response_length * max(0, cfg.max_user_turns)
        )
        if self.max_model_len:
            budget = min(budget, self.max_model_len - len(prompt_ids) - 1)
        messages = [
            dict(m) for m in (row.get("messages") if row.get("messages") is not None else [])
        ]
        rid = str(row["request_id"])
        return _Trajectory(
            request_id=rid,
            instance_id=f"{rid}-{uuid.uuid4().hex[:8]}",
            prompt_ids=prompt_ids,
            messages=messages,
            budget=budget,
        )

    async def _generate(self, traj: _Trajectory, sampling: Any, row: dict[str, Any]) -> AgentState:
        room = traj.budget - len(traj.response_ids)
        if room < 1:
            traj.finish_reason, traj.termination = "length", "response_budget"
            return AgentState.TERMINATED
        turn = traj.assistant_turns
        sp = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        if turn > 0 and sampling.seed is not None:
            sp = replace(sp, seed=derive_seed(sampling.seed, turn))
        out = await self.client.generate(
            traj.prompt_ids + traj.response_ids,
            sp,
            request_id=f"{traj.request_id}-t{turn}",
            trajectory_id=traj.request_id,
        )
        ids = [int(t) for t in out.token_ids]
        traj.append(ids, out.log_probs, policy=True, versions=token_versions(out, len(ids)))
        traj.last_generated = ids
        traj.assistant_turns += 1
        traj.finish_reason = out.finish_reason
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        content = self.tokenizer.decode(
            ids[: len(ids) - self._eot_len(ids)], skip_special_tokens=False
        )
        traj.assistant_idx.append(len(traj.messages))
        traj.turn_contents.append(ids[: len(ids) - self._eot_len(ids)])
        traj.messages.append({"role": "assistant", "content": content})
        if out.finish_reason != "stop":
            traj.termination = "length" if out.finish_reason == "length" else out.finish_reason
            return AgentState.TERMINATED
        calls, errors = self._parse(text)
        if not calls and not errors:
            traj.termination = "no_tool_call"
            return AgentState.TERMINATED
        if traj.assistant_turns >= self.config.max_assistant_turns:
            traj.termination = "max_assistant_turns"
            return AgentState.TERMINATED
        if traj.user_turns >= self.config.max_user_turns:
            traj.termination = "max_user_turns"
            return AgentState.TERMINATED
        traj.last_calls, traj.last_parse_errors = calls, errors
        return AgentState.PROCESSING_TOOLS

    async def _process_tools(self, traj: _Trajectory) -> AgentState:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._call(traj, c) for c in traj.last_calls))
        traj.tool_time_s += time.perf_counter() - t0
        tool_msgs: list[dict[str, Any]] = []
        limit = self.config.max_tool_response_length
        for err in traj.last_parse_errors:
            traj.tool_errors += 1
            traj.tool_metrics["tool/errors/malformed_call"] = (
                traj.tool_metrics.get("tool/errors/malformed_call", 0.0) + 1
            )
            if len(err) > limit:  # parse errors obey the same cap as tool responses
                err = err[:limit]
                traj.tool_metrics["tool/truncated"] = (
                    traj.tool_metrics.get("tool/truncated", 0.0) + 1
                )
            tool_msgs.append({"role": "tool", "content": err})
        for call, (text, is_error) in zip(traj.last_calls, results, strict=True):
            traj.tool_calls += 1
            traj.tool_errors += int(is_error)
            tool_msgs.append({"role": "tool", "name": _call_name(call), "content": text})
        traj.user_turns += 1
        obs = self.delta.observation(tool_msgs, traj.last_generated)
        if len(traj.response_ids) + len(obs) >= traj.budget:
            traj.finish_reason, traj.termination = "length", "response_budget"
            return AgentState.TERMINATED
        traj.append(obs, None, policy=False)
        traj.messages += tool_msgs
        return AgentState.GENERATING

    # ------------------------------------------------------------------ tools
    def _parse(self, text: str) -> tuple[list[Any], list[str]]:
        """Parsed calls and error-observation texts for malformed ones (never raises)."""
        try:
            res = self.parser.parse(text, **self._parse_kwargs)
        except Exception as e:  # a parser bug must not wedge the trajectory
            logger.warning("tool parser %r failed: %r", self.config.tool_parser, e)
            return [], [f"Error: could not parse tool call ({type(e).__name__}: {e})"]
        return list(res.calls), [str(e) for e in res.errors]

    async def _call(self, traj: _Trajectory, call: Any) -> tuple[str, bool]:
        """Run one call through the safe executor; returns (observation text, is_error).

        A call counts as an error when the executor flags it (``error``), the tool follows the
        ``"Error: ..."`` text convention, or it reports a ``tool/errors/*`` metric.
        """
        res = await self.executor.execute(
            call, instance_id=traj.instance_id, instances=traj.instances
        )
        traj.tool_reward += float(res.reward_delta or 0.0)
        for k, v in (res.metrics or {}).items():
            traj.tool_metrics[k] = traj.tool_metrics.get(k, 0.0) + float(v)
        is_error = (
            bool(res.error)
            or res.text.startswith("Error:")
            or any(k.startswith("tool/errors/") for k in res.metrics or {})
        )
        return res.text, is_error

    async def _release(self, traj: _Trajectory) -> None:
        try:
            traj.tool_reward += float(await self.executor.release(traj.instance_id, traj.instances))
        except Exception as e:
            logger.warning("releasing tools of %s failed: %r", traj.request_id, e)

    # ------------------------------------------------------------------ output
    def _eot_len(self, ids: list[int]) -> int:
        """Number of trailing ids of a turn that are the template's end-of-turn tokens."""
        return len(self.delta.turn_suffix_ids) - len(self.delta.closing(ids))

    def _finish(self, traj: _Trajectory) -> AgentLoopOutput:
        metrics: dict[str, float] = {
            "agent/num_tool_calls": float(traj.tool_calls),
            "agent/tool_errors": float(traj.tool_errors),
            "agent/tool_time_s": traj.tool_time_s,
            "agent/num_assistant_turns": float(traj.assistant_turns),
            **traj.tool_metrics,
        }
        if self.config.check_token_faithfulness:
            metrics.update(self._check_faithfulness(traj))
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids,
            response_ids=traj.response_ids,
            response_mask=traj.response_mask,
            response_logprobs=traj.response_logprobs,
            response_versions=traj.response_versions,
            num_turns=1 + traj.assistant_turns + traj.user_turns,
            finish_reason=traj.finish_reason,
            metrics=metrics,
            extra={
                "messages": traj.messages,
                "tool_reward": traj.tool_reward,
                "termination": traj.termination,
                "tool_metrics": traj.tool_metrics,
            },
        )

    def _check_faithfulness(self, traj: _Trajectory) -> dict[str, float]:
        """Drift metrics of this trajectory (empty without the row's prompt messages).

        ``agent/token_drift_ratio``: against the template of the whole conversation with each
        generated assistant turn spliced in as its *sampled* ids (the template text around them
        tokenised) — the loop's own boundary/observation construction; must be 0.
        ``agent/retokenize_drift_ratio``: against the fully re-tokenised conversation (assistant
        turns decoded to text) — what a re-tokenising pipeline would train on; > 0 when the
        model samples non-canonical or invalid-UTF-8 byte sequences.
        """
        if not traj.assistant_idx or traj.assistant_idx[0] == 0:
            return {}
        actual = traj.prompt_ids + traj.response_ids
        out: dict[str, float] = {}
        for key, spliced in (
            ("agent/token_drift_ratio", True),
            ("agent/retokenize_drift_ratio", False),
        ):
            best: tuple[float, int, list[int]] = (2.0, -1, [])
            for tools in [None, self.tool_schemas] if self.tools else [None]:
                expected = self._expected_ids(traj, tools, spliced)
                ratio, first = token_drift(actual, expected)
                if ratio < best[0]:
                    best = (ratio, first, expected)
                if ratio == 0.0:
                    break
            ratio, first, expected = best
            out[key] = ratio
            if ratio > 0 and spliced and not self._drift_logged:
                self._drift_logged = True
                lo = max(0, first - 16)
                logger.warning(
                    "token drift in %s at position %d (prompt %d tokens): trained ids decode to "
                    "%r, chat template gives %r",
                    traj.request_id,
                    first,
                    len(traj.prompt_ids),
                    self.tokenizer.decode(actual[lo : first + 16], skip_special_tokens=False),
                    self.tokenizer.decode(expected[lo : first + 16], skip_special_tokens=False),
                )
        return out

    def _expected_ids(
        self, traj: _Trajectory, tools: list[dict[str, Any]] | None, spliced: bool
    ) -> list[int]:
        """Token ids of ``apply_chat_template(conversation)`` (see :meth:`_check_faithfulness`)."""
        msgs = [dict(m) for m in traj.messages]
        markers = [f"\x1fPOSTRL_TURN_{k}\x1f" for k in range(len(traj.assistant_idx))]
        if spliced:
            for k, idx in enumerate(traj.assistant_idx):
                msgs[idx]["content"] = markers[k]
        last_is_tool = msgs[-1].get("role") == "tool"
        text = self.delta.render(
            msgs, add_generation_prompt=last_is_tool, **({"tools": tools} if tools else {})
        )
        if spliced:
            expected: list[int] = []
            for k, marker in enumerate(markers):
                head, sep, text = text.partition(marker)
                if not sep:  # the template dropped or rewrote a turn: nothing to splice
                    return expected + self.delta.encode(head)
                expected += self.delta.encode(head) + traj.turn_contents[k]
            expected += self.delta.encode(text)
        else:
            expected = self.delta.encode(text)
        if msgs[-1].get("role") == "assistant":
            closing = self.delta.closing(traj.last_generated)
            if closing and expected[-len(closing) :] == closing:
                expected = expected[: -len(closing)]
        return expected


def _call_name(call: Any) -> str:
    return str(
        getattr(call, "name", None) or (call.get("name") if isinstance(call, dict) else "") or ""
    )
