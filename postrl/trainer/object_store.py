"""The object-store data plane of ``fully_async`` on Ray (``trainer.async.data_plane``).

With the ``driver`` data plane every finished trajectory comes back to the trainer process,
which scores it and pads the training batch. Here the trajectory never does:

* **Rollout side.** Each rollout replica actor (:class:`TrajectoryReplicaActor`, a
  :class:`~postrl.rollout.ray_replica.ReplicaActor` with more methods) runs the agent loop
  against its own engine, assembles the one-row batch, scores it with its own
  :class:`~postrl.reward.RewardStage` (the same code and config as the trainer's) and puts it into
  Ray's object store, owned by a small :class:`PayloadOwner` actor so the payload outlives the
  replica that made it. It answers with a **tag**: the reference, lengths, policy-version
  segments, score, validity and the reward metrics (:class:`RemoteTrajectory`).
* **Driver.** The replay buffer, the staleness bound, DAPO filtering and the samplers decide
  from tags, as always. A taken mini-batch is a :class:`RefBatch` (references + per-row
  scalars), and ``RLTrainer.step`` runs its stages on it as on a padded batch — one step, two
  transports: balance from the tagged lengths, the log-prob and update calls of the worker
  groups with each rank's :class:`~postrl.protocol.refs.RefShard` (the rank materialises it
  and runs the same ``compute_log_prob`` / ``update_actor`` body; results stay on the workers
  as references), the outcome estimator on the rows' scores (:func:`outcome_advantages`: one
  value per row, broadcast on the worker), the rollout correction on the workers, stage 9 from
  the tags (:func:`tag_step_metrics`). A stage that reads tensors on the driver
  (:func:`driver_tensor_reasons`) gets the taken groups fetched instead (:func:`fetch_batch`).

:data:`~postrl.protocol.traffic.DRIVER_TRAFFIC` counts what crosses the driver;
``tests/trainer/test_object_store.py`` checks that no trajectory tensor does. Payloads pass
through the driver only at a checkpoint (the buffer's finished trajectories are saved with it).
A replica that dies takes its running trajectories with it: they are run again on a live
replica (``rollout/reissued_requests``); its finished ones survive in the owner's store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from postrl.protocol.traffic import DRIVER_TRAFFIC
from postrl.rollout.ray_replica import ReplicaActor

logger = logging.getLogger(__name__)

__all__ = [
    "ObjectStoreRunner",
    "PayloadOwner",
    "RemoteTrajectories",
    "RemoteTrajectory",
    "TrajectoryReplicaActor",
]


class PayloadOwner:
    """Ray actor that owns the trajectory payloads: a replica hands it each payload and it puts
    it into the object store, so the object lives as long as a reference to it does, even after
    the replica that made it died (an object dies with its owner; Ray ≥ 2.56 has no
    ``ray.put(_owner=...)``). One per run, on the rollout side, never on the driver's path."""

    def put(self, payload: Any) -> list[Any]:
        """Store ``payload``; ``[reference]`` (a list: the reference itself, not its value)."""
        import ray

        return [ray.put(payload)]

    def ping(self) -> bool:
        """Answer (a liveness check)."""
        return True


