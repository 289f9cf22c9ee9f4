"""Trajectory runners: the one place the data planes differ.

:class:`~postrl.trainer.asynchronous.stream.GroupStream` has one path for every plane::

    runner.run(row)  →  buffer.generated / finish(key, handle, tag)  →  runner.collate(
                                                                          buffer.assemble(uids))

A runner turns a trajectory row into a **handle** (lengths and policy-version segments for the
tag, the payload for the store), scores a complete group, and collates taken groups into the
step's batch. It is chosen once, where the context is built, from the
``trainer.async.data_plane`` entry of :data:`~postrl.trainer.planes.DATA_PLANES`:

* :class:`LocalRunner` (``trainer.async.data_plane=driver``): the agent loop runs in this
  process on the fleet's replicas, a rule reward is submitted as each trajectory finishes, a
  group is scored by the trainer's reward stage, and the batch is padded here;
* :class:`~postrl.trainer.object_store.ObjectStoreRunner` (``object_store``): the agent loop
  and the reward run on a rollout replica actor, the payload stays in Ray's object store, the
  handle is a tag with a reference and the batch is a
  :class:`~postrl.trainer.ref_batch.RefBatch` (or the groups fetched, when a stage reads
  tensors on the driver).

Both persist a handle as its trajectory's ``AgentLoopOutput`` fields (:meth:`to_json`) and
restore it as a :class:`LocalTrajectory` (:meth:`from_json`): a checkpoint is the buffer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from postrl.protocol import DataProto

__all__ = [
    "TrajectoryRunner",
    "LocalTrajectory",
    "LocalRunner",
    "ScoredGroups",
    "output_to_json",
    "output_from_json",
]


class TrajectoryRunner(Protocol):
    """How rows become trajectories and taken groups a batch (module docstring)."""

    scores_groups: bool
    """Handles come back scored (the rollout side scored their group): the stream reads the
    scores at a group's completion instead of returning the batch unscored."""

    async def run(self, row: dict[str, Any], sampling: Any) -> Any:
        """One trajectory of ``row``: a handle with ``prompt_len``, ``response_len`` and
        ``response_versions``."""
        ...

    async def settle(self, handles: list[Any]) -> None:
        """Wait for the group's rewards submitted while it generated (off the loop's critical
        path: ``inline_scoring=False``)."""
        ...

    def score(self, handles: list[Any]) -> tuple[list[Any], list[float], list[bool], dict]:
        """Score a complete group: its scored payloads, per-row scores and validity (sample
        order), and the reward metrics."""
        ...

    def score_groups(
        self, groups: list[list[Any]]
    ) -> tuple[list[tuple[list[Any], list[float], list[bool]]], dict]:
        """Score several complete groups at once (those that completed in the same loop turn):
        per group what :meth:`score` returns but the metrics, and the metrics of all their
        rows."""
        ...

    def collate(self, groups: list[tuple[str, int, list[Any]]], scored: bool) -> Any:
        """The batch of taken ``(uid, dataset index, payloads)`` groups, in order."""
        ...

    def masked(self, batch: Any) -> Any:
        """``batch`` with every token masked (it trains nothing)."""
        ...

    def to_json(self, payload: Any) -> dict[str, Any]:
        """A payload as JSON (its ``AgentLoopOutput`` fields), for a checkpoint."""
        ...

    def from_json(self, d: dict[str, Any], row: dict[str, Any]) -> Any:
        """A payload restored from :meth:`to_json` (unscored) with its trajectory row."""
        ...

    @property
    def reissued(self) -> int:
        """Trajectories run again after their replica died (``rollout/reissued_requests``)."""
        ...


class ScoredGroups:
    """The scored batches of the groups one :meth:`LocalRunner.score_groups` call scored, one
    per group, built on first use and then shared by the groups' trajectories: a group whose
    scores came without its batch (:meth:`RewardStage.score_streamed`) and that a filter evicts
    is never padded into one.

    Args:
        build: returns the per-group batches (in the order the groups were scored).
    """

    def __init__(self, build: Callable[[], list[DataProto]]) -> None:
        self._build: Callable[[], list[DataProto]] | None = build
        self._groups: list[DataProto] | None = None

    @classmethod
    def built(cls, groups: list[DataProto]) -> ScoredGroups:
        """Batches already built."""
        return cls(lambda: groups)

    def group(self, j: int) -> DataProto:
        """The ``j``-th group's scored batch (the same object on every call)."""
        if self._groups is None:
            assert self._build is not None
            self._groups, self._build = self._build(), None
        return self._groups[j]


