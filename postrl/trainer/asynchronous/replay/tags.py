"""Control-plane tags of the replay buffer: what is known about a trajectory without its tokens.

A :class:`TrajectoryTag` is a small frozen record — key ``(group uid, sample index)``, status,
prompt/response length, the trainer step it was dispatched at, and the oldest and newest policy
version among its tokens. A :class:`GroupTags` is the snapshot of one prompt's ``n`` tags that
samplers, staleness and eviction decisions read. Neither ever holds a tensor or a reference to
the trajectory itself: the payload lives in the data plane
(:mod:`postrl.trainer.asynchronous.replay.store`).

Policy versions come from the rollout: ``TokenOutput.versions`` is a list of
``(num_tokens, policy_version)`` segments (a trajectory resumed after a weight update has one
segment per version); :func:`version_range` turns segments into ``(min_version, max_version)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "TrajectoryKey",
    "TrajectoryStatus",
    "TrajectoryTag",
    "GroupTags",
    "Eviction",
    "version_range",
    "all_terminal",
]

TrajectoryKey = tuple[str, int]
"""``(group uid, sample index)``: the uid is the agent manager's ``f"{step}-{index}"``."""


class TrajectoryStatus(str, Enum):
    """Lifecycle of one trajectory: ``pending`` → ``running`` → (``generated`` →) ``finished`` |
    ``failed``. ``generated``: its tokens are done and its payload is stored, but its group is
    scored as a whole and is not yet (a group scored at completion)."""

    PENDING = "pending"
    RUNNING = "running"
    GENERATED = "generated"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """Finished or failed: nothing more will happen to it."""
        return self is _FINISHED or self is _FAILED  # identity: the hot path of every check


_FINISHED, _FAILED = TrajectoryStatus.FINISHED, TrajectoryStatus.FAILED


def all_terminal(tags: Sequence[TrajectoryTag], size: int) -> bool:
    """``size`` tags, each finished or failed: the group is complete."""
    return len(tags) == size and all(t.status.terminal for t in tags)


def version_range(segments: Iterable[tuple[int, int]]) -> tuple[int | None, int | None]:
    """``(min, max)`` policy version over the segments that produced at least one token.

    ``segments`` is ``TokenOutput.versions`` / ``AgentLoopOutput.response_versions``:
    ``[(num_tokens, policy_version), ...]``; a negative version (-1: unknown, e.g. observation
    tokens) is skipped. Returns ``(None, None)`` when no segment has a known version.
    """
    versions = [int(v) for n, v in segments if int(n) > 0 and int(v) >= 0]
    return (min(versions), max(versions)) if versions else (None, None)


