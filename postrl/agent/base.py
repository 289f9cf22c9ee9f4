"""Agent loops: the interface, the registry and the single-turn loop.

An agent loop turns one dataset row into one trajectory by talking token-in/token-out to the
rollout client. It returns the exact ids the policy saw (``prompt_ids``), the ids it produced
plus any observation ids spliced in (``response_ids``), and a ``response_mask`` that is 1 on
policy tokens and 0 on observation tokens — so nothing is ever re-tokenised between rollout
and training.

Add a loop::

    @register_agent_loop("my_loop")
    class MyLoop(AgentLoopBase):
        async def run(self, sampling, **row) -> AgentLoopOutput: ...

and select it per row (``agent_name`` column) or with ``rollout.agent.default_agent_loop``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from postrl.registry import Registry

__all__ = [
    "AGENT_LOOPS",
    "AgentLoopBase",
    "AgentLoopOutput",
    "RolloutClientLike",
    "SingleTurnAgentLoop",
    "register_agent_loop",
    "token_versions",
]

T = TypeVar("T")

AGENT_LOOPS: Registry[type] = Registry("agent loop")
AGENT_LOOPS.add_lazy("tool_agent", "postrl.agent.tool_loop:ToolAgentLoop")
AGENT_LOOPS.add_lazy(
    "gateway",
    "postrl.agent.gateway.loop:GatewayAgentLoop",
    segments=True,
    config_errors="postrl.agent.gateway.loop:check_gateway_config",
)
AGENT_LOOPS.add_lazy("env_agent", "postrl.agent.env_loop:EnvAgentLoop")
AGENT_LOOPS.add_lazy(
    "verifiers",
    "postrl.agent.verifiers.loop:VerifiersAgentLoop",
    segments=True,
    config_errors="postrl.agent.verifiers.loop:check_verifiers_config",
)


def register_agent_loop(name: str, **meta: Any) -> Callable[[T], T]:
    """Class decorator registering an :class:`AgentLoopBase` subclass under ``name``."""
    return AGENT_LOOPS.register(name, override=name in ("tool_agent", "env_agent"), **meta)


class RolloutClientLike(Protocol):
    """What an agent loop needs from the rollout side (``postrl.rollout`` client)."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Any,
        request_id: str,
        trajectory_id: str | None = None,
    ) -> Any:
        """Return an object with ``token_ids``, ``log_probs`` and ``finish_reason``."""
        ...


@dataclass
class AgentLoopOutput:
    """One finished trajectory, token-exact.

    ``response_mask[i]`` is 1 where ``response_ids[i]`` was sampled by the policy (trained on)
    and 0 on observation/tool tokens. ``response_logprobs`` holds the rollout log-prob of policy
    tokens (0.0 on observation tokens). ``response_versions`` is the policy version that produced
    each response token, run-length encoded as ``(num_tokens, policy_version)`` segments that
    cover ``response_ids`` in order (a trajectory resumed after a weight update, or a multi-turn
    one spanning updates, has several); observation tokens carry version ``-1`` (no policy
    produced them). ``None``: the loop does not know (every token gets ``-1``).

    ``segments``: earlier trajectories of the same run that do not share this one's context
    (a ``gateway`` agent that rewrote its history). Each becomes a batch row of its own with
    this row's dataset columns, ``uid``, ``sample_index`` and ``agent_extra``; it takes this
    row's reward and sequence advantage and is not a sample of its group's baseline (the
    batch's ``segment`` column: 0 on this row, 1, 2, ... on its segments' rows).

    ``extra["reward"]``, when present, is the trajectory's own score (a number, or a dict with
    ``score`` and per-sample extras such as ``acc``, as a reward function returns; or
    ``{"error": text}`` to fail the sample): the reward stage uses it and calls no reward
    function for the row (environments, agents that report their reward).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int = 1
    finish_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    response_versions: list[tuple[int, int]] | None = None
    segments: list[AgentLoopOutput] = field(default_factory=list)


def token_versions(out: Any, num_tokens: int) -> list[tuple[int, int]]:
    """``(num_tokens, policy_version)`` segments of one ``generate`` result's tokens.

    Reads ``out.versions`` (:class:`postrl.rollout.TokenOutput`: one segment per resumed
    request); empty segments are dropped. A client that reports no versions gives one segment
    of version ``-1`` (unknown). Raises ``ValueError`` when the segments do not cover exactly
    ``num_tokens`` tokens (a client bug: the versions would land on the wrong tokens).
    """
    segs = [(int(k), int(v)) for k, v in (getattr(out, "versions", None) or ()) if int(k) > 0]
    if not segs:
        return [(num_tokens, -1)] if num_tokens else []
    total = sum(k for k, _ in segs)
    if total != num_tokens:
        raise ValueError(
            f"the rollout client reported policy versions for {total} tokens but returned "
            f"{num_tokens}: TokenOutput.versions must be (num_tokens, version) segments covering "
            "token_ids exactly"
        )
    return segs


class AgentLoopBase(ABC):
    """Base of all agent loops.

    Args:
        client: rollout client (``generate(prompt_ids, sampling, request_id, trajectory_id)``).
        tokenizer: the policy's HF tokenizer.
        config: :class:`postrl.config.AgentConfig`.
    """

    def __init__(
        self, client: RolloutClientLike, tokenizer: Any, config: Any, **kwargs: Any
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config

    @abstractmethod
    async def run(self, sampling: Any, **row: Any) -> AgentLoopOutput:
        """Produce one trajectory for ``row`` (keys: raw_prompt_ids, messages, data_source,
        ground_truth, extra_info, request_id, ...)."""


@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoopBase):
    """One generation from the chat-templated prompt; every response token is trained on."""

    async def run(self, sampling: Any, **row: Any) -> AgentLoopOutput:
        prompt_ids = list(row["raw_prompt_ids"])
        out = await self.client.generate(
            prompt_ids, sampling, request_id=row["request_id"], trajectory_id=row["request_id"]
        )
        n = len(out.token_ids)
        logprobs = list(out.log_probs) if out.log_probs else [0.0] * n
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=list(out.token_ids),
            response_mask=[1] * n,
            response_logprobs=logprobs,
            num_turns=2,
            finish_reason=out.finish_reason,
            response_versions=token_versions(out, n),
        )
