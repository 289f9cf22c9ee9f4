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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from postrl.protocol.traffic import DRIVER_TRAFFIC
from postrl.rollout.ray_replica import ReplicaActor

logger = logging.getLogger(__name__)

__all__ = [
    "PayloadOwner",
    "RefBatch",
    "RemoteTrajectories",
    "RemoteTrajectory",
    "TrajectoryReplicaActor",
    "driver_tensor_reasons",
    "fetch_batch",
    "outcome_advantages",
    "tag_step_metrics",
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


PAYLOAD_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
    "rollout_policy_version",
    "token_level_scores",
    "sample_valid",
)
"""The columns a scored payload holds (the rollout layout plus the reward stage's)."""


class DriverTensorError(RuntimeError):
    """A stage read a tensor of a :class:`RefBatch` on the driver."""


class _Columns(Mapping):
    """``RefBatch.batch``: which columns the rows have (``in``), and the tags' per-row values
    as ``(B,)`` tensors (``seq_len``); a tensor column lives in the object store, and reading
    it here raises :class:`DriverTensorError` — a stage that needs it on the driver declares it
    (:func:`driver_tensor_reasons`), and then the batch is fetched instead."""

    def __init__(self, batch: RefBatch) -> None:
        self._b = batch

    def _tags(self) -> dict[str, torch.Tensor]:
        s = self._b.scalars
        lens = torch.as_tensor(s["prompt_len"] + s["response_len"]).long()
        return {"seq_len": lens}

    def __getitem__(self, key: str) -> torch.Tensor:
        tags = self._tags()
        if key in tags:
            return tags[key]
        if key in self:
            raise DriverTensorError(
                f"batch[{key!r}] of a RefBatch lives in the object store "
                f"(trainer.async.data_plane=object_store): a stage that reads it on the driver "
                f"must be listed by trainer/object_store.py::driver_tensor_reasons, so the "
                f"taken groups are fetched for it"
            )
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        keys = [*PAYLOAD_KEYS, *self._b.column_keys, *self._b.row_values, "seq_len"]
        return iter(dict.fromkeys(keys))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return key in set(iter(self))