@dataclass
class LocalTrajectory:
    """A trajectory held in this process: the agent loop's output and its row; after its group
    is scored, the scored group batch it is row ``row['sample_index']`` of (:attr:`scored`)."""

    output: Any
    row: dict[str, Any]
    scored_groups: ScoredGroups | None = None
    """The scored batches of the call that scored its group (None: not scored)."""
    scored_group: int = 0
    """Its group's position among them."""

    @property
    def scored(self) -> DataProto | None:
        """Its group's scored batch (built on first use), or None before its group is scored."""
        return None if self.scored_groups is None else self.scored_groups.group(self.scored_group)

    @property
    def prompt_len(self) -> int:
        """Prompt tokens."""
        return len(self.output.prompt_ids)

    @property
    def response_len(self) -> int:
        """Response tokens."""
        return len(self.output.response_ids)

    @property
    def response_versions(self) -> list[tuple[int, int]]:
        """``(num_tokens, policy_version)`` segments of the response."""
        return list(self.output.response_versions or [])

    def scored_row(self) -> DataProto:
        """Its one-row scored batch (the group batch's row of this sample)."""
        assert self.scored is not None, "scored_row() before the group was scored"
        i = int(self.row["sample_index"])
        return self.scored[i : i + 1]


class LocalRunner:
    """The ``driver`` plane: agent loops on this process's event loop, the trainer's reward
    stage, batches padded here (module docstring).

    Args:
        agents: the ``AgentLoopManager``.
        reward: the ``RewardStage``.
    """

    scores_groups = False

    def __init__(self, agents: Any, reward: Any) -> None:
        self.agents = agents
        self.reward = reward

    @classmethod
    def create(cls, *, agents: Any, reward: Any, **_: Any) -> LocalRunner:
        """The runner of a context's parts (``DATA_PLANES`` entries share this signature:
        ``agents``, ``reward``, ``fleet``, ``owner``, ``cfg``)."""
        return cls(agents, reward)

    @property
    def reissued(self) -> int:
        """Requests the rollout client re-issued to a live replica."""
        return int(getattr(self.agents.client, "reissued", 0))

    async def run(self, row: dict[str, Any], sampling: Any) -> LocalTrajectory:
        """Run the row's agent loop; a per-sample rule reward starts at once."""
        out = await self.agents.run(row, sampling)
        self.reward.on_trajectory(int(row["sample_index"]), out, row)
        return LocalTrajectory(out, row)

    async def settle(self, handles: list[Any]) -> None:
        """Await the streamed rule scores of the group."""
        keys = [(h.row["uid"], int(h.row["sample_index"])) for h in handles]
        # an inline rule has scored before submit returned: only a worker's scores are awaited
        futures = [f for f in self.reward.streamed(keys) if not f.done()]
        if futures:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    def score(self, handles: list[Any]) -> tuple[list[Any], list[float], list[bool], dict]:
        """The group assembled and scored by the reward stage (failures are the buffer's
        decision, not raised here)."""
        (out,), metrics = self.score_groups([handles])
        return (*out, metrics)

    def score_groups(
        self, groups: list[list[Any]]
    ) -> tuple[list[tuple[list[Any], list[float], list[bool]]], dict]:
        """The groups assembled into one batch and scored by one reward-stage call (the
        assembly and the stage's fixed costs paid once, as ``sync`` pays them for its whole
        batch); each group's payloads hold its own rows of the scored batch: a view of them, or,
        when trajectories brought ``segments`` (their rows follow all trajectories' own rows,
        with their trajectory's ``uid``), the group's rows selected by ``uid``."""
        handles = [h for g in groups for h in g]
        outputs, rows = [h.output for h in handles], [h.row for h in handles]
        streamed = self.reward.score_streamed(outputs, rows)
        if streamed is not None:  # the batch is padded only if a group of it is taken
            self.agents.check(outputs, rows)  # a malformed trajectory fails now, kept or not
            scores = streamed.scores.tolist()
            valid = streamed.valid.tolist()
            metrics = streamed.metrics
            sizes = [len(g) for g in groups]
            source = ScoredGroups(
                lambda: _split(streamed.apply(self.agents.assemble(outputs, rows)), sizes)
            )
        else:
            batch = self.agents.assemble(outputs, rows)
            scored, metrics = self.reward.finish(batch, check_failures=False)
            scores = scored.batch["token_level_scores"].sum(-1).tolist()  # own rows first
            valid = [bool(v) for v in scored.batch["sample_valid"].tolist()]
            source = ScoredGroups.built(_split(scored, [len(g) for g in groups], groups))
        out, at = [], 0
        for j, g in enumerate(groups):
            out.append(
                (
                    [dataclasses.replace(h, scored_groups=source, scored_group=j) for h in g],
                    scores[at : at + len(g)],
                    valid[at : at + len(g)],
                )
            )
            at += len(g)
        return out, metrics

    def collate(self, groups: list[tuple[str, int, list[Any]]], scored: bool) -> DataProto:
        """Scored groups: their group batches concatenated; unscored: the trajectories padded
        into one batch (the trainer's reward stage scores it)."""
        from postrl.protocol.layout import concat_rollouts

        if scored:
            batches: dict[int, DataProto] = {}
            for _, _, payloads in groups:
                for p in payloads:
                    batches.setdefault(id(p.scored), p.scored)
            return concat_rollouts(list(batches.values()))
        handles = [p for _, _, payloads in groups for p in payloads]
        return self.agents.assemble([h.output for h in handles], [h.row for h in handles])

    def masked(self, batch: DataProto) -> DataProto:
        """A copy of ``batch`` with ``response_mask`` all zero."""
        b = dict(batch.batch)
        b["response_mask"] = b["response_mask"] * 0
        return DataProto(b, batch.non_tensor_batch, dict(batch.meta_info))

    def to_json(self, payload: Any) -> dict[str, Any]:
        """The trajectory's ``AgentLoopOutput`` fields."""
        return output_to_json(payload.output)

    def from_json(self, d: dict[str, Any], row: dict[str, Any]) -> LocalTrajectory:
        """A :class:`LocalTrajectory` from :meth:`to_json` and its row."""
        from postrl.agent.base import AgentLoopOutput

        return LocalTrajectory(output_from_json(d, AgentLoopOutput), row)


