"""The ``gateway`` agent loop: any program that speaks the OpenAI API is the agent.

Per trajectory the loop opens a session on the manager's :class:`GatewayServer` (one HTTP
server per agent manager, 127.0.0.1 only), writes the row to a JSON file and starts the user's
agent — ``rollout.agent.gateway.command`` in a subprocess or ``rollout.agent.gateway.entrypoint``
awaited in-process — with::

    OPENAI_BASE_URL    http://127.0.0.1:<port>/s/<session>/v1   (this trajectory only)
    OPENAI_API_KEY     a per-trajectory secret (a key reaches only its own trajectory)
    POSTRL_TASK        path of {"messages", "ground_truth", "data_source", "extra_info", "index"}
    POSTRL_REWARD_URL  POST {"reward": r} here to set the trajectory's reward

Every chat completion of the agent is sampled by the rollout fleet and recorded token-exact
(:mod:`postrl.agent.gateway.transcript`); when the agent ends, its transcript becomes the
trajectory — one row per segment, the last segment first (:attr:`AgentLoopOutput.segments`
holds the earlier ones).

Reward, first that applies: the last ``{"reward": r}`` POSTed to ``POSTRL_REWARD_URL``; a last
stdout line ``{"reward": r}`` (command) or a returned number / ``{"reward": r}``
(entrypoint); otherwise the dataset's reward function scores the final assistant message
(``agent_extra["solution_str"]``).

Faults never hang and never lose the prompt: a deadline (``timeout_s``), a crash, a non-zero
exit, a garbage request, too many requests or a context overflow give a trajectory whose every
token is masked (``response_mask`` 0; the reward 0), its reason in the log and in
``agent_extra["gateway_failure"]``, counted by ``agent/gateway_failures``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import tempfile
from typing import Any

from postrl.agent.base import AgentLoopBase, AgentLoopOutput
from postrl.agent.gateway.runner import (
    AgentRun,
    load_entrypoint,
    reward_from_stdout,
    run_command,
    run_entrypoint,
)
from postrl.agent.gateway.server import GatewayServer
from postrl.agent.gateway.session import GatewaySession
from postrl.agent.gateway.transcript import Transcript
from postrl.agent.tool_loop import ChatDelta

logger = logging.getLogger(__name__)

__all__ = ["GatewayAgentLoop", "check_gateway_config"]

_LOG_TAIL = 800


def check_gateway_config(agent: Any) -> list[str]:
    """Problems with ``rollout.agent.gateway`` of an :class:`~postrl.config.AgentConfig`
    (field, value, why, fix); empty: fine. Declared as the loop's ``config_errors``, so
    ``postrl train`` reports them at startup."""
    gw = agent.gateway
    errors = []
    if bool(gw.command) == bool(gw.entrypoint):
        errors.append(
            "rollout.agent.gateway: set exactly one of command (a shell command, e.g. "
            "command='python my_agent.py') and entrypoint ('module:async_function'); got "
            f"command={gw.command!r}, entrypoint={gw.entrypoint!r}"
        )
    for name in ("timeout_s", "max_concurrency", "max_requests", "output_limit_bytes"):
        if getattr(gw, name) <= 0:
            errors.append(f"rollout.agent.gateway.{name}={getattr(gw, name)!r} must be > 0")
    return errors


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


class GatewayAgentLoop(AgentLoopBase):
    """Bring-your-own-agent loop (module docstring); registered as ``gateway`` in
    ``postrl.agent.base.AGENT_LOOPS``.

    Args:
        client: the rollout client.
        tokenizer: the policy tokenizer (renders prompts, decodes replies).
        config: :class:`postrl.config.AgentConfig` (``gateway``, ``tool_parser``).
        max_model_len: the rollout's per-sequence capacity: a segment never reaches it
            (a request that would is refused and the trajectory fails: ``context_overflow``).
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        config: Any,
        max_model_len: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, tokenizer, config, **kwargs)
        self.gw = config.gateway
        errors = check_gateway_config(config)
        if errors:
            raise ValueError("; ".join(errors))
        from postrl.tools import get_tool_parser

        self.parser = get_tool_parser(config.tool_parser) if config.tool_parser else None
        self.fn = load_entrypoint(self.gw.entrypoint) if self.gw.entrypoint else None
        self.delta = ChatDelta(tokenizer)
        self.max_model_len = max_model_len or None
        self.server = GatewayServer()
        self._tmp = tempfile.TemporaryDirectory(prefix="postrl-gateway-")
        self._sems: dict[int, asyncio.Semaphore] = {}

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        key = id(loop)
        if key not in self._sems:
            self._sems = {key: asyncio.Semaphore(self.gw.max_concurrency)}
        return self._sems[key]

    async def run(self, sampling: Any, **row: Any) -> AgentLoopOutput:
        """Run the agent for ``row`` (at most ``max_concurrency`` at once)."""
        await self.server.ensure_started()
        async with self._semaphore():
            return await self._run_one(sampling, row)

    async def aclose(self) -> None:
        """Stop the gateway server and remove the task files."""
        await self.server.close()
        self._tmp.cleanup()

    async def _run_one(self, sampling: Any, row: dict[str, Any]) -> AgentLoopOutput:
        rid = str(row["request_id"])
        session = GatewaySession(
            sid=secrets.token_urlsafe(16),
            key="sk-postrl-" + secrets.token_urlsafe(24),
            client=self.client,
            tokenizer=self.tokenizer,
            transcript=Transcript(self.delta, self.max_model_len, self.gw.render_tools),
            sampling=sampling,
            request_id=rid,
            parser=self.parser,
            max_requests=self.gw.max_requests,
        )
        task = {
            k: row.get(k)
            for k in ("messages", "ground_truth", "data_source", "extra_info", "index")
        }
        path = os.path.join(self._tmp.name, f"{session.sid}.json")
        with open(path, "w") as f:
            json.dump(task, f, default=_jsonable)
        self.server.add(session)
        base_url, reward_url = self.server.base_url(session), self.server.reward_url(session)
        try:
            if self.fn is not None:
                kwargs = dict(
                    base_url=base_url,
                    api_key=session.key,
                    task=json.loads(json.dumps(task, default=_jsonable)),
                    task_path=path,
                    reward_url=reward_url,
                )
                run = await run_entrypoint(self.fn, kwargs, self.gw.timeout_s)
            else:
                env = {
                    "OPENAI_BASE_URL": base_url,
                    "OPENAI_API_KEY": session.key,
                    "POSTRL_TASK": path,
                    "POSTRL_REWARD_URL": reward_url,
                }
                run = await run_command(
                    self.gw.command, env, self.gw.timeout_s, self.gw.output_limit_bytes
                )
        finally:
            self.server.remove(session)
            os.unlink(path)
        return self._output(session, run, row)

    def _reward(self, session: GatewaySession, run: AgentRun) -> float | None:
        if session.rewards:
            return session.rewards[-1]
        if self.fn is None:
            return reward_from_stdout(run.stdout)
        r = run.result
        if isinstance(r, dict):
            r = r.get("reward")
        if isinstance(r, (int, float)) and not isinstance(r, bool) and abs(r) < float("inf"):
            return float(r)
        return None

    def _output(
        self, session: GatewaySession, run: AgentRun, row: dict[str, Any]
    ) -> AgentLoopOutput:
        tr = session.transcript
        segs = [s for s in tr.segments if s.replies]
        failure = session.failure or run.error or ("no_requests" if not segs else "")
        reward = None if failure else self._reward(session, run)
        metrics = {
            "agent/gateway_failures": float(bool(failure)),
            "agent/gateway_segments": float(len(segs)),
            "agent/gateway_retokenized": float(tr.new_segments),
            "agent/gateway_requests": float(session.requests),
            "agent/gateway_agent_reward": float(reward is not None),
            "agent/gateway_output_dropped_bytes": float(run.dropped_bytes),
        }
        extra: dict[str, Any] = {"solution_str": session.final_text or ""}
        if failure:
            self._log_failure(session, run, failure)
            extra.update(reward=0.0, gateway_failure=failure)
        elif reward is not None:
            extra["reward"] = reward
        outs = [s.output("stop") for s in segs]
        if not outs:  # nothing sampled: the prompt still reaches the batch, fully masked
            eos = self.tokenizer.eos_token_id
            outs = [AgentLoopOutput(list(row["raw_prompt_ids"]), [eos], [0], [0.0], num_turns=1)]
        for o in outs:
            if failure:
                o.response_mask = [0] * len(o.response_ids)
                o.finish_reason = "abort" if run.timed_out else "stop"
            o.extra = dict(extra)
        main = outs[-1]
        main.metrics = metrics
        main.num_turns = sum(o.num_turns for o in outs)
        main.segments = outs[:-1]
        return main

    def _log_failure(self, session: GatewaySession, run: AgentRun, failure: str) -> None:
        logger.warning(
            "gateway trajectory %s failed (%s) after %d requests; stderr tail: %r; stdout tail: %r",
            session.request_id,
            failure,
            session.requests,
            run.stderr[-_LOG_TAIL:],
            run.stdout[-_LOG_TAIL:],
        )