@dataclass
class RefBatch:
    """A training batch in the object store: one reference per row plus what the driver needs
    (uids and dataset indices for the ledger and the sampler, per-row scalars for advantages
    and metrics). ``len()`` is the number of rows.

    It goes through the step's stages like a ``DataProto``: ``batch`` says which columns the
    rows have (:class:`_Columns`), :meth:`reorder` balances it, a dp-split call gets one
    :class:`~postrl.protocol.refs.RefShard` per rank (:meth:`ref_shards`) and answers with
    :class:`~postrl.protocol.refs.RemoteProto` columns that :meth:`union` keeps by reference,
    per-row values from the driver (an outcome advantage) join as ``row_values``."""

    refs: list[Any]
    rows: list[int]
    """Each row's index within its payload (a payload holds one rollout-side call's rows)."""
    non_tensor_batch: dict[str, np.ndarray]
    scalars: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)
    masked: np.ndarray | None = None
    """Rows that train nothing (a filtered group standing in for an empty batch)."""
    columns: list[list[Any]] = field(default_factory=list)
    """Answers of earlier dp calls on this batch, one ``RemoteProto`` per rank each."""
    column_keys: tuple[str, ...] = ()
    row_values: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-row values from the driver, broadcast over each row's response mask on the worker."""
    timeout_s: float | None = None
    """Deadline of the workers' fetches (``trainer.async.timeout_s``)."""

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def batch(self) -> _Columns:
        """The columns the rows have (module docstring of :class:`_Columns`)."""
        return _Columns(self)

    def reorder(self, perm: Any) -> RefBatch:
        """The rows in the order ``perm`` (before any dp call: columns are per shard)."""
        if self.columns:
            raise ValueError("RefBatch.reorder after a dp call: its columns are per shard")
        idx = [int(i) for i in perm]
        return dataclasses.replace(
            self,
            refs=[self.refs[i] for i in idx],
            rows=[self.rows[i] for i in idx],
            non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
            scalars={k: v[idx] for k, v in self.scalars.items()},
            masked=None if self.masked is None else self.masked[idx],
            row_values={k: v[idx] for k, v in self.row_values.items()},
        )

    def union(self, other: Any) -> RefBatch:
        """This batch with a dp call's answers joined (one ``RemoteProto`` per rank, made on
        :meth:`ref_shards` of this batch: they stay in the object store)."""
        if not isinstance(other, list) or not all(hasattr(o, "keys") for o in other):
            raise TypeError(f"RefBatch.union takes a dp call's RemoteProto answers, not {other!r}")
        keys = tuple(k for o in other[:1] for k in o.keys)
        return dataclasses.replace(
            self,
            columns=[*self.columns, list(other)],
            column_keys=tuple(dict.fromkeys([*self.column_keys, *keys])),
        )

    def with_row_values(self, **values: Any) -> RefBatch:
        """This batch with per-row values (``(B,)`` each) joined."""
        rv = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        return dataclasses.replace(self, row_values={**self.row_values, **rv})

    def ref_shards(self, n: int) -> list[Any]:
        """One :class:`~postrl.protocol.refs.RefShard` per dp rank: the rows in order, the
        last shard padded with masked copies of the first rows (the same layout every call,
        so a rank's columns line up with its rows)."""
        from postrl.engine.minibatch import ZEROED_KEYS
        from postrl.protocol.refs import RefShard

        rows = len(self)
        if rows == 0:
            raise ValueError("RefBatch.ref_shards of an empty batch")
        pad = (-rows) % n
        picks = list(range(rows)) + [i % rows for i in range(pad)]
        masked = [bool(self.masked[i]) if self.masked is not None else False for i in range(rows)]
        masked += [True] * pad
        size = len(picks) // n
        shards = []
        for r in range(n):
            sl = range(r * size, (r + 1) * size)
            shards.append(
                RefShard(
                    refs=[self.refs[picks[j]] for j in sl],
                    rows=[self.rows[picks[j]] for j in sl],
                    masked=[masked[j] for j in sl],
                    columns=[col[r] for col in self.columns if col[r].ref is not None],
                    row_values={
                        k: [float(v[picks[j]]) for j in sl] for k, v in self.row_values.items()
                    },
                    meta_info=dict(self.meta_info),
                    zeroed_keys=tuple(ZEROED_KEYS),
                    timeout_s=self.timeout_s,
                )
            )
        return shards

    @classmethod
    def from_groups(cls, groups: list[tuple[str, int, list[Any]]]) -> RefBatch:
        """From ``(uid, dataset index, trajectories)`` per group; a trajectory is a
        :class:`RemoteTrajectory`, or a one-row scored ``DataProto`` (a group restored from a
        checkpoint and scored on the driver), which is put into the object store here."""
        refs: list[Any] = []
        offsets: list[int] = []
        cols: dict[str, list[Any]] = {
            k: []
            for k in (
                "uid",
                "index",
                "sample_index",
                "num_turns",
                "finish_reason",
                "agent_metrics",
                "min_version",
                "max_version",
                "spans",
            )
        }
        sc: dict[str, list[float]] = {
            k: [] for k in ("score", "valid", "prompt_len", "response_len", "policy_tokens")
        }
        for uid, index, trajs in groups:
            for k, t in enumerate(trajs):
                if not isinstance(t, RemoteTrajectory):
                    t = _local_row(t)
                refs.append(t.ref)
                offsets.append(t.row)
                known = [v for n, v in t.response_versions if n > 0 and v >= 0]
                for key, v in (
                    ("uid", uid),
                    ("index", index),
                    ("sample_index", k),
                    ("num_turns", t.num_turns),
                    ("finish_reason", t.finish_reason),
                    ("agent_metrics", t.agent_metrics),
                    ("min_version", min(known, default=-1)),
                    ("max_version", max(known, default=-1)),
                    ("spans", len(set(known))),
                ):
                    cols[key].append(v)
                for key, v in (
                    ("score", t.score),
                    ("valid", float(t.valid)),
                    ("prompt_len", t.prompt_len),
                    ("response_len", t.response_len),
                    ("policy_tokens", t.policy_tokens),
                ):
                    sc[key].append(float(v))
        nt = {k: np.array(v, dtype=object) for k, v in cols.items()}
        for k in ("index", "num_turns", "min_version", "max_version", "spans", "sample_index"):
            nt[k] = np.asarray(cols[k], dtype=np.int64)
        scalars = {k: np.asarray(v, dtype=np.float64) for k, v in sc.items()}
        return cls(refs, offsets, nt, scalars)


