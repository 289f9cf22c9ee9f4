"""The ``verifiers`` agent loop: a ``verifiers`` environment's episodes are the trajectories.

A verifiers environment (PyPI ``verifiers`` 0.4, API ``verifiers.v1``: a ``Taskset`` of
``Task``s scored by ``@vf.reward`` methods, played by an ``Env`` whose harness runs each
rollout) runs unchanged in a worker process of its own, in the verifiers venv
(:mod:`postrl.agent.verifiers.worker`; verifiers pins ``openai<3`` and brings its own stack).
Per agent manager the loop keeps one worker (started on first use, restarted if it dies) and one
gateway server; per trajectory it opens a :class:`~postrl.agent.gateway.token_session.TokenSession`
and asks the worker to run one episode (``env.slots(task, 1)`` + ``env.run_slot``) with
verifiers' training client (``TrainClientConfig``: it renders the prompt with a renderer and
samples through the gateway's ``/t/inference/v1/generate``, served by the rollout fleet).

Each branch of each trainable trace (``trace.branches``: ``token_ids``, ``sampled_mask``,
``logprobs``) becomes a trajectory row: prompt = the ids before the first sampled token,
response = the rest, ``response_mask`` = ``sampled_mask``, log-probs as sampled, policy
versions from the session's records of the calls. Every sampled run is checked against what
the fleet really sampled for that prompt (:meth:`TokenSession.match`); positions that match no
call are counted in ``agent/verifiers_unmatched_tokens`` (a renderer that re-rendered history),
they still train with the log-probs the trace reports. The last trainable branch is the
trajectory; the others are its ``segments`` (they take its reward and group).

Reward: the trace's (``trace.reward``: the weighted sum of its ``@vf.reward`` signals); with no
trainable trace, or a failed episode (an error on the episode or the trace, a deadline, a worker
that died), the trajectory is masked (every token ``response_mask`` 0, reward 0), its reason in
the log and in ``agent_extra["verifiers_failure"]``, counted by ``agent/verifiers_failures``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
from pathlib import Path
from typing import Any

from postrl.agent.base import AgentLoopBase, AgentLoopOutput
from postrl.agent.gateway.server import GatewayServer
from postrl.agent.gateway.token_session import ROUTE_KEY, TokenSession
from postrl.agent.verifiers.process import WorkerError, WorkerProcess

logger = logging.getLogger(__name__)

__all__ = [
    "VerifiersAgentLoop",
    "check_verifiers_config",
    "dataset_rows",
    "list_tasks",
    "verifiers_python",
    "worker_init",
]

DEFAULT_PYTHON = ".venv-verifiers/bin/python"
DEFAULT_ENV: dict[str, Any] = {
    "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
}
API_KEY_VAR = "POSTRL_VERIFIERS_API_KEY"
"""The worker's variable holding the token route's key (verifiers' subprocess runtime keeps
every ``*API_KEY*`` variable away from the harness programs it starts)."""
_TAIL = 1500


def verifiers_python(configured: str = "") -> str | None:
    """The verifiers venv's interpreter: ``configured``, else ``.venv-verifiers/bin/python`` in
    the working directory or beside the source tree; None when there is none."""
    if configured:
        return configured
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        cand = root / DEFAULT_PYTHON
        if cand.exists():
            return str(cand)
    return None


def check_verifiers_config(agent: Any) -> list[str]:
    """Problems with ``rollout.agent.verifiers`` (field, value, why, fix); empty: fine.
    Declared as the loop's ``config_errors``, so ``postrl train`` reports them at startup."""
    vf = agent.verifiers
    errors = []
    if not vf.taskset:
        errors.append(
            "rollout.agent.verifiers.taskset is empty: name the verifiers taskset module, e.g. "
            "rollout.agent.verifiers.taskset=my_env (importable by the worker: add its folder "
            "to rollout.agent.verifiers.python_path)"
        )
    py = verifiers_python(vf.python)
    if py is None:
        errors.append(
            "rollout.agent.verifiers.python is empty and there is no "
            f"{DEFAULT_PYTHON}: run `make verifiers-venv` (verifiers 0.4 in a venv of its own), "
            "or point rollout.agent.verifiers.python at a python that has verifiers installed"
        )
    elif not Path(py).exists():
        errors.append(f"rollout.agent.verifiers.python={py!r} does not exist")
    for name in ("timeout_s", "startup_timeout_s", "max_concurrency", "max_requests"):
        if getattr(vf, name) <= 0:
            errors.append(f"rollout.agent.verifiers.{name}={getattr(vf, name)!r} must be > 0")
    if not isinstance(vf.renderer, dict) or "name" not in vf.renderer:
        errors.append(
            f"rollout.agent.verifiers.renderer={vf.renderer!r} must be a renderers config "
            "with a name, e.g. {name: default, tool_parser: qwen3}"
        )
    return errors


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def worker_init(vf: Any, model_path: str, base_url: str) -> dict[str, Any]:
    """The worker's ``init`` message for ``rollout.agent.verifiers`` config ``vf``: the
    environment config and the training client aimed at the token route ``base_url``."""
    env = _merge(_merge(DEFAULT_ENV, dict(vf.env)), {"taskset": {"id": vf.taskset}})
    client = {
        "type": "train",
        "base_url": base_url,
        "api_key_var": API_KEY_VAR,
        "renderer": dict(vf.renderer),
        "renderer_model_name": model_path,
    }
    return {"op": "init", "env": env, "client": client, "model": "postrl"}