def _split(
    scored: DataProto, sizes: list[int], groups: list[list[Any]] | None = None
) -> list[DataProto]:
    """A scored batch of several groups (``sizes``: their trajectories, in order) as one batch
    per group: the batch itself for one group; else each group's rows — a view of its own rows,
    or, when the batch holds ``segments`` rows (after all trajectories' own rows, with their
    trajectory's ``uid``; ``groups`` gives each group's ``uid``), its rows selected by ``uid``."""
    if len(sizes) == 1:
        return [scored]
    if len(scored) == sum(sizes):
        bounds = np.cumsum([0, *sizes])
        return [scored[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]
    assert groups is not None, "a batch with segment rows splits by its groups' uids"
    uids = scored.non_tensor_batch["uid"]
    # the group's own rows, then its segment rows, in batch order
    return [scored[np.flatnonzero(uids == g[0].row["uid"])] for g in groups]


def output_to_json(out: Any) -> dict[str, Any]:
    """An ``AgentLoopOutput`` as a JSON-safe dict (raises, naming the fix, when it holds a value
    JSON cannot represent)."""
    d = dataclasses.asdict(out)
    try:
        json.dumps(d)
    except TypeError as e:
        raise TypeError(
            f"a finished trajectory cannot be checkpointed: its AgentLoopOutput holds a value "
            f"JSON cannot represent ({e}); keep agent-loop metrics/extra to plain JSON values"
        ) from e
    return d


def output_from_json(d: dict[str, Any], cls: type) -> Any:
    """Inverse of :func:`output_to_json` (``cls``: ``AgentLoopOutput``)."""
    d = dict(d)
    if d.get("response_versions") is not None:
        d["response_versions"] = [tuple(s) for s in d["response_versions"]]
    d["segments"] = [output_from_json(s, cls) for s in d.get("segments") or ()]
    return cls(**d)