def _local_row(row: Any) -> RemoteTrajectory:
    """A one-row scored ``DataProto`` put into the object store from the driver."""
    import ray

    b, nt = row.batch, row.non_tensor_batch
    versions = b["rollout_policy_version"][0]
    known = versions[versions >= 0].tolist()
    return RemoteTrajectory(
        ref=ray.put({"batch": row}),
        prompt_len=int(b["attention_mask"][0, : b["prompts"].shape[1]].sum()),
        response_len=int(b["attention_mask"][0, b["prompts"].shape[1] :].sum()),
        policy_tokens=int(b["response_mask"][0].sum()),
        response_versions=[(1, int(v)) for v in known],
        score=float(b["token_level_scores"][0].sum()),
        valid=bool(b["sample_valid"][0]),
        num_turns=int(nt["num_turns"][0]),
        finish_reason=str(nt["finish_reason"][0]),
        agent_metrics=dict(nt["agent_metrics"][0] or {}),
        reward_metrics={},
    )


def driver_tensor_reasons(cfg: Any) -> list[str]:
    """Why this run's step reads batch tensors on the driver (empty: it trains from tags and
    references alone). Each reason is a fact a stage declares: an advantage estimator that is
    not registered ``outcome=True`` or declares ``needs`` / ``optional`` inputs (GAE with its
    critic's values, token-level estimators, ReMax's baseline, the optimal token baseline),
    KL in the reward, downsampling, rollout rejection sampling and a distillation teacher (all
    read token tensors before the update). With any of them the taken groups are fetched to the
    driver (:func:`fetch_batch`) and the step runs as on the ``driver`` plane."""
    from postrl.algos import ADV_ESTIMATORS

    a = cfg.algorithm
    out = []
    if a.adv_estimator in ADV_ESTIMATORS:
        meta = ADV_ESTIMATORS.meta(a.adv_estimator)
        if not meta.get("outcome") or meta.get("needs") or meta.get("optional"):
            out.append(f"algorithm.adv_estimator={a.adv_estimator} (token-level inputs)")
    if a.use_kl_in_reward:
        out.append("algorithm.use_kl_in_reward=true")
    if a.downsample.enable:
        out.append("algorithm.downsample.enable=true")
    if a.rollout_correction.rollout_rs:
        out.append(f"algorithm.rollout_correction.rollout_rs={a.rollout_correction.rollout_rs}")
    if cfg.distill.enabled:  # the teacher scores the sampled tokens (stage 4)
        out.append("distill.teacher_path / teacher_url (a distillation teacher)")
    return out


