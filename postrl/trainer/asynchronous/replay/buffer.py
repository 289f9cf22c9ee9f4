"""``ReplayBuffer``: the event-driven control plane of async training.

The buffer tracks groups of ``n`` trajectories (one prompt each) from admission to training,
from tags alone (:mod:`~postrl.trainer.asynchronous.replay.tags`); the trajectories themselves
go to a :class:`~postrl.trainer.asynchronous.replay.store.TrajectoryStore` and are read only by
:meth:`assemble`.

Lifecycle of a group::

    admit(uids)         in flight   (admission pacing: can_admit() > 0)
    start/finish/fail   per trajectory (``generated`` first when its group is scored as a
                        whole: payload stored, score to come); when all n are terminal the
                        group is complete:
                          failed   (failed/n > max_failure_ratio)     → evicted, refill 1
                          filtered (filter_groups: < 2 distinct scores) → evicted, refill 1
                          else ready                                  → wakes sample()
    sample(k, v)        k ready groups chosen by the sampler           → taken
                          (take_order=admission: the k groups admitted first, once all
                          of them are complete — no group overtakes an earlier one)
                          drop: complete groups with age > max_staleness → evicted, refill 1
                          wait: waits while taking k now would leave a group unable to be
                                trained within the bound (earliest-deadline check)
    assemble(uids)      the payloads of the taken groups (the only read of the data plane)

**Staleness** is counted in policy versions of the tokens: a group's age at version ``v`` is
``v − min_version`` over all of its tokens (``TokenOutput.versions``), not ``v − dispatch
step`` as in verl (RFC #7579: a prompt dispatched early but generated, or resumed, on new
weights is not stale; one generated on old weights is, whenever it was dispatched). Until a
group is complete its age is counted from its admission version, a lower bound on its tokens'.

**Admission pacing** (AReaL's rule): at most ``(max_staleness + 1) × batch_groups`` groups are
admitted and not yet trained, counting those sampled at the current version — every admitted
group can still be trained within the bound if updates train oldest first, so drops are rare.

Every wait has a deadline and raises :class:`ReplayTimeoutError` naming what it waited for.
All methods must be called from the thread of the event loop that runs :meth:`sample` (the
agent manager's ``on_sample_end`` hook runs there). No timer and no polling: waiters sleep on
a future that every state change resolves.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from postrl.trainer.asynchronous.replay.errors import (
    AdmissionError,
    ReplayTimeoutError,
    StalenessBoundError,
)
from postrl.trainer.asynchronous.replay.samplers import (
    OldestFirstSampler,
    build_sampler,
    check_selection,
)
from postrl.trainer.asynchronous.replay.store import (
    LocalTrajectoryStore,
    MissingTrajectoryError,
    TrajectoryStore,
)
from postrl.trainer.asynchronous.replay.tags import (
    Eviction,
    GroupTags,
    TrajectoryKey,
    TrajectoryStatus,
    TrajectoryTag,
    all_terminal,
    sort_oldest_first,
    version_range,
)

logger = logging.getLogger(__name__)

__all__ = ["ReplayBuffer", "STRATEGIES", "TAKE_ORDERS", "EVICTION_REASONS"]

STRATEGIES = ("drop", "wait")
"""``trainer.async.staleness_strategy`` values."""
TAKE_ORDERS = ("completion", "admission")
"""``trainer.async.take_order`` values (:class:`ReplayBuffer` ``take_order``)."""
EVICTION_REASONS = ("stale", "filtered", "failed", "surplus")
"""Why a group is evicted (each eviction asks for exactly one refill prompt)."""

_NO_PAYLOAD: Any = object()
"""``fail()`` without a payload (None is a payload a caller may store)."""


@dataclass
class _Group:
    uid: str
    size: int
    dispatch_step: int
    admit_version: int
    seq: int
    tags: list[TrajectoryTag]
    index: int = -1
    epoch: int = 0

    @property
    def complete(self) -> bool:
        """As :attr:`GroupTags.complete`, without building a snapshot."""
        return all_terminal(self.tags, self.size)

    def snapshot(self) -> GroupTags:
        return GroupTags(
            self.uid,
            self.size,
            tuple(self.tags),
            self.dispatch_step,
            self.admit_version,
            self.seq,
            self.index,
            self.epoch,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "size": self.size,
            "dispatch_step": self.dispatch_step,
            "admit_version": self.admit_version,
            "seq": self.seq,
            "tags": [t.to_dict() for t in self.tags],
            "index": self.index,
            "epoch": self.epoch,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Group:
        tags = [TrajectoryTag.from_dict(t) for t in d["tags"]]
        return cls(
            d["uid"],
            d["size"],
            d["dispatch_step"],
            d["admit_version"],
            d["seq"],
            tags,
            int(d.get("index", -1)),
            int(d.get("epoch", 0)),
        )


@dataclass
class _StepStats:
    evicted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    ages: list[int] = field(default_factory=list)
    kept_lens: list[int] = field(default_factory=list)
    dropped_lens: list[int] = field(default_factory=list)
    wait_s: float = 0.0


class ReplayBuffer:
    """Groups of trajectories from admission to training, decided from tags only.

    Args:
        group_size: trajectories per group (``rollout.n``).
        batch_groups: groups per update (``data.train_batch_size``).
        max_staleness: the bound on a trained group's age in policy versions (0 = on-policy).
        strategy: ``drop`` (evict complete groups older than the bound, one refill each) or
            ``wait`` (never drop: ``sample`` waits until the batch can be taken within it).
        sampler: a registered sampler name or ``module:Class`` (see
            :mod:`~postrl.trainer.asynchronous.replay.samplers`).
        store: the data plane (default: a new :class:`LocalTrajectoryStore`).
        filter_groups: DAPO dynamic sampling: evict complete groups with fewer than two
            distinct finite scores among their finished trajectories (``finish(score=...)``).
        max_failure_ratio: a complete group with more than this fraction of failed
            trajectories is evicted as ``failed``.
        timeout_s: default deadline of :meth:`sample` and :meth:`wait_admit`.
        on_evict: called with each :class:`Eviction` as it happens (e.g. to admit the refill
            prompt at once; :meth:`pop_refills` still lists it).
        capacity: the pacing cap on untrained groups (default ``(max_staleness + 1) ×
            batch_groups``); larger lets a caller keep more groups in flight than it trains
            (``algorithm.filter_groups.oversample``, which evicts the rest as ``surplus``).
        take_order: ``completion`` (the sampler chooses among the complete groups, so groups
            that finish first are trained first) or ``admission`` (a take waits for the
            ``batch_groups`` earliest-admitted untrained groups and takes exactly those: a
            fast group never overtakes a slow one, so which prompts train does not depend on
            how long their trajectories take; the sampler is not consulted).
    """

    def __init__(
        self,
        group_size: int,
        batch_groups: int,
        *,
        max_staleness: int = 0,
        strategy: str = "wait",
        sampler: str = "oldest_first",
        store: TrajectoryStore | None = None,
        filter_groups: bool = False,
        max_failure_ratio: float = 0.0,
        timeout_s: float = 600.0,
        on_evict: Callable[[Eviction], None] | None = None,
        capacity: int | None = None,
        take_order: str = "completion",
    ) -> None:
        errors = []
        if take_order not in TAKE_ORDERS:
            errors.append(f"take_order={take_order!r}: choose one of {TAKE_ORDERS}")
        if group_size < 1:
            errors.append(f"group_size={group_size}: must be >= 1 (rollout.n)")
        if batch_groups < 1:
            errors.append(f"batch_groups={batch_groups}: must be >= 1 (data.train_batch_size)")
        if max_staleness < 0:
            errors.append(f"max_staleness={max_staleness}: must be >= 0 (0 = on-policy)")
        if strategy not in STRATEGIES:
            errors.append(f"staleness_strategy={strategy!r}: choose one of {STRATEGIES}")
        if filter_groups and group_size < 2:
            errors.append(
                f"filter_groups=True with group_size={group_size}: every group of one sample has "
                f"a single score and would be filtered; use rollout.n >= 2 or disable filtering"
            )
        if capacity is not None and capacity < (max_staleness + 1) * batch_groups:
            errors.append(
                f"capacity={capacity}: must be >= (max_staleness + 1) × batch_groups = "
                f"{(max_staleness + 1) * batch_groups}"
            )
        if not 0.0 <= max_failure_ratio <= 1.0:
            errors.append(f"max_failure_ratio={max_failure_ratio}: must be in [0, 1]")
        if errors:
            raise ValueError("invalid replay buffer settings: " + "; ".join(errors))
        self.group_size = int(group_size)
        self.batch_groups = int(batch_groups)
        self.max_staleness = int(max_staleness)
        self.strategy = strategy
        self.take_order = take_order
        self.sampler_name = sampler
        self.sampler = build_sampler(sampler)
        self.store: TrajectoryStore = store if store is not None else LocalTrajectoryStore()
        self.filter_groups = bool(filter_groups)
        self.max_failure_ratio = float(max_failure_ratio)
        self.timeout_s = float(timeout_s)
        self.on_evict = on_evict
        self._capacity = capacity
        self._groups: dict[str, _Group] = {}  # admitted, not yet taken (in flight or ready)
        self._taken: dict[str, _Group] = {}  # sampled, payloads not yet assembled
        self._evicted: set[str] = set()
        self._refills: list[Eviction] = []
        self._version = 0
        self._consumed_at_version = 0
        self._seq = 0
        self._stats = _StepStats()
        self._waiters: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        """The newest policy version the buffer was told about (``sample``/``set_version``)."""
        return self._version

    @property
    def capacity(self) -> int:
        """The pacing cap on untrained groups: ``(max_staleness + 1) × batch_groups`` unless
        the constructor set it."""
        if self._capacity is not None:
            return self._capacity
        return (self.max_staleness + 1) * self.batch_groups

    def set_version(self, version: int) -> None:
        """The policy version advanced (the rollout now generates with ``version``)."""
        version = int(version)
        if version < self._version:
            raise ValueError(f"policy version went back from {self._version} to {version}")
        if version > self._version:
            self._version, self._consumed_at_version = version, 0
            self._notify()

    def groups(self) -> list[GroupTags]:
        """Snapshots of every admitted, untrained group (in flight and ready), admission order."""
        return [g.snapshot() for g in self._groups.values()]

    def ready(self) -> list[GroupTags]:
        """Snapshots of the complete groups waiting to be sampled."""
        return [s for s in self.groups() if s.complete]

    def takeable(self) -> list[GroupTags]:
        """The complete groups a :meth:`sample` at the current version may take: within
        ``max_staleness`` (a complete group older than that is evicted or refused by the take,
        so it must not count towards a batch that someone waits for) and, with
        ``take_order=admission``, not behind an incomplete group admitted earlier."""
        groups = self.groups()
        fresh = [g for g in groups if g.complete and g.age(self._version) <= self.max_staleness]
        if self.take_order == "completion":
            return fresh
        first_pending = min((g.seq for g in groups if not g.complete), default=None)
        return [g for g in fresh if first_pending is None or g.seq < first_pending]

    def group(self, uid: str) -> GroupTags:
        """The snapshot of an untrained or taken (not yet assembled) group."""
        g = self._groups.get(uid) or self._taken.get(uid)
        if g is None:
            raise KeyError(f"group {uid!r} is not in the buffer (evicted, assembled or unknown)")
        return g.snapshot()

    def known(self, uid: str) -> bool:
        """Whether ``uid`` was ever admitted (untrained, taken or evicted): uids are unique."""
        return uid in self._groups or uid in self._taken or uid in self._evicted

    @property
    def admissions(self) -> int:
        """Groups admitted so far (a counter that never repeats)."""
        return self._seq

    def pending_keys(self) -> list[TrajectoryKey]:
        """Keys still to generate (``pending``): after :meth:`load_state_dict`, the in-flight
        trajectories of the checkpoint, to dispatch again."""
        return [
            t.key
            for g in self._groups.values()
            for t in g.tags
            if t.status is TrajectoryStatus.PENDING
        ]

    # ------------------------------------------------------------------ admission
    def can_admit(self) -> int:
        """How many groups may be admitted now without breaking the pacing cap."""
        return max(0, self.capacity - len(self._groups) - self._consumed_at_version)

    def admit(
        self,
        uids: Sequence[str],
        *,
        dispatch_step: int,
        version: int | None = None,
        indices: Sequence[int] | None = None,
        epoch: int = 0,
    ) -> list[TrajectoryKey]:
        """Admit one group per uid (``n`` pending trajectories each); returns their keys.

        ``version``: the policy version the rollout generates with now (default: :attr:`version`);
        ``indices``: each group's dataset row, ``epoch``: the epoch they were drawn in (kept
        with the group: its prompt can be drawn again, e.g. for a resumed run or a stale refill).
        Raises :class:`AdmissionError` beyond :meth:`can_admit` or for a uid seen before.
        """
        uids = [str(u) for u in uids]
        if len(uids) > self.can_admit():
            raise AdmissionError(
                f"admit({len(uids)} groups): only {self.can_admit()} may be admitted now "
                f"(cap (max_staleness+1)×batch_groups = {self.capacity}; {len(self._groups)} "
                f"untrained, {self._consumed_at_version} sampled at version {self._version}); "
                f"check can_admit() or await wait_admit(n) first"
            )
        dup = [u for u in uids if u in self._groups or u in self._taken or u in self._evicted] + [
            u for i, u in enumerate(uids) if u in uids[:i]
        ]
        if dup:
            raise AdmissionError(f"group uids admitted twice: {dup[:5]} (uids must be unique)")
        if indices is not None and len(indices) != len(uids):
            raise ValueError(f"admit: {len(uids)} uids but {len(indices)} indices")
        v = self._version if version is None else int(version)
        keys: list[TrajectoryKey] = []
        for i, uid in enumerate(uids):
            tags = [
                TrajectoryTag(uid, k, dispatch_step=int(dispatch_step))
                for k in range(self.group_size)
            ]
            index = -1 if indices is None else int(indices[i])
            self._groups[uid] = _Group(
                uid, self.group_size, int(dispatch_step), v, self._seq, tags, index, int(epoch)
            )
            self._seq += 1
            keys += [t.key for t in tags]
        return keys

    async def wait_admit(self, n: int = 1, timeout_s: float | None = None) -> None:
        """Wait until ``n`` groups may be admitted (a training step or an eviction frees room)."""
        if n > self.capacity:
            raise AdmissionError(f"wait_admit({n}): more than the cap {self.capacity} ever allows")
        await self._wait_until(
            lambda: self.can_admit() >= n,
            timeout_s,
            lambda: (
                f"room to admit {n} groups (can_admit()={self.can_admit()}, cap {self.capacity})"
            ),
        )

    # ------------------------------------------------------------------ trajectories
    def start(self, key: TrajectoryKey) -> None:
        """A trajectory started generating (``pending`` → ``running``)."""
        g, tag = self._tag(key)
        if g is None:
            return
        if tag.status is not TrajectoryStatus.PENDING:
            raise ValueError(f"trajectory {key!r} is {tag.status.value}; only pending ones start")
        self._set(g, tag.replace(status=TrajectoryStatus.RUNNING))

    def generated(
        self,
        key: TrajectoryKey,
        payload: Any,
        *,
        prompt_len: int,
        response_len: int,
        versions: Iterable[tuple[int, int]],
    ) -> bool:
        """A trajectory's tokens are done but its group is scored as a whole, later: its
        payload goes to the store and its tag records lengths and versions (``generated``, not
        terminal: :meth:`finish` or :meth:`fail` follows with the score). Returns False
        (payload dropped) if its group was already evicted."""
        g, tag = self._tag(key)
        if g is None:
            return False
        if tag.status not in (TrajectoryStatus.PENDING, TrajectoryStatus.RUNNING):
            raise ValueError(f"trajectory {key!r} is already {tag.status.value}")
        lo, hi = version_range(versions)
        self.store.put(tag.key, payload)
        g.tags[tag.sample_index] = tag.replace(
            status=TrajectoryStatus.GENERATED,
            prompt_len=int(prompt_len),
            response_len=int(response_len),
            min_version=lo,
            max_version=hi,
        )
        return True

    def scoring_payloads(self, uid: str) -> list[Any]:
        """The payloads of a group whose ``n`` trajectories are all ``generated``, in sample
        order, to score them together (they stay stored: :meth:`finish` replaces each)."""
        g = self._groups.get(uid)
        if g is None or not g.snapshot().generated:
            raise KeyError(f"group {uid!r} is not in the buffer with every trajectory generated")
        return [self.store.get(t.key) for t in g.tags]

    def finish(
        self,
        key: TrajectoryKey,
        payload: Any,
        *,
        prompt_len: int,
        response_len: int,
        versions: Iterable[tuple[int, int]],
        score: float | None = None,
    ) -> bool:
        """A trajectory finished: its payload goes to the store (never read here; it replaces
        the ``generated`` one), its tag records lengths and the policy-version range of
        ``versions`` (``TokenOutput.versions`` segments). Returns False (payload dropped) if its
        group was already evicted."""
        g, tag = self._tag(key)
        if g is None:
            return False
        if tag.status.terminal:
            raise ValueError(f"trajectory {key!r} is already {tag.status.value}")
        if self.filter_groups and (score is None or not isinstance(score, (int, float))):
            raise ValueError(
                f"finish({key!r}): filter_groups=True decides from scores; pass score= (the "
                f"trajectory's scalar reward) or disable filtering"
            )
        lo, hi = version_range(versions)
        if tag.status is TrajectoryStatus.GENERATED:
            self.store.discard(tag.key)
        self.store.put(tag.key, payload)
        new = tag.replace(
            status=TrajectoryStatus.FINISHED,
            prompt_len=int(prompt_len),
            response_len=int(response_len),
            min_version=lo,
            max_version=hi,
            score=None if score is None else float(score),
        )
        self._set(g, new)
        return True

    def restart(self, key: TrajectoryKey) -> None:
        """A running trajectory's request was dropped (its progress discarded, e.g. at a
        checkpoint): back to ``pending``, to dispatch again. Finished ones stay finished."""
        g, tag = self._tag(key)
        if g is not None and tag.status is TrajectoryStatus.RUNNING:
            self._set(g, tag.replace(status=TrajectoryStatus.PENDING))

    def fail(self, key: TrajectoryKey, reason: str, payload: Any = _NO_PAYLOAD) -> None:
        """A trajectory failed (rollout or reward error). With ``payload`` (its reward failed,
        its tokens exist) the payload is stored and assembled with its group (trained masked by
        ``sample_valid``); else nothing is stored for it (a ``generated`` payload is dropped)."""
        g, tag = self._tag(key)
        if g is None:
            return
        if tag.status.terminal:
            raise ValueError(f"trajectory {key!r} is already {tag.status.value}")
        if tag.status is TrajectoryStatus.GENERATED:
            self.store.discard(tag.key)
        if payload is not _NO_PAYLOAD:
            self.store.put(tag.key, payload)
        # a failed tag counts in no length or version (staleness reads the trained tokens)
        failed = TrajectoryTag(tag.group_uid, tag.sample_index, dispatch_step=tag.dispatch_step)
        self._set(g, failed.replace(status=TrajectoryStatus.FAILED, reason=str(reason)))

    def evict(self, uid: str, reason: str) -> Eviction:
        """Evict an untrained group (e.g. ``filtered`` after the caller scored it) and ask for
        one refill. Its payloads are discarded unread; late ``finish`` calls are ignored."""
        if uid not in self._groups:
            raise KeyError(f"group {uid!r} is not in the buffer (taken, evicted or never admitted)")
        return self._evict(self._groups[uid], reason)

    def pop_refills(self) -> list[Eviction]:
        """The evictions since the last call: refill exactly one prompt per entry."""
        out, self._refills = self._refills, []
        return out

    # ------------------------------------------------------------------ training
    async def sample(
        self,
        batch_groups: int | None = None,
        current_version: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[str]:
        """Wait for and take ``batch_groups`` complete groups within the staleness bound, chosen
        by the sampler; returns their uids (then :meth:`assemble` them). Raises
        :class:`ReplayTimeoutError` past the deadline, :class:`StalenessBoundError` when the
        ``wait`` strategy cannot meet the bound."""
        k = self.batch_groups if batch_groups is None else int(batch_groups)
        if current_version is not None:
            self.set_version(current_version)
        v = self._version
        t0 = time.perf_counter()
        chosen: list[str] = []

        def attempt() -> bool:
            nonlocal chosen
            chosen = self._try_select(k, v)
            return bool(chosen)

        try:
            await self._wait_until(attempt, timeout_s, lambda: self._sample_waiting_for(k, v))
        finally:
            self._stats.wait_s += time.perf_counter() - t0
        for uid in chosen:
            g = self._groups.pop(uid)
            snap = g.snapshot()
            self._stats.ages.append(snap.age(v))
            self._stats.kept_lens += snap.response_lens
            self._taken[uid] = g
        self._consumed_at_version += len(chosen)
        self._notify()
        return chosen

    def assemble(self, uids: Sequence[str]) -> list[tuple[TrajectoryTag, Any]]:
        """The stored trajectories of the taken groups as ``(tag, payload)`` — the finished
        ones and those failed with a payload — group by group in ``uids`` order and by sample
        index: the one place payloads are read for training (and released)."""
        unknown = [u for u in uids if u not in self._taken]
        if unknown:
            raise KeyError(f"assemble: groups {unknown[:5]} were not sampled (or assembled twice)")
        held = set(self.store.keys())
        out = []
        for uid in uids:
            g = self._taken.pop(uid)
            for t in g.tags:
                if t.key in held:
                    out.append((t, self.store.pop(t.key)))
        return out

    # ------------------------------------------------------------------ metrics / checkpoints
    def metrics(self) -> dict[str, float]:
        """``replay/*`` metrics since the last call (counters then reset)."""
        s, self._stats = self._stats, _StepStats()
        m = {f"replay/evicted/{r}": float(s.evicted[r]) for r in EVICTION_REASONS}
        m["replay/staleness/mean"] = sum(s.ages) / len(s.ages) if s.ages else 0.0
        m["replay/staleness/max"] = float(max(s.ages)) if s.ages else 0.0
        m["replay/occupancy"] = (len(self._groups) + self._consumed_at_version) / self.capacity
        m["replay/ready_groups"] = float(sum(1 for g in self.groups() if g.complete))
        m["timing_s/replay_wait"] = s.wait_s
        m["replay/dropped_len_mean"] = _mean(s.dropped_lens)
        m["replay/kept_len_mean"] = _mean(s.kept_lens)
        return m

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe control plane: settings, version, untrained groups with their tags (ready
        and in flight), taken-but-unassembled groups, pending refills (payloads: :meth:`payloads`).
        """
        return {
            "group_size": self.group_size,
            "batch_groups": self.batch_groups,
            "version": self._version,
            "consumed_at_version": self._consumed_at_version,
            "seq": self._seq,
            "groups": [g.to_dict() for g in self._groups.values()],
            "taken": [g.to_dict() for g in self._taken.values()],
            "evicted": sorted(self._evicted),
            "refills": [e.to_dict() for e in self._refills],
        }

    def payloads(self) -> dict[TrajectoryKey, Any]:
        """Every payload the buffer still holds (finished, generated and failed-with-payload
        trajectories of untrained and taken groups: to persist with :meth:`state_dict`; read
        from the store, not by any decision)."""
        held = set(self.store.keys())
        return {
            t.key: self.store.get(t.key)
            for g in (*self._groups.values(), *self._taken.values())
            for t in g.tags
            if t.key in held
        }

    def load_state_dict(
        self, state: dict[str, Any], payloads: dict[TrajectoryKey, Any] | None = None
    ) -> None:
        """Restore :meth:`state_dict`; ``payloads`` (from :meth:`payloads`) go to the store,
        else the store must already hold them. Running trajectories become ``pending`` (their
        requests died with the process): :meth:`pending_keys` lists them to dispatch again."""
        for name in ("group_size", "batch_groups"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"replay state has {name}={state[name]} but the buffer has "
                    f"{getattr(self, name)}; resume with the same rollout.n and train_batch_size"
                )
        groups = [_Group.from_dict(d) for d in state["groups"]]
        taken = [_Group.from_dict(d) for d in state["taken"]]
        for g in groups:
            g.tags = [
                t.replace(status=TrajectoryStatus.PENDING)
                if t.status is TrajectoryStatus.RUNNING
                else t
                for t in g.tags
            ]
        held = set(self.store.keys()) if payloads is None else set()
        must = (TrajectoryStatus.FINISHED, TrajectoryStatus.GENERATED)
        for g in (*groups, *taken):
            for t in g.tags:
                if payloads is not None and t.status is TrajectoryStatus.FAILED:
                    if t.key in payloads:  # a reward failure keeps its tokens
                        self.store.put(t.key, payloads[t.key])
                    continue
                if t.status not in must:
                    continue
                if payloads is not None:
                    if t.key not in payloads:
                        raise MissingTrajectoryError(
                            f"load_state_dict: no payload for finished trajectory {t.key!r}; "
                            f"pass every payload buffer.payloads() returned"
                        )
                    self.store.put(t.key, payloads[t.key])
                elif t.key not in held:
                    raise MissingTrajectoryError(
                        f"load_state_dict: the store lacks finished trajectory {t.key!r}; pass "
                        f"payloads=buffer.payloads() saved with the state"
                    )
        self._groups = {g.uid: g for g in groups}
        self._taken = {g.uid: g for g in taken}
        self._evicted = set(state["evicted"])
        self._refills = [
            Eviction(
                e["uid"],
                e["reason"],
                e["age"],
                tuple(e["response_lens"]),
                int(e.get("index", -1)),
                int(e.get("epoch", 0)),
            )
            for e in state["refills"]
        ]
        self._version = int(state["version"])
        self._consumed_at_version = int(state["consumed_at_version"])
        self._seq = int(state["seq"])
        self._notify()

    # ------------------------------------------------------------------ internals
    def _notify(self) -> None:
        """Wake every waiter (each re-checks its condition): the buffer's only signal."""
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait_until(self, ready: Any, timeout_s: float | None, what: Any) -> None:
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                raise ReplayTimeoutError(f"replay buffer waited {timeout:g}s for {what()}")
            fut = loop.create_future()  # per wait, on the running loop: any loop may wait
            self._waiters.add(fut)
            try:
                # not asyncio.wait_for: on Python < 3.12 it swallows a cancellation that lands
                # in the iteration the waited future completes, and a cancelled sample() would
                # live on and later take groups nobody receives
                done, _ = await asyncio.wait({fut}, timeout=left)
            finally:
                self._waiters.discard(fut)
            if not done:
                raise ReplayTimeoutError(f"replay buffer waited {timeout:g}s for {what()}")

    def _tag(self, key: TrajectoryKey) -> tuple[_Group | None, TrajectoryTag]:
        uid, k = str(key[0]), int(key[1])
        g = self._groups.get(uid)
        if g is None:
            if uid in self._evicted:
                return None, TrajectoryTag(uid, k)
            raise KeyError(f"trajectory {key!r}: group {uid!r} was never admitted (admit it first)")
        if not 0 <= k < g.size:
            raise KeyError(f"trajectory {key!r}: sample index out of range 0..{g.size - 1}")
        return g, g.tags[k]

    def _set(self, g: _Group, tag: TrajectoryTag) -> None:
        g.tags[tag.sample_index] = tag
        if not tag.status.terminal:
            return
        if not g.complete:
            return
        snap = g.snapshot()
        if snap.num_failed / snap.size > self.max_failure_ratio:
            self._evict(g, "failed")
        elif self.filter_groups and _uninformative(snap.scores):
            self._evict(g, "filtered")
        else:
            self._notify()

    def _evict(self, g: _Group, reason: str) -> Eviction:
        if reason not in EVICTION_REASONS:
            raise ValueError(f"eviction reason {reason!r}: one of {EVICTION_REASONS}")
        snap = g.snapshot()
        del self._groups[g.uid]
        self._evicted.add(g.uid)
        for key in snap.keys():
            self.store.discard(key)
        e = Eviction(
            g.uid, reason, snap.age(self._version), tuple(snap.response_lens), g.index, g.epoch
        )
        self._refills.append(e)
        self._stats.evicted[reason] += 1
        self._stats.dropped_lens += snap.response_lens
        self._notify()
        if self.on_evict is not None:
            self.on_evict(e)
        return e

    def _try_select(self, k: int, v: int) -> list[str]:
        """The uids to take now, or [] to keep waiting."""
        s = self.max_staleness
        complete = [g for g in self.groups() if g.complete]
        stale = [g for g in complete if g.age(v) > s]
        if stale and self.strategy == "drop":
            for g in stale:
                self._evict(self._groups[g.uid], "stale")
        elif stale:
            raise StalenessBoundError(
                f"wait strategy: groups {[g.uid for g in stale[:5]]} are older than "
                f"max_staleness={s} at version {v} (ages {[g.age(v) for g in stale[:5]]}); "
                f"admit only while can_admit() > 0 and advance the version by one per update"
            )
        if self.take_order == "admission":
            head = sorted(self.groups(), key=lambda g: g.seq)[:k]
            if len(head) < k or not all(g.complete for g in head):
                return []
            return [g.uid for g in head]
        ready = [g for g in complete if g.age(v) <= s]
        if len(ready) < k:
            return []
        chosen = self.sampler.select(ready, k, v)
        check_selection(self.sampler_name, chosen, ready, k)
        if self.strategy == "drop" or self._feasible(set(chosen), v):
            return list(chosen)
        edf = [g.uid for g in sort_oldest_first(ready)[:k]]
        if self._feasible(set(edf), v):
            if not isinstance(self.sampler, OldestFirstSampler):
                logger.debug(
                    "sampler %r overridden oldest-first to keep the bound", self.sampler_name
                )
            return edf
        if all(g.complete for g in self.groups()):
            raise StalenessBoundError(
                f"wait strategy: at version {v} more groups must be trained to stay within "
                f"max_staleness={s} than updates of {self.batch_groups} groups can take; admit "
                f"only while can_admit() > 0"
            )
        return []

    def _feasible(self, chosen: set[str], v: int) -> bool:
        """After taking ``chosen`` at version ``v``, can every other group still be trained
        within the bound, ``batch_groups`` per version, earliest deadline first? What version
        ``v`` has left counts too: a mode that takes a version's groups in several mini-batch
        takes (``fully_async``) may still take ``batch_groups`` − (taken at ``v``) at it."""
        left_now = max(0, self.batch_groups - self._consumed_at_version - len(chosen))
        deadlines = sorted(
            g.oldest_version + self.max_staleness for g in self.groups() if g.uid not in chosen
        )
        return all(i + 1 <= left_now + (d - v) * self.batch_groups for i, d in enumerate(deadlines))

    def _sample_waiting_for(self, k: int, v: int) -> str:
        gs = self.groups()
        ready = sum(g.complete for g in gs)
        return (
            f"{k} complete groups within max_staleness={self.max_staleness} at version {v} "
            f"(strategy {self.strategy}): {ready} complete, {len(gs) - ready} in flight, "
            f"can_admit()={self.can_admit()}"
        )


def _uninformative(scores: list[float | None]) -> bool:
    """DAPO: fewer than two distinct finite scores (zero group-relative advantage)."""
    finite = {float(x) for x in scores if x is not None and math.isfinite(float(x))}
    return len(finite) < 2


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