def list_tasks(vf: Any) -> list[dict[str, Any]]:
    """The tasks of ``rollout.agent.verifiers`` config ``vf``'s taskset (``idx``, ``prompt``,
    ``system_prompt``), read by starting a worker (blocking; for ``postrl data verifiers``)."""
    from types import SimpleNamespace

    async def go() -> list[dict[str, Any]]:
        loop = VerifiersAgentLoop(None, None, SimpleNamespace(verifiers=vf))
        try:
            return await loop.tasks()
        finally:
            await loop.aclose()

    return asyncio.run(go())


def dataset_rows(tasks: list[dict[str, Any]], taskset: str) -> list[dict[str, Any]]:
    """verl-schema rows, one per task (``extra_info.verifiers_task_idx``, ``agent_name``
    ``verifiers``); ``prompt`` holds the task's messages (the row's prompt for length checks and
    logs — the environment renders its own)."""
    rows = []
    for t in tasks:
        p = t.get("prompt")
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p or [])
        if t.get("system_prompt"):
            msgs = [{"role": "system", "content": t["system_prompt"]}, *msgs]
        rows.append(
            {
                "data_source": f"verifiers/{taskset}",
                "prompt": msgs or [{"role": "user", "content": ""}],
                "ability": "verifiers",
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"verifiers_task_idx": int(t["idx"])},
                "agent_name": "verifiers",
            }
        )
    return rows


