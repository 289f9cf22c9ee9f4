"""The environment agent loop (``env_agent``): play a gym-style text environment turn by turn.

One trajectory is one episode (RAGEN's StarPO setting)::

    env = make_env(extra_info["env"], **extra_info.get("env_kwargs", {}))
    obs = env.reset(extra_info["seed"])            # the row's prompt ends with this observation
    repeat:  generate ──► action text ──► env.step(action) ──► (obs, r_t, done)
             until done, ``rollout.agent.max_assistant_turns`` turns, a truncated turn, or the
             response budget

Token-in/token-out as in the tool loop (:class:`~postrl.agent.tool_loop.ChatDelta`): the
prompt of turn *k* is the prompt ids followed by every id so far exactly as sampled; only the
observations are tokenised, once, as the chat template's delta of a ``user`` message, appended
with ``response_mask = 0``, log-prob 0 and policy version -1. Observations longer than
``rollout.agent.max_tool_response_length`` characters are cut to it (the KV sizing assumes it).

Per-turn rewards are kept (``extra["turn_rewards"]``) and the trajectory is scored with its
return ``G = Σ_t γ^t r_t`` (``rollout.agent.env.gamma``; 1.0 = the sum), handed to the reward
stage as the loop's own score (``extra["reward"] = {"score": G, "acc": success}``: no reward
function is called; validation reports ``acc`` = success). The whole multi-turn response is
optimised as one sequence with that return (trajectory-level, as StarPO).

An environment that raises in ``reset``/``step`` fails only its trajectory: the reward stage
marks it failed (``reward/failed/exception``, masked, excluded from its group's baseline) and
the error is logged with the row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from postrl.agent.base import AgentLoopBase, AgentLoopOutput, register_agent_loop, token_versions
from postrl.agent.manager import derive_seed
from postrl.agent.tool_loop import ChatDelta
from postrl.envs import discounted_return, make_env

logger = logging.getLogger(__name__)

__all__ = ["EnvAgentLoop"]


@dataclass
class _Episode:
    """Mutable state of one episode (private to :class:`EnvAgentLoop`)."""

    request_id: str
    prompt_ids: list[int]
    budget: int
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[tuple[int, int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    observations: int = 0
    finish_reason: str = "stop"
    termination: str = ""
    error: str | None = None


@register_agent_loop("env_agent")
class EnvAgentLoop(AgentLoopBase):
    """Play the row's environment (``extra_info.env`` / ``seed`` / ``env_kwargs``).

    Args:
        client: rollout client (``generate(prompt_ids, sampling, request_id, trajectory_id)``).
        tokenizer: the policy's HF tokenizer (its chat template renders observations).
        config: :class:`postrl.config.AgentConfig` (``max_assistant_turns``,
            ``max_tool_response_length``, ``env.gamma``).
        max_response_length: total response-token budget (policy + observation ids); default
            ``max_new_tokens × max_assistant_turns + max_tool_response_length ×
            (max_assistant_turns - 1)``.
        max_model_len: the rollout's per-sequence capacity; the budget never lets
            ``prompt + response`` reach it.
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        config: Any,
        max_response_length: int | None = None,
        max_model_len: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, tokenizer, config, **kwargs)
        self.delta = ChatDelta(tokenizer)
        self.max_response_length = max_response_length
        self.max_model_len = max_model_len
        env_cfg = getattr(config, "env", None)
        self.gamma = float(getattr(env_cfg, "gamma", 1.0))

    async def run(self, sampling: Any, **row: Any) -> AgentLoopOutput:
        """Play one episode of the row's environment; see the module docstring."""
        ep = self._start(sampling, row)
        env = None
        try:
            env = self._reset(row)
            while await self._turn(ep, env, sampling):
                pass
        except _EnvError as e:
            ep.error = str(e)
            ep.termination = "env_error"
            logger.warning("environment of %s failed: %s", ep.request_id, e)
        return self._finish(ep, env if ep.error is None else None)

    # ------------------------------------------------------------------ episode
    def _start(self, sampling: Any, row: dict[str, Any]) -> _Episode:
        cfg = self.config
        prompt_ids = [int(t) for t in row["raw_prompt_ids"]]
        turns = max(1, cfg.max_assistant_turns)
        budget = self.max_response_length or (
            sampling.max_new_tokens * turns + cfg.max_tool_response_length * (turns - 1)
        )
        if self.max_model_len:
            budget = min(budget, self.max_model_len - len(prompt_ids) - 1)
        messages = [dict(m) for m in (row.get("messages") or [])]
        return _Episode(str(row["request_id"]), prompt_ids, budget, messages=messages)

    def _reset(self, row: dict[str, Any]) -> Any:
        info = row.get("extra_info")
        where = f"row {row.get('index')} ({row.get('data_source')})"
        if not isinstance(info, dict) or "env" not in info or "seed" not in info:
            raise ValueError(
                f"{where}: the env_agent loop needs extra_info.env (an environment name) and "
                "extra_info.seed; write rows with `postrl data <env> ...` (postrl.envs.env_rows)"
            )
        env = make_env(str(info["env"]), **dict(info.get("env_kwargs") or {}))
        try:
            obs = env.reset(int(info["seed"]))
        except Exception as e:
            raise _EnvError(f"{type(env).__name__}.reset({info['seed']}) raised {e!r}") from e
        last = row["messages"][-1].get("content", "") if row.get("messages") else None
        if last is not None and not str(last).endswith(obs):
            raise ValueError(
                f"{where}: the prompt does not end with the first observation of "
                f"{info['env']!r} at seed {info['seed']} ({obs!r}); regenerate the rows with "
                "`postrl data` or put reset(seed)'s observation last in the prompt"
            )
        return env

    async def _turn(self, ep: _Episode, env: Any, sampling: Any) -> bool:
        """One assistant turn and the environment's answer; False when the episode ends."""
        room = ep.budget - len(ep.response_ids)
        if room < 1:
            ep.finish_reason, ep.termination = "length", "response_budget"
            return False
        sp = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        if ep.turns > 0 and sampling.seed is not None:
            sp = replace(sp, seed=derive_seed(sampling.seed, ep.turns))
        out = await self.client.generate(
            ep.prompt_ids + ep.response_ids,
            sp,
            request_id=f"{ep.request_id}-t{ep.turns}",
            trajectory_id=ep.request_id,
        )
        ids = [int(t) for t in out.token_ids]
        self._append(ep, ids, out.log_probs, token_versions(out, len(ids)))
        ep.turns += 1
        ep.finish_reason = out.finish_reason
        keep = len(ids) - (len(self.delta.turn_suffix_ids) - len(self.delta.closing(ids)))
        action = self.tokenizer.decode(ids[:keep], skip_special_tokens=False)
        ep.messages.append({"role": "assistant", "content": action})
        if out.finish_reason != "stop":
            ep.termination = "length" if out.finish_reason == "length" else out.finish_reason
            return False
        try:
            obs, reward, done = env.step(action)
        except Exception as e:
            raise _EnvError(f"{type(env).__name__}.step({action!r}) raised {e!r}") from e
        ep.rewards.append(float(reward))
        if done:
            ep.termination = "done"
            return False
        if ep.turns >= self.config.max_assistant_turns:
            ep.termination = "max_assistant_turns"
            return False
        msg = {"role": "user", "content": str(obs)[: self.config.max_tool_response_length]}
        obs_ids = self.delta.observation([msg], ids)
        if len(ep.response_ids) + len(obs_ids) >= ep.budget:
            ep.finish_reason, ep.termination = "length", "response_budget"
            return False
        self._append(ep, obs_ids, None, None)
        ep.messages.append(msg)
        ep.observations += 1
        return True

    @staticmethod
    def _append(
        ep: _Episode,
        ids: list[int],
        logprobs: Any,
        versions: list[tuple[int, int]] | None,
    ) -> None:
        """Policy ids (``versions`` given: mask 1) or observation ids (mask 0, log-prob 0,
        version -1)."""
        policy = versions is not None
        ep.response_ids += ids
        ep.response_mask += [int(policy)] * len(ids)
        ep.response_logprobs += list(logprobs) if policy and logprobs else [0.0] * len(ids)
        if ids:
            ep.response_versions += versions if policy and versions else [(len(ids), -1)]

    def _finish(self, ep: _Episode, env: Any) -> AgentLoopOutput:
        success = bool(getattr(env, "success", False)) if env is not None else False
        ret = discounted_return(ep.rewards, self.gamma)
        reward: dict[str, Any] = (
            {"error": ep.error} if ep.error is not None else {"score": ret, "acc": float(success)}
        )
        metrics = {
            "agent/env/return": ret,
            "agent/env/success": float(success),
            "agent/env/turns": float(ep.turns),
            "agent/env/errors": float(ep.error is not None),
        }
        return AgentLoopOutput(
            prompt_ids=ep.prompt_ids,
            response_ids=ep.response_ids,
            response_mask=ep.response_mask,
            response_logprobs=ep.response_logprobs,
            response_versions=ep.response_versions,
            num_turns=1 + ep.turns + ep.observations,
            finish_reason=ep.finish_reason,
            metrics=metrics,
            extra={
                "reward": reward,
                "turn_rewards": list(ep.rewards),
                "termination": ep.termination,
                "messages": ep.messages,
            },
        )


class _EnvError(RuntimeError):
    """The environment raised; the trajectory is failed (masked), not the run."""