@dataclass(frozen=True)
class TrajectoryTag:
    """What the control plane knows about one trajectory (no tokens, no tensors).

    Attributes:
        group_uid: the prompt's uid, shared by its ``n`` samples.
        sample_index: k in ``0..n-1``.
        status: see :class:`TrajectoryStatus`.
        prompt_len: prompt tokens (0 until finished).
        response_len: response tokens (0 until finished).
        dispatch_step: the trainer step at which the prompt was dispatched.
        min_version: oldest policy version among the trajectory's tokens (None until finished).
        max_version: newest policy version among its tokens (None until finished).
        score: the trajectory's scalar reward when the caller supplies it (DAPO filtering).
        reason: why it failed (``failed`` only).
    """

    group_uid: str
    sample_index: int
    status: TrajectoryStatus = TrajectoryStatus.PENDING
    prompt_len: int = 0
    response_len: int = 0
    dispatch_step: int = 0
    min_version: int | None = None
    max_version: int | None = None
    score: float | None = None
    reason: str | None = None

    @property
    def key(self) -> TrajectoryKey:
        """``(group_uid, sample_index)``."""
        return (self.group_uid, self.sample_index)

    def replace(self, **changes: Any) -> TrajectoryTag:
        """A copy with ``changes`` applied (tags are immutable; an unknown field is a
        ``TypeError``). Three per trajectory: a field copy, not ``dataclasses.replace``'s
        ``__init__`` (no field has a check to rerun)."""
        unknown = changes.keys() - _TAG_FIELDS
        if unknown:
            raise TypeError(f"TrajectoryTag has no field {sorted(unknown)}")
        new = object.__new__(TrajectoryTag)
        new.__dict__.update(self.__dict__, **changes)
        return new

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``status`` as its string value)."""
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrajectoryTag:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "status": TrajectoryStatus(d["status"])})


@dataclass(frozen=True)
class GroupTags:
    """Snapshot of one group's tags: everything a sampler may look at.

    Attributes:
        uid: the group uid.
        size: the group size ``n`` (trajectories expected).
        tags: the ``n`` tags in sample-index order.
        dispatch_step: trainer step of dispatch.
        admit_version: the policy version when the group was admitted (a lower bound on every
            token's version; used for groups whose tokens are not all known yet).
        seq: admission order (0, 1, ...), the tie-breaker of oldest-first.
        index: the dataset row of the group's prompt (-1: not given).
        epoch: the epoch the prompt was drawn in.
    """

    uid: str
    size: int
    tags: tuple[TrajectoryTag, ...]
    dispatch_step: int = 0
    admit_version: int = 0
    seq: int = 0
    index: int = -1
    epoch: int = 0

    @property
    def num_failed(self) -> int:
        """Trajectories failed."""
        return sum(t.status is TrajectoryStatus.FAILED for t in self.tags)

    @property
    def generated(self) -> bool:
        """All ``size`` trajectories are ``generated``: the group awaits its score."""
        return len(self.tags) == self.size and all(
            t.status is TrajectoryStatus.GENERATED for t in self.tags
        )

    @property
    def complete(self) -> bool:
        """All ``size`` trajectories are finished or failed."""
        return all_terminal(self.tags, self.size)

    @property
    def min_version(self) -> int | None:
        """Oldest policy version among the finished trajectories' tokens (None if none)."""
        vs = [t.min_version for t in self.tags if t.min_version is not None]
        return min(vs) if vs else None

    @property
    def max_version(self) -> int | None:
        """Newest policy version among the finished trajectories' tokens (None if none)."""
        vs = [t.max_version for t in self.tags if t.max_version is not None]
        return max(vs) if vs else None

    @property
    def oldest_version(self) -> int:
        """The version staleness is counted from: the tokens' oldest version once the group is
        complete; before that the admission version (no token of it can be older)."""
        m = self.min_version
        return m if self.complete and m is not None else self.admit_version

    def age(self, current_version: int) -> int:
        """Staleness in policy versions: ``current_version − oldest_version``."""
        return int(current_version) - self.oldest_version

    @property
    def response_lens(self) -> list[int]:
        """Response lengths of the finished trajectories."""
        return [t.response_len for t in self.tags if t.status is TrajectoryStatus.FINISHED]

    @property
    def scores(self) -> list[float | None]:
        """Scores of the finished trajectories (None where not supplied)."""
        return [t.score for t in self.tags if t.status is TrajectoryStatus.FINISHED]

    def keys(self) -> list[TrajectoryKey]:
        """Keys of every trajectory, in sample-index order."""
        return [t.key for t in self.tags]


@dataclass(frozen=True)
class Eviction:
    """One evicted group = one refill request.

    Attributes:
        uid: the evicted group.
        reason: ``stale`` | ``filtered`` | ``failed`` | ``surplus`` (left over when an oversampled
            batch was full).
        age: its staleness when evicted (policy versions).
        response_lens: response lengths of its finished trajectories.
        index: the dataset row of its prompt (-1: not given).
        epoch: the epoch its prompt was drawn in (a stale group is refilled with itself).
    """

    uid: str
    reason: str
    age: int
    response_lens: tuple[int, ...] = ()
    index: int = -1
    epoch: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict."""
        return {**self.__dict__, "response_lens": list(self.response_lens)}


def sort_oldest_first(groups: Sequence[GroupTags]) -> list[GroupTags]:
    """Groups ordered by (oldest token version, dispatch step, admission order)."""
    return sorted(groups, key=lambda g: (g.oldest_version, g.dispatch_step, g.seq))


_TAG_FIELDS = frozenset(f.name for f in dataclasses.fields(TrajectoryTag))