class VerifiersAgentLoop(AgentLoopBase):
    """Run a verifiers environment's episodes as trajectories (module docstring); registered
    as ``verifiers`` in ``postrl.agent.base.AGENT_LOOPS``.

    Args:
        client: the rollout client.
        tokenizer: the policy tokenizer (its ``name_or_path`` is the renderer's model).
        config: :class:`postrl.config.AgentConfig` (``verifiers``).
        max_model_len: the rollout's per-sequence capacity (served in ``/t/v1/models``; a call
            that leaves no room fails the trajectory: ``context_overflow``).
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
        self.vf = config.verifiers
        errors = check_verifiers_config(config)
        if errors:
            raise ValueError("; ".join(errors))
        self.python = verifiers_python(self.vf.python) or ""
        self.max_model_len = max_model_len or None
        self.server = GatewayServer(max_model_len=self.max_model_len)
        self.key = "sk-postrl-" + secrets.token_urlsafe(24)
        self.worker: WorkerProcess | None = None
        self._worker_loop = 0
        self._ever_ready = False
        self._start_lock: asyncio.Lock | None = None
        self._sems: dict[int, asyncio.Semaphore] = {}

    def _semaphore(self) -> asyncio.Semaphore:
        key = id(asyncio.get_running_loop())
        if key not in self._sems:
            self._sems = {key: asyncio.Semaphore(self.vf.max_concurrency)}
            self._start_lock = asyncio.Lock()
        return self._sems[key]

    async def _worker(self) -> WorkerProcess:
        assert self._start_lock is not None
        async with self._start_lock:
            here = id(asyncio.get_running_loop())
            if self.worker is not None and self._worker_loop != here:
                self.worker.kill()  # its pipes belong to another event loop
                self.worker = None
            if self.worker is not None and self.worker.alive:
                return self.worker
            if self.worker is not None:
                logger.warning("the verifiers worker died; starting a new one")
                await self.worker.close()
            # absolute: verifiers starts harness programs and MCP tool servers in work dirs
            # of their own, where a relative entry would point nowhere
            dirs = [str(Path(p).resolve()) for p in self.vf.python_path]
            path = os.pathsep.join([*dirs, *filter(None, [os.environ.get("PYTHONPATH", "")])])
            # the venv's bin first: verifiers finds its `uv` there (for the harness's script)
            bin_dir = str(Path(self.python).parent)
            env = {
                "PYTHONPATH": path,
                API_KEY_VAR: self.key,
                "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            }
            model = str(getattr(self.tokenizer, "name_or_path", "") or "")
            init = worker_init(self.vf, model, self.server.token_base_url)
            worker = WorkerProcess(self.python, env, init)
            try:
                ready = await worker.start(self.vf.startup_timeout_s)
            except WorkerError as e:
                if self._ever_ready:  # it worked before: this trajectory fails, the run goes on
                    raise
                # never started: the environment or the venv is broken; stop the run, loudly
                raise RuntimeError(
                    f"the verifiers worker for taskset {self.vf.taskset!r} could not start "
                    "(check rollout.agent.verifiers.taskset / python_path / python / env): "
                    f"{e}"
                ) from e
            self._ever_ready = True
            logger.info(
                "verifiers worker ready: taskset %s (%d tasks), verifiers %s",
                ready.get("taskset"),
                ready.get("num_tasks"),
                ready.get("verifiers"),
            )
            self.worker, self._worker_loop = worker, here
            return worker

    async def run(self, sampling: Any, **row: Any) -> AgentLoopOutput:
        """Run one episode for ``row`` (at most ``max_concurrency`` at once)."""
        await self.server.ensure_started()
        async with self._semaphore():
            return await self._run_one(sampling, row)

    async def tasks(self) -> list[dict[str, Any]]:
        """The taskset's tasks as the worker lists them (``idx``, ``prompt``,
        ``system_prompt``): what ``postrl data verifiers`` writes rows from."""
        await self.server.ensure_started()
        self._semaphore()
        worker = await self._worker()
        reply = await worker.request({"op": "tasks"}, self.vf.startup_timeout_s)
        return list(reply["tasks"])

    async def aclose(self) -> None:
        """Stop the worker (and everything it started) and the gateway server."""
        if self.worker is not None:
            await self.worker.close()
            self.worker = None
        await self.server.close()

    async def _run_one(self, sampling: Any, row: dict[str, Any]) -> AgentLoopOutput:
        rid = str(row["request_id"])
        session = TokenSession(
            sid=secrets.token_urlsafe(16),
            key=self.key,
            client=self.client,
            sampling=sampling,
            request_id=rid,
            max_requests=self.vf.max_requests,
            max_model_len=self.max_model_len,
        )
        extra = row.get("extra_info") or {}
        msg: dict[str, Any] = {
            "op": "run",
            "task": extra.get("verifiers_task"),
            "task_idx": extra.get("verifiers_task_idx"),
            "sampling": {
                "temperature": float(sampling.temperature),
                "top_p": float(sampling.top_p),
                "max_tokens": int(sampling.max_new_tokens),
                "extra_args": {ROUTE_KEY: session.sid},
            },
        }
        failure, result = "", None
        if msg["task"] is None and msg["task_idx"] is None:
            failure = "no_task"
            logger.warning(
                "trajectory %s: the row names no verifiers task: set extra_info."
                "verifiers_task_idx (postrl data verifiers writes it) or extra_info."
                "verifiers_task",
                rid,
            )
        else:
            self.server.add_token_session(session)
            try:
                worker = await self._worker()
                result = await worker.request(msg, self.vf.timeout_s)
            except TimeoutError:
                failure = "timeout"
            except WorkerError as e:
                failure = "worker_error"
                logger.warning("verifiers trajectory %s: %s", rid, str(e)[-_TAIL:])
            finally:
                self.server.remove_token_session(session)
        return self._output(session, result, failure, row)

    def _output(
        self,
        session: TokenSession,
        result: dict[str, Any] | None,
        failure: str,
        row: dict[str, Any],
    ) -> AgentLoopOutput:
        outs: list[AgentLoopOutput] = []
        reward, unmatched, skipped, traces = None, 0, 0, 0
        if result is not None:
            errors = list(result.get("errors") or [])
            for tr in result.get("traces") or []:
                traces += 1
                if not tr.get("trainable", True):
                    skipped += len(tr.get("branches") or [])
                    continue
                errors += tr.get("errors") or []
                for br in tr.get("branches") or []:
                    out = self._branch(session, br) if br.get("trainable", True) else None
                    if out is None:
                        skipped += 1
                        continue
                    unmatched += int(out.metrics.pop("unmatched"))
                    outs.append(out)
                    reward = tr.get("reward")
            if not result.get("ok") or errors:
                failure = failure or "episode_error"
                logger.warning(
                    "verifiers trajectory %s failed: %s",
                    session.request_id,
                    "; ".join(errors)[-_TAIL:],
                )
            elif not outs:
                failure = "no_trainable_branch"
            elif not isinstance(reward, (int, float)) or not math.isfinite(reward):
                failure = "bad_reward"
        failure = session.failure or failure
        metrics = {
            "agent/verifiers_failures": float(bool(failure)),
            "agent/verifiers_branches": float(len(outs)),
            "agent/verifiers_traces": float(traces),
            "agent/verifiers_skipped_branches": float(skipped),
            "agent/verifiers_unmatched_tokens": float(unmatched),
            "agent/verifiers_requests": float(session.requests),
        }
        extra: dict[str, Any] = {"reward": 0.0 if failure else float(reward)}  # type: ignore[arg-type]
        if failure:
            extra["verifiers_failure"] = failure
        if not outs:  # nothing sampled: the prompt still reaches the batch, fully masked
            eos = self.tokenizer.eos_token_id
            outs = [AgentLoopOutput(list(row["raw_prompt_ids"]), [eos], [0], [0.0], num_turns=1)]
        for o in outs:
            if failure:
                o.response_mask = [0] * len(o.response_ids)
                o.finish_reason = "abort" if failure == "timeout" else "stop"
            o.extra = dict(extra)
        main = outs[-1]
        main.metrics = metrics
        main.segments = outs[:-1]
        return main

    @staticmethod
    def _branch(session: TokenSession, br: dict[str, Any]) -> AgentLoopOutput | None:
        ids = [int(t) for t in br["token_ids"]]
        mask = [bool(m) for m in br["sampled_mask"]]
        lps = [float(x) for x in br["logprobs"]]
        if not (len(ids) == len(mask) == len(lps)) or not any(mask):
            return None
        start = mask.index(True)
        versions, unmatched = session.match(ids, mask)
        turns = sum(1 for i in range(start, len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
        out = AgentLoopOutput(
            prompt_ids=ids[:start],
            response_ids=ids[start:],
            response_mask=[int(m) for m in mask[start:]],
            response_logprobs=lps[start:],
            num_turns=2 * turns,
            finish_reason="stop",
            response_versions=versions,
        )
        out.metrics["unmatched"] = float(unmatched)
        return out