def fetch_batch(groups: list[tuple[str, int, list[Any]]], timeout_s: float) -> Any:
    """The taken groups as one scored batch on the driver, in group order: each payload
    fetched from the object store once (counted as ``driver/*`` traffic on channel
    ``object_store.fetch``), the wanted rows of each padded into the rollout layout with
    :func:`~postrl.protocol.layout.concat_rollouts`. ``groups`` as for
    :meth:`RefBatch.from_groups` (a one-row ``DataProto`` is a restored row, already here)."""
    import ray

    from postrl.protocol.layout import concat_rollouts

    remote = [t.ref for _, _, trajs in groups for t in trajs if isinstance(t, RemoteTrajectory)]
    unique = list(dict.fromkeys(remote))
    fetched = ray.get(unique, timeout=timeout_s) if unique else []
    DRIVER_TRAFFIC.count("in", "object_store.fetch", [p["batch"] for p in fetched])
    payloads = {ref: p["batch"] for ref, p in zip(unique, fetched, strict=True)}
    rows = [
        payloads[t.ref][t.row : t.row + 1] if isinstance(t, RemoteTrajectory) else t
        for _, _, trajs in groups
        for t in trajs
    ]
    return concat_rollouts(rows)


def outcome_advantages(batch: RefBatch, algo: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """One advantage per row from the rows' scores: the configured (outcome) estimator on
    ``token_level_rewards`` of one token per policy token (the score on the first), with the
    rows' policy-token counts as the mask — the same numbers it gives on the full batch, where
    an outcome estimator's advantage is constant over a row's tokens. Returns ``(B,)`` float32
    advantages and ``critic/advantages/*`` metrics over tokens."""
    from postrl.trainer.stages import _bound_estimator

    s = batch.scalars
    lens = torch.as_tensor(s["policy_tokens"], dtype=torch.long)
    T = max(1, int(lens.max()) if len(lens) else 1)
    mask = (torch.arange(T)[None, :] < lens[:, None]).long()  # (B, T)
    rewards = torch.zeros(len(batch), T, dtype=torch.float32)
    rewards[:, 0] = torch.as_tensor(s["score"], dtype=torch.float32)
    fn = _bound_estimator(algo.adv_estimator, algo.adv_estimator_kwargs)
    adv, _ = fn(
        token_level_rewards=rewards,
        response_mask=mask,
        index=np.asarray(batch.non_tensor_batch["uid"]),
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        sample_mask=torch.as_tensor(s["valid"] > 0),
    )
    per_row = adv[:, 0].clone()
    spread = (adv - per_row[:, None]).abs().masked_fill(mask == 0, 0.0)
    if len(batch) and float(spread.max()) > 1e-5:
        raise ValueError(
            f"algorithm.adv_estimator={algo.adv_estimator} gave advantages that vary within a "
            f"row; trainer.async.data_plane=object_store needs an outcome estimator (one value "
            f"per trajectory); set trainer.async.data_plane=driver"
        )
    per_row = torch.where(lens > 0, per_row, torch.zeros_like(per_row))
    from postrl.trainer.metrics import _stats

    m: dict[str, Any] = {}
    tok = adv[mask.bool()]
    _stats("critic/advantages", tok, m)
    _stats("critic/returns", tok, m)
    return per_row.float(), m


def tag_step_metrics(
    batch: RefBatch, cfg: Any, step_seconds: float, dp_size: int
) -> dict[str, float]:
    """Stage 9 from tags: the score, length, agent and throughput metrics the ``driver`` plane
    reads off the batch tensors (same names, same values)."""
    from postrl.trainer.metrics import _stats, throughput_from_counts
    from postrl.trainer.stages import _agent_metrics

    s = {k: torch.as_tensor(v) for k, v in batch.scalars.items()}
    valid = s["valid"] > 0
    m: dict[str, Any] = {}
    _stats("critic/score", s["score"][valid], m)
    _stats("critic/rewards", s["score"][valid], m)
    _stats("response_length", s["response_len"], m)
    clip = s["response_len"] >= cfg.rollout.response_length
    m["response_length/clip_ratio"] = float(clip.double().mean()) if len(batch) else 0.0
    _stats("prompt_length", s["prompt_len"], m)
    m.update(_agent_metrics(batch))  # (it reads the non-tensor columns only)
    total = float((s["prompt_len"] + s["response_len"]).sum())
    m.update(throughput_from_counts(total, float(s["policy_tokens"].sum()), step_seconds, dp_size))
    return m