class TrajectoryReplicaActor(ReplicaActor):
    """A rollout replica actor that also runs whole trajectories (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._agents: Any = None
        self._reward: Any = None

    async def setup_trajectories(self, cfg: Any, max_model_len: int) -> int:
        """Build the agent-loop manager (on this replica's engine) and the reward stage from the
        run's config; returns the process id."""
        import os

        from postrl.agent import AgentLoopManager
        from postrl.data import load_tokenizer
        from postrl.rollout import LoadBalancer, RolloutClient
        from postrl.trainer.context import build_reward_stage

        tokenizer = load_tokenizer(cfg.model.path)
        client = RolloutClient(LoadBalancer([self.replica]))
        self._agents = AgentLoopManager(
            client, tokenizer, cfg.rollout.agent, max_model_len=max_model_len
        )
        self._reward = build_reward_stage(cfg, tokenizer)
        return os.getpid()

    async def trajectories(
        self, rows: list[dict[str, Any]], sampling: Any, owner: Any
    ) -> list[dict[str, Any]]:
        """Run ``rows`` (samples of one group) concurrently, assemble and score them as one
        batch (as the trainer scores a group), put that batch into the object store (owned by
        ``owner``, a :class:`PayloadOwner`) and return one tag per row
        (:meth:`RemoteTrajectory.from_answer`)."""
        if self._agents is None:
            raise RuntimeError("trajectories() before setup_trajectories()")
        outs = await asyncio.gather(*(self._agents.run(row, sampling) for row in rows))
        batch = self._agents.assemble(list(outs), rows)
        scored, metrics = self._reward.finish(batch, check_failures=False)
        payload = {"batch": scored, "outputs": [dataclasses.asdict(o) for o in outs]}
        (ref,) = await owner.put.remote(payload)
        scores = scored.batch["token_level_scores"].sum(-1).tolist()
        valid = scored.batch["sample_valid"].tolist()
        share = {k: float(v) for k, v in metrics.items()}  # the group's, reported once
        return [
            {
                "ref": ref,
                "row": i,
                "prompt_len": len(out.prompt_ids),
                "response_len": len(out.response_ids),
                "policy_tokens": int(sum(out.response_mask)),
                "versions": [list(seg) for seg in (out.response_versions or [])],
                "score": float(scores[i]),
                "valid": bool(valid[i]),
                "num_turns": int(out.num_turns),
                "finish_reason": str(out.finish_reason),
                "agent_metrics": {k: float(v) for k, v in out.metrics.items()},
                "reward_metrics": share if i == 0 else {},
                "rows": len(rows),
            }
            for i, out in enumerate(outs)
        ]


@dataclass
class RemoteTrajectory:
    """The driver's view of one finished trajectory: a reference and its tag."""

    ref: Any
    prompt_len: int
    response_len: int
    policy_tokens: int
    response_versions: list[tuple[int, int]]
    score: float
    valid: bool
    num_turns: int
    finish_reason: str
    agent_metrics: dict[str, float]
    reward_metrics: dict[str, float]
    replica: int = -1
    row: int = 0
    """The trajectory's row in the payload (a payload holds the samples of one call)."""
    rows: int = 1
    """Rows scored together with it (its :attr:`reward_metrics` are theirs: a share)."""

    @classmethod
    def from_answer(cls, d: dict[str, Any], replica: int) -> RemoteTrajectory:
        """From :meth:`TrajectoryReplicaActor.trajectory`'s answer."""
        return cls(
            ref=d["ref"],
            prompt_len=int(d["prompt_len"]),
            response_len=int(d["response_len"]),
            policy_tokens=int(d["policy_tokens"]),
            response_versions=[(int(n), int(v)) for n, v in d["versions"]],
            score=float(d["score"]),
            valid=bool(d["valid"]),
            num_turns=int(d["num_turns"]),
            finish_reason=str(d["finish_reason"]),
            agent_metrics=dict(d["agent_metrics"]),
            reward_metrics=dict(d["reward_metrics"]),
            replica=replica,
            row=int(d["row"]),
            rows=int(d["rows"]),
        )

    def fetch_output(self) -> dict[str, Any]:
        """The trajectory's ``AgentLoopOutput`` fields, fetched from the object store (a
        checkpoint saves them: the one time a payload passes through the driver)."""
        import ray

        return dict(ray.get(self.ref)["outputs"][self.row])


class RemoteTrajectories:
    """Runs trajectories on the fleet's replica actors (the driver side of the data plane).

    The samples of one group asked for in the same turn of the event loop (a group's admission
    spawns them together) run as **one call** on one replica: one agent-loop batch, one reward
    call, one payload — the trainer's own group scoring, and a shared-prompt prefill for the
    engine. The least loaded live replica runs it; when that replica dies meanwhile, the call
    runs again from the prompts on another (``reissued`` counts its trajectories), waiting for a
    restarted replica when none is live, as the rollout client does for single requests.

    Args:
        fleet: the :class:`~postrl.rollout.fleet.RolloutFleet` of
            :class:`~postrl.rollout.ray_replica.RayRolloutReplica` handles whose actors are
            :class:`TrajectoryReplicaActor`.
        owner: the :class:`PayloadOwner` actor handle.
        timeout_s: deadline of one call.
    """

    def __init__(self, fleet: Any, owner: Any, timeout_s: float) -> None:
        self.fleet = fleet
        self.owner = owner
        self.timeout_s = timeout_s
        self.reissued = 0
        self._open: dict[str, _Call] = {}  # uid -> the call still gathering rows this turn

    async def run(self, row: dict[str, Any], sampling: Any) -> RemoteTrajectory:
        """One trajectory of ``row`` (joined with its group's other samples asked for in this
        turn of the loop); its tag."""
        uid = str(row["uid"])
        call = self._open.get(uid)
        if call is None or call.sampling != sampling:
            call = _Call(sampling)
            self._open[uid] = call
            asyncio.get_running_loop().call_soon(self._launch, uid, call)
        i = len(call.rows)
        call.rows.append(row)
        call.waiters += 1
        try:
            answers = await asyncio.shield(call.done)
        except asyncio.CancelledError:
            call.waiters -= 1
            if call.waiters == 0 and call.task is not None:
                call.task.cancel()  # nobody wants the group any more (evicted, checkpoint)
            raise
        return answers[i]

    def _launch(self, uid: str, call: _Call) -> None:
        if self._open.get(uid) is call:
            del self._open[uid]
        call.task = asyncio.get_running_loop().create_task(self._run(call))
        call.task.add_done_callback(call.settle)

    async def _run(self, call: _Call) -> list[RemoteTrajectory]:
        from ray.exceptions import RayActorError

        from postrl.rollout.client import _await_restart
        from postrl.rollout.types import ReplicaDeadError, RolloutTimeoutError

        lb, what = self.fleet.balancer, call.rows[0].get("request_id")
        while True:
            try:
                idx = lb.pick()
            except ReplicaDeadError as e:
                await _await_restart(lb, e)
                continue
            rep = lb.replicas[idx]
            lb.acquire(idx)
            DRIVER_TRAFFIC.count("out", "prompts", (call.rows, call.sampling))
            ref = rep.actor.trajectories.remote(call.rows, call.sampling, self.owner)
            try:
                answers = await rep.race(_await_ref(ref, self.timeout_s))
            except (ReplicaDeadError, RayActorError) as e:
                _cancel(ref)  # (a hung actor may still run it)
                if isinstance(e, RayActorError):
                    rep.mark_dead(f"Ray actor died ({type(e).__name__})")
                self.reissued += len(call.rows)
                logger.warning(
                    "trajectories of %s: replica %d died (%s); running them again on another",
                    what,
                    idx,
                    e,
                )
                continue
            except asyncio.TimeoutError as e:
                _cancel(ref)
                raise RolloutTimeoutError(
                    f"replica {idx}: trajectories of {what!r} exceeded {self.timeout_s}s "
                    f"(trainer.async.timeout_s)"
                ) from e
            except asyncio.CancelledError:
                _cancel(ref)
                raise
            finally:
                lb.release(idx)
            DRIVER_TRAFFIC.count("in", "rollout.trajectory", answers)
            return [RemoteTrajectory.from_answer(a, idx) for a in answers]


class ObjectStoreRunner:
    """The ``object_store`` plane's runner (:mod:`postrl.trainer.runner`): trajectories run
    and are scored on the rollout replica actors (:class:`RemoteTrajectories`); a handle is a
    :class:`RemoteTrajectory` (tag + reference); a taken batch is a
    :class:`~postrl.trainer.ref_batch.RefBatch`, or the groups fetched to the driver when a
    stage reads tensors there (:func:`~postrl.trainer.ref_batch.driver_tensor_reasons`).

    A group restored from a checkpoint is held as
    :class:`~postrl.trainer.runner.LocalTrajectory` payloads and scored by the trainer's own
    reward stage (``local``): the same code the replicas run.

    Args:
        remote: the :class:`RemoteTrajectories` of the run.
        local: the :class:`~postrl.trainer.runner.LocalRunner` (restored groups).
        cfg: the run's config (``trainer.async.timeout_s``, the stages' facts).
    """

    scores_groups = True

    def __init__(self, remote: RemoteTrajectories, local: Any, cfg: Any) -> None:
        from postrl.trainer.ref_batch import driver_tensor_reasons

        self.remote = remote
        self.local = local
        self.timeout_s = float(cfg.trainer.async_.timeout_s)
        self.fetch_tensors = bool(driver_tensor_reasons(cfg))
        """A stage reads batch tensors on the driver: taken groups are fetched there."""

    @classmethod
    def create(
        cls, *, agents: Any, reward: Any, fleet: Any, owner: Any, cfg: Any
    ) -> ObjectStoreRunner:
        """The runner of a context's parts: :class:`RemoteTrajectories` on the fleet's replica
        actors with the payload ``owner`` (a ``rollout_side`` plane's context starts both)."""
        from postrl.trainer.runner import LocalRunner

        if owner is None:
            raise RuntimeError(
                "trainer.async.data_plane=object_store needs the rollout replicas as Ray actors "
                "with a payload owner (trainer.backend=ray)"
            )
        remote = RemoteTrajectories(fleet, owner, cfg.trainer.async_.timeout_s)
        return cls(remote, LocalRunner(agents, reward), cfg)

    @property
    def reissued(self) -> int:
        """Trajectories run again on another replica after theirs died."""
        return self.remote.reissued + self.local.reissued

    async def run(self, row: dict[str, Any], sampling: Any) -> RemoteTrajectory:
        """One trajectory, run and scored with its group on a replica actor."""
        return await self.remote.run(row, sampling)

    async def settle(self, handles: list[Any]) -> None:
        """Nothing to wait for: the replica scored the group before answering."""
        if any(not isinstance(h, RemoteTrajectory) for h in handles):
            await self.local.settle(handles)

    def score(self, handles: list[Any]) -> tuple[list[Any], list[float], list[bool], dict]:
        """Read the scores the replica wrote into the tags (a restored group: scored here)."""
        if any(not isinstance(h, RemoteTrajectory) for h in handles):
            return self.local.score(handles)
        from postrl.trainer.asynchronous.stream import merge_reward_metrics

        # each rollout-side call scored its rows together and reported once
        parts = [(t.rows, t.reward_metrics) for t in handles if t.reward_metrics]
        metrics = merge_reward_metrics(parts) if parts else {}
        return list(handles), [t.score for t in handles], [t.valid for t in handles], metrics

    def score_groups(
        self, groups: list[list[Any]]
    ) -> tuple[list[tuple[list[Any], list[float], list[bool]]], dict]:
        """:meth:`score` per group (the replica scored each already), the metrics merged by
        rows."""
        from postrl.trainer.asynchronous.stream import merge_reward_metrics

        out, parts = [], []
        for g in groups:
            payloads, scores, valid, metrics = self.score(g)
            out.append((payloads, scores, valid))
            if metrics:
                parts.append((len(g), metrics))
        return out, merge_reward_metrics(parts) if parts else {}

    def collate(self, groups: list[tuple[str, int, list[Any]]], scored: bool) -> Any:
        """A :class:`~postrl.trainer.ref_batch.RefBatch` of the groups (rows by reference), or
        the groups fetched to the driver when a stage reads tensors there."""
        from postrl.trainer.ref_batch import RefBatch, fetch_batch

        rows = [
            (uid, index, [p if isinstance(p, RemoteTrajectory) else p.scored_row() for p in ps])
            for uid, index, ps in groups
        ]
        if self.fetch_tensors:
            return fetch_batch(rows, self.timeout_s)
        batch = RefBatch.from_groups(rows)
        batch.timeout_s = self.timeout_s
        return batch

    def masked(self, batch: Any) -> Any:
        """``batch`` with every row masked."""
        from postrl.trainer.ref_batch import RefBatch

        if isinstance(batch, RefBatch):
            return dataclasses.replace(batch, masked=np.ones(len(batch), dtype=bool))
        return self.local.masked(batch)

    def to_json(self, payload: Any) -> dict[str, Any]:
        """The trajectory's ``AgentLoopOutput`` fields (fetched from the object store: the one
        time a payload passes through the driver)."""
        if isinstance(payload, RemoteTrajectory):
            return payload.fetch_output()
        return self.local.to_json(payload)

    def from_json(self, d: dict[str, Any], row: dict[str, Any]) -> Any:
        """A restored trajectory, held on the driver until trained."""
        return self.local.from_json(d, row)


class _Call:
    """One group call: the rows gathered in a turn of the loop, and its outcome."""

    def __init__(self, sampling: Any) -> None:
        self.sampling = sampling
        self.rows: list[dict[str, Any]] = []
        self.waiters = 0
        self.task: asyncio.Task[list[RemoteTrajectory]] | None = None
        self.done: asyncio.Future[list[RemoteTrajectory]] = (
            asyncio.get_running_loop().create_future()
        )

    def settle(self, task: asyncio.Task[list[RemoteTrajectory]]) -> None:
        if self.done.done():
            return
        if task.cancelled():
            self.done.cancel()
        elif task.exception() is not None:
            self.done.set_exception(task.exception())  # type: ignore[arg-type]
            if self.waiters == 0:  # nobody awaits it: mark it seen (no "never retrieved")
                self.done.exception()
        else:
            self.done.set_result(task.result())


async def _await_ref(ref: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(ref, timeout_s)


def _cancel(ref: Any) -> None:
    import ray

    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 (the task finished or its actor is gone)
        logger.debug("cancelling a trajectory task failed", exc_info=True)


# the driver side of the plane (its batch type and tag readers) lives in trainer/ref_batch.py
from postrl.trainer.ref_batch import (  # noqa: E402
    RefBatch,
    driver_tensor_reasons,
    fetch_batch,
    outcome_advantages,
    tag_step_metrics,
)

__all__ += [
    "RefBatch",
    "driver_tensor_reasons",
    "fetch_batch",
    "outcome_advantages",
    "tag_step_metrics",
]
