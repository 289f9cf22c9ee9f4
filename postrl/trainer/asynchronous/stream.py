"""``GroupStream``: prompts in, complete groups out, through the replay buffer.

Every trainer mode draws its batches from one of these, by one path for every data plane::

    runner.run(row) → buffer.generated / finish(key, handle, tag) → runner.collate(
                                                                      buffer.assemble(uids))

The :class:`~postrl.trainer.asynchronous.replay.ReplayBuffer` owns each group (tags, dataset
index, epoch, payloads through its store); the context's runner (:mod:`postrl.trainer.runner`) is
what differs between the planes. A prompt admitted into the buffer becomes ``rollout.n`` tasks on
the context's event loop; each trajectory reports to the buffer as it starts and finishes, and a
complete group is either

* **scored at completion** (``score_on_completion``: DAPO filtering, and the async modes where
  ``trainer.async.score_on_completion`` resolves true) — the
  reward stage scores the group's n rows as one batch (streamed rule scores, reward model, tool
  rewards, shaping: the same code as a whole batch), and the buffer decides from the scores:
  ``filtered`` (no signal) or ``failed`` (failures past ``reward.max_failure_ratio``) groups are
  evicted and one refill prompt is admitted for each, at once; or
* **kept unscored** — the trainer's reward stage scores the taken batch (``sync`` without
  filtering, and the async modes otherwise: the same batch, scored the same way).

:meth:`take` runs the loop until the buffer's sampler hands out ``k`` complete groups within the
staleness bound (event-driven: a group's completion wakes it) and returns them as one batch in
the rollout layout. Trajectories still in flight stay in flight: an async mode pauses the
fleet (their requests are aborted and later resumed on the new weights by the rollout client)
and lets them finish during the next :meth:`take`.

**Nothing is lost**: a group leaves the stream only by being taken (trained) or evicted (and
then refilled). :meth:`state_dict` is the buffer (its tags, every payload it holds, the
prompts in flight) and the refills owed; a run resumed from it dispatches the in-flight prompts
again, so each prompt of an epoch is trained exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from postrl.agent.manager import derive_seed
from postrl.protocol import DataProto
from postrl.reward import RewardFailureError
from postrl.trainer.asynchronous.replay import ReplayBuffer
from postrl.trainer.asynchronous.replay.tags import Eviction
from postrl.trainer.ref_batch import RefBatch

logger = logging.getLogger(__name__)

__all__ = ["GroupStream", "merge_reward_metrics", "off_policy_metrics"]


async def _cancel_sample(sample: asyncio.Task[list[str]]) -> list[str] | None:
    """Cancel a ``buffer.sample`` task and wait until it has stopped; its uids if it completed
    first (the groups it took are then this take's), else None. A cancelled sample that kept
    running would take a later batch that nobody receives."""
    sample.cancel()
    await asyncio.wait({sample})
    if sample.cancelled():
        return None
    return sample.result()


class GroupStream:
    """Admit prompts, generate and score their groups, take complete ones (module docstring).

    Args:
        ctx: the :class:`~postrl.trainer.context.TrainerContext` (its ``runner`` is the data
            plane: :mod:`postrl.trainer.runner`).
        buffer: the replay buffer deciding admission, eviction and sampling, and owning every
            group and its payloads (its ``on_evict`` is set here).
        score_on_completion: score each group as it completes (needed to filter or evict by
            score); else the taken batch is returned unscored (unless the runner's trajectories
            come back scored: ``runner.scores_groups``).
        inline_scoring: score a completed group before the loop runs on (deterministic
            interleaving); else the group's streamed reward futures are awaited as a task, so
            generation continues meanwhile.
        max_refills: most refill prompts per :meth:`take` (None: no limit); past it the batch
            is made of the groups kept.
        oversample: keep ``⌈missing groups / keep rate⌉`` groups in flight during a take
            instead of one refill per eviction, and evict the groups left over when the batch
            is full as ``surplus`` (their prompts are admitted again first by the next take):
            ``algorithm.filter_groups.oversample``, for on-policy modes.
    """

    def __init__(
        self,
        ctx: Any,
        buffer: ReplayBuffer,
        *,
        score_on_completion: bool,
        inline_scoring: bool = True,
        max_refills: int | None = None,
        oversample: bool = False,
    ) -> None:
        self.ctx = ctx
        self.buffer = buffer
        buffer.on_evict = self._on_evict
        self.n = buffer.group_size
        self.runner = ctx.runner
        self.score_on_completion = bool(score_on_completion or self.runner.scores_groups)
        self.inline_scoring = inline_scoring
        self.max_refills = max_refills
        self.oversample = bool(oversample)
        self._keep = [0.0, 0.0]
        """(kept, scored) groups, halved after every take: the keep rate oversampling sizes
        the groups in flight by (part of the mode's checkpoint: a resumed run admits the same)."""
        self.on_ready: Callable[[int], None] | None = None
        """Called with the count of groups a take could choose now (:meth:`ReplayBuffer.takeable
        <postrl.trainer.asynchronous.replay.buffer.ReplayBuffer.takeable>`) whenever a group
        completes."""
        self._rows: dict[str, list[dict[str, Any]]] = {}
        """The trajectory rows of each untrained group (its prompt, derived from the buffer's
        dataset index and dispatch step: what a (re)started trajectory runs)."""
        self._tasks: dict[tuple[str, int], asyncio.Task[Any]] = {}
        self._owed = 0  # refill prompts owed (evictions not yet refilled)
        self._retry: list[tuple[int, int]] = []  # (dataset index, epoch) of stale groups
        self._refills = 0  # refill prompts admitted during the current take
        self._scoring_group: tuple[str, int, list[Any]] | None = None  # (in _score)
        self._dropped: tuple[str, int, list[Any]] | None = None  # a filtered group's payloads
        self._scoring_scores: list[float] = []  # (in _score) the valid scores of that group
        self._to_score: list[str] = []  # generated groups scored at the end of this loop turn
        self._error: BaseException | None = None
        self._last_failure = ""
        self._parts: list[tuple[int, dict[str, float]]] = []  # reward metrics per scored group
        self._wake: asyncio.Future[None] | None = None
        self._counts = dict.fromkeys(("groups", "filtered", "failed", "stale", "surplus"), 0)
        self._sampling = ctx.sampling_params()
        self._by_priority: dict[int, Any] = {}  # the sampling of each dispatch step, made once
        self.reward_metrics: dict[str, float] = {}
        """The reward metrics of the groups scored for the last take (empty when the taken
        batch is returned unscored)."""

    # ------------------------------------------------------------------ admission
    @property
    def in_flight(self) -> int:
        """Trajectories generating or waiting to generate."""
        return len(self._tasks)

    @property
    def unsettled(self) -> bool:
        """Trajectories are in flight, or a generated group awaits its score."""
        return bool(self._tasks) or self._scoring()

    def admit(self, prompts: DataProto, step: int) -> list[str]:
        """Admit one group per prompt row (``dispatch_step = step``) and start its ``n``
        trajectories; returns the group uids."""
        cfg = self.ctx.cfg
        epoch = int(prompts.meta_info.get("epoch", 0))
        epochs = [int(e) for e in prompts.meta_info.get("epochs") or [epoch] * len(prompts)]
        rows = self.ctx.agents.rows(prompts, self.n, seed=cfg.trainer.seed, step=step)
        uids, indices = [], []
        for p in range(len(prompts)):
            grows = rows[p * self.n : (p + 1) * self.n]
            uid = str(grows[0]["uid"])
            if self.buffer.known(uid) or uid in uids:
                # the same row twice in one step (a refill drew it again, a surplus retry of
                # epoch e met its fresh draw of epoch e+1, or one draw across an epoch's end
                # holds a row at the end of epoch e and again at the start of e+1): a group
                # of its own, with its own
                # request ids (an engine keys requests, aborts and resumes by them) and its own
                # samples (the same seeds would generate a copy of the other group)
                nth = self.buffer.admissions + p
                uid = f"{uid}-r{nth}"
                for r in grows:
                    r["uid"] = uid
                    r["request_id"] = f"{r['request_id']}-r{nth}"
                    r["seed"] = derive_seed(int(r["seed"]), nth)
            uids.append(uid)
            indices.append(int(grows[0].get("index", p)))
            self._rows[uid] = grows
        for e in sorted(set(epochs)):  # a draw across an epoch's end: each group its own
            sel = [p for p in range(len(uids)) if epochs[p] == e]
            self.buffer.admit(
                [uids[p] for p in sel],
                dispatch_step=step,
                indices=[indices[p] for p in sel],
                epoch=e,
            )
        for uid in uids:
            for k in range(self.n):
                self._spawn(uid, k)
        return uids

    def _spawn(self, uid: str, k: int) -> None:
        task = self.ctx.create_task(self._run(uid, k))
        self._tasks[(uid, k)] = task
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return  # whoever cancelled (eviction, checkpoint drop) re-dispatches and wakes
        if task.exception() is not None and self._error is None:
            self._error = task.exception()
        # every finished trajectory re-checks the take: the last one of a kept group, ending
        # with the refill budget spent, leaves it starved with nothing else left to wake it
        self._poke()

    async def _run(self, uid: str, k: int) -> None:
        """One trajectory: ``runner.run(row)``, then its payload and tag to the buffer."""
        row = self._rows[uid][k]
        self.buffer.start((uid, k))
        try:
            # older dispatch steps first: an interrupted trajectory resumes before fresh ones
            sampling = self._sampling_at(self.buffer.group(uid).dispatch_step)
            handle = await self.runner.run(row, sampling)
        finally:
            self._tasks.pop((uid, k), None)
        if uid not in self._rows:  # evicted while generating
            return
        tag = _tag(handle)
        if not self.score_on_completion:
            self.buffer.finish((uid, k), handle, **tag)
            self._ready_check()
            return
        # its tag stays open until the group is scored
        self.buffer.generated((uid, k), handle, **tag)
        if not self.buffer.group(uid).generated:
            return
        if self.inline_scoring:
            self._score(uid)
            return
        await self.runner.settle(self.buffer.scoring_payloads(uid))
        self._queue_score(uid)

    def _sampling_at(self, priority: int) -> Any:
        """The rollout's sampling with ``priority`` (a dispatch step): one per step, not one
        per trajectory (the few steps in flight at once are kept)."""
        sp = self._by_priority.get(priority)
        if sp is None:
            if len(self._by_priority) >= 8:
                self._by_priority.clear()
            sp = self._by_priority[priority] = self._sampling.evolve(priority=priority)
        return sp

    def _queue_score(self, uid: str) -> None:
        """Score ``uid`` together with the other groups that complete in this loop turn: one
        ``runner.score_groups`` call for all of them, from a callback scheduled once per turn
        (the groups of a batch that decodes together finish together; scored one by one, each
        paid the assembly's and the reward stage's fixed costs)."""
        self._to_score.append(uid)
        if len(self._to_score) == 1:
            asyncio.get_running_loop().call_soon(self._score_queued)

    def _score_queued(self) -> None:
        uids, self._to_score = self._to_score, []
        try:
            self._score(*uids)
        except Exception as e:  # a callback's error would only reach the loop's log
            if self._error is None:
                self._error = e
        self._poke()

    def _score(self, *uids: str) -> None:
        """Score complete groups with one ``runner.score_groups`` call and report their
        trajectories to the buffer (which evicts a group when filtered or failed); groups evicted
        or scored meanwhile are skipped."""
        uids = tuple(u for u in uids if u in self._rows and self.buffer.group(u).generated)
        if not uids:
            return
        results, metrics = self.runner.score_groups([self.buffer.scoring_payloads(u) for u in uids])
        self._parts.append((self.n * len(uids), metrics))
        for uid, (payloads, scores, valid) in zip(uids, results):
            self._report(uid, payloads, scores, valid, metrics, len(uids))

    def _report(
        self,
        uid: str,
        payloads: list[Any],
        scores: list[float],
        valid: list[bool],
        metrics: dict[str, float],
        together: int = 1,
    ) -> None:
        """A scored group's trajectories to the buffer (which evicts it when filtered or
        failed); ``metrics`` are those of the ``together`` groups scored in one call."""
        if uid not in self._rows:  # evicted meanwhile
            return
        g = self.buffer.group(uid)
        self._counts["groups"] += 1
        self._scoring_group = (uid, g.index, payloads)
        self._scoring_scores = [float(x) for x, v in zip(scores, valid) if v]
        try:
            for k in range(self.n):
                if uid not in self._rows:
                    break  # evicted by an earlier trajectory's report
                if valid[k]:
                    self.buffer.finish(
                        (uid, k), payloads[k], **_tag(payloads[k]), score=float(scores[k])
                    )
                else:
                    self._last_failure = (
                        f"group {uid}: {valid.count(False)} of {self.n} rows failed ("
                        + ", ".join(
                            f"{m}={int(v)}"
                            for m, v in metrics.items()
                            if m.startswith("reward/failed/")
                        )
                        + (
                            f"; counts over the {together} groups scored with it)"
                            if together > 1
                            else ")"
                        )
                    )
                    self.buffer.fail((uid, k), "reward", payload=payloads[k])
        finally:
            self._scoring_group = None
        if uid in self._rows:
            self._ready_check()

    def _ready_check(self) -> None:
        if self.on_ready is not None:
            self.on_ready(len(self.buffer.takeable()))

    def _on_evict(self, e: Eviction) -> None:
        known = self._rows.pop(e.uid, None) is not None
        for k in range(self.n):
            task = self._tasks.pop((e.uid, k), None)
            if task is not None:
                task.cancel()
        if e.reason == "filtered" and self._scoring_group and self._scoring_group[0] == e.uid:
            self._dropped = self._scoring_group  # (the all-masked fallback of an empty take)
            # the prompt sampler learns from the groups dynamic sampling throws away too (the
            # trainer reports the trained ones): a `greso` sampler skips such prompts next time
            s = self._scoring_scores
            self.ctx.loader.observe([e.index] * len(s), [e.uid] * len(s), s)
        if e.reason in ("stale", "surplus") and known:  # not a bad prompt: its refill is
            self._retry.append((e.index, e.epoch))  # itself, on the current weights
        self._counts[e.reason] += 1
        if e.reason != "surplus":  # a surplus group was never part of the batch
            self._owed += 1
        self._poke()

    def refill(self, step: int, draw: Callable[[int], DataProto], top_up: bool = True) -> int:
        """Admit one prompt per eviction not yet refilled, within ``max_refills``; returns how
        many were admitted. A group evicted as stale is refilled with its own prompt (same
        dataset row, same epoch: every prompt of an epoch is still trained once); a filtered or
        failed one with the next prompt (``draw(1)``). With ``oversample`` the evictions are not
        refilled one by one: ``top_up`` admits what :meth:`_top_up_count` asks for."""
        if self.oversample:
            self._owed = 0
            want = self._top_up_count() if top_up else 0
        else:
            want = self._owed
        n = 0
        while want > n and (self.max_refills is None or self._refills < self.max_refills):
            if not self.oversample:
                self._owed -= 1
            self._refills += 1
            self.admit(self._retry_prompt() if self._retry else draw(1), step)
            n += 1
        return n

    def _top_up_count(self) -> int:
        """Groups to admit now so that the groups in flight, kept at the measured rate, fill
        the batch: ``⌈missing / rate⌉ − in flight``, within the buffer's cap. The rate is
        ``(kept + 1) / (scored + 1)`` over the recent takes and this one so far (1 before any
        group is scored: a first step whose groups are all kept generates no more than
        without oversampling)."""
        groups = self.buffer.groups()
        ready = sum(1 for g in groups if g.complete)
        missing = self.buffer.batch_groups - ready
        if missing <= 0:
            return 0
        kept = self._keep[0] + self._kept_this_take()
        rate = (kept + 1.0) / (self._keep[1] + self._counts["groups"] + 1.0)
        want = int(np.ceil(missing / rate)) - (len(groups) - ready)
        return max(0, min(want, self.buffer.can_admit()))

    def _kept_this_take(self) -> int:
        """Groups scored since the take began and not evicted for their scores."""
        c = self._counts
        return c["groups"] - c["filtered"] - c["failed"]

    def release_surplus(self) -> int:
        """Evict every group left in the buffer as ``surplus`` (``oversample``: the batch is
        full; on new weights they would be stale) and cancel their trajectories; their prompts
        are admitted again first. Returns how many were evicted."""
        uids = [g.uid for g in self.buffer.groups()]
        for uid in uids:
            self.buffer.evict(uid, "surplus")
        return len(uids)

    def carry_state(self) -> dict[str, Any]:
        """What an on-policy mode's checkpoint must carry from one take to the next: the
        prompts to admit again (``surplus``) and the keep rate (JSON-safe)."""
        return {"retry": [[i, e] for i, e in self._retry], "keep": list(self._keep)}

    def load_carry_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`carry_state` (an empty dict: nothing carried)."""
        self._retry = [(int(i), int(e)) for i, e in state.get("retry", [])]
        self._keep = [float(x) for x in state.get("keep", [0.0, 0.0])]

    def _retry_prompt(self) -> DataProto:
        index, epoch = self._retry.pop(0)
        prompts = self.ctx.loader.dataset.batch([index])
        prompts.meta_info["epoch"] = epoch
        return prompts

    # ------------------------------------------------------------------ taking
    def take(
        self, k: int, step: int, draw: Callable[[int], DataProto]
    ) -> tuple[DataProto, dict[str, float]]:
        """Run the loop until ``k`` complete groups can be taken (refilling evictions from
        ``draw`` meanwhile); returns them as one batch and the ``dynamic_sampling/*`` /
        reward metrics. With refills exhausted and nothing in flight, the groups kept so far
        form the batch (none: a filtered group with every token masked, no update)."""
        return self.ctx.run_async(self.take_async(k, step, draw))

    async def take_async(
        self, k: int, step: int, draw: Callable[[int], DataProto]
    ) -> tuple[DataProto, dict[str, float]]:
        """:meth:`take` as a coroutine on the context's loop (a mode whose loop runs in a
        thread of its own awaits this there, so the stream is only touched from that thread)."""
        t0 = time.perf_counter()
        uids = await self._take(k, step, draw)
        taken = [self.buffer.group(u) for u in uids]
        if self.oversample:
            self._keep = [
                self._keep[0] / 2 + self._kept_this_take(),
                self._keep[1] / 2 + self._counts["groups"],
            ]
            cancelled = list(self._tasks.values())  # every trajectory left is a surplus one
            self.release_surplus()
            if cancelled:  # their requests are aborted before the fleet sleeps
                await asyncio.gather(*cancelled, return_exceptions=True)
        payloads: dict[str, list[Any]] = {u: [] for u in uids}
        for tag, payload in self.buffer.assemble(uids):  # the one read of the data plane
            payloads[tag.group_uid].append(payload)
        for u in uids:
            self._rows.pop(u, None)
        metrics: dict[str, float] = {}
        if not taken:  # nothing to train: a filtered group, every token masked
            if self._dropped is None:
                raise RuntimeError(
                    f"no group to train on at step {step}: the loader ran dry or every refill "
                    f"was evicted; check algorithm.filter_groups and the data"
                )
            batch = self.runner.masked(self.runner.collate([self._dropped], scored=True))
        else:
            groups = [(g.uid, g.index, payloads[g.uid]) for g in taken]
            batch = self.runner.collate(groups, scored=self.score_on_completion)
        batch.meta_info["epoch"] = min((g.epoch for g in taken), default=0)
        batch.meta_info["group_epochs"] = {g.uid: g.epoch for g in taken}
        batch.meta_info["timing_s/agent_loop"] = time.perf_counter() - t0
        self.reward_metrics = {}
        if self._parts:  # every group scored since the last take, kept or evicted
            parts, self._parts = self._parts, []
            self.reward_metrics = merge_reward_metrics(parts)
            metrics.update(self.reward_metrics)
        c = dict(self._counts)
        metrics.update(self._take_metrics(len(taken)))
        metrics.update(off_policy_metrics(batch, self.buffer.version))
        metrics["training/off_policy/evicted_samples"] = float(
            self.n * (c["stale"] + c["filtered"] + c["failed"])
        )
        return batch, metrics

    async def _take(self, k: int, step: int, draw: Callable[[int], DataProto]) -> list[str]:
        self._refills = 0
        loop = asyncio.get_running_loop()
        sample = loop.create_task(self.buffer.sample(k))
        try:
            while True:
                self._raise_error()
                if self._counts["failed"] > k:
                    raise RewardFailureError(
                        f"{self._counts['failed']} groups were evicted for reward failures while "
                        f"gathering one batch of {k} (more than reward.max_failure_ratio="
                        f"{self.buffer.max_failure_ratio} of their samples failed); the last: "
                        f"{self._last_failure}. Fix the reward function or raise "
                        f"reward.max_failure_ratio"
                    )
                self.refill(step, draw, top_up=not sample.done())
                if sample.done():
                    return sample.result()
                ready = [s for s in self.buffer.groups() if s.complete]
                starved = not self.unsettled and (
                    self._owed == 0
                    or self.max_refills is not None
                    and self._refills >= self.max_refills
                )
                if starved and len(ready) < k:
                    self._check_stalled()
                    # the budget is per take: evictions it could not refill (already counted
                    # as dropped) are not owed to the next one, whose own batch fills the cap
                    self._owed = 0
                    taken = await _cancel_sample(sample)
                    if taken is not None:  # it took a full batch as the cancel landed
                        return taken
                    return await self._take_short(len(ready))
                self._wake = loop.create_future()
                await asyncio.wait({sample, self._wake}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._wake = None
            if not sample.done():
                sample.cancel()

    def _check_stalled(self) -> None:
        """Nothing runs and nothing is owed: every untrained group must be complete. One that
        is not would wait forever; name it (a bug, never a silently short batch)."""
        stalled = [s for s in self.buffer.groups() if not s.complete]
        if stalled:
            detail = "; ".join(
                f"{s.uid}: tags {[t.status.value for t in s.tags]}" for s in stalled[:3]
            )
            raise RuntimeError(
                f"rollout stalled: {len(stalled)} untrained groups are incomplete with no "
                f"trajectory running or being scored ({detail})"
            )

    async def _take_short(self, n: int) -> list[str]:
        if n:
            logger.warning(
                "dynamic sampling: %d informative groups of the %d wanted after %d refills "
                "(algorithm.filter_groups.max_num_gen_batches); training on those",
                n,
                self.buffer.batch_groups,
                self._refills,
            )
            return await self.buffer.sample(n)
        return []

    def _scoring(self) -> bool:
        """A group is generated and awaits its score (a scoring task runs)."""
        return any(s.generated for s in self.buffer.groups())

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _take_metrics(self, kept: int) -> dict[str, float]:
        c, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        m = {
            "dynamic_sampling/num_groups": float(c["groups"]),
            "dynamic_sampling/num_kept_groups": float(kept),
            "dynamic_sampling/num_dropped_groups": float(c["filtered"]),
            "dynamic_sampling/skipped_update": 0.0 if kept else 1.0,
            "dynamic_sampling/gen_rounds": 1.0
            + float(np.ceil(self._refills / max(self.buffer.batch_groups, 1))),
            "dynamic_sampling/refill_exhausted": float(kept < self.buffer.batch_groups),
            "replay/refills": float(self._refills),
        }
        m.update(self.buffer.metrics())
        return m

    # ------------------------------------------------------------------ checkpoints
    def drop_in_flight(self) -> int:
        """Cancel every running trajectory and mark it pending (its progress is discarded; it
        is dispatched again by :meth:`resume_pending`). Returns how many were dropped."""
        tasks = self._cancel_all()
        for key in tasks:
            self.buffer.restart(key)
        return len(tasks)

    def resume_pending(self) -> None:
        """Start every pending trajectory of the buffer (after :meth:`drop_in_flight` or a load)."""
        for key in self.buffer.pending_keys():
            if key not in self._tasks:
                self._spawn(*key)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the buffer (its control plane, and every payload it holds as the
        trajectory's ``AgentLoopOutput`` fields), the refills owed. Call after
        :meth:`drop_in_flight` (running trajectories are saved as pending prompts)."""
        return {
            "buffer": self.buffer.state_dict(),
            "payloads": [
                [uid, k, self.runner.to_json(p)] for (uid, k), p in self.buffer.payloads().items()
            ],
            "owed": self._owed,
            "retry": [[i, e] for i, e in self._retry],
            "parts": [[n, m] for n, m in self._parts],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` from the buffer alone: each group's rows from its
        dataset index and dispatch step, its payloads restored and — for a group already scored —
        scored again (deterministic rewards give the same scores); pending trajectories start
        when the loop next runs, a generated group is scored."""
        ds, cfg = self.ctx.loader.dataset, self.ctx.cfg
        state = _upgrade(state)
        bstate = state["buffer"]
        self._rows = {}
        for d in (*bstate["groups"], *bstate["taken"]):
            prompts = ds.batch([int(d["index"])])
            rows = self.ctx.agents.rows(
                prompts, self.n, seed=cfg.trainer.seed, step=int(d["dispatch_step"])
            )
            for r in rows:
                r["uid"] = d["uid"]
            self._rows[d["uid"]] = rows
        restored: dict[str, dict[int, Any]] = {}
        for uid, k, d in state["payloads"]:
            restored.setdefault(uid, {})[int(k)] = self.runner.from_json(d, self._rows[uid][int(k)])
        terminal = ("finished", "failed")
        for d in (*bstate["groups"], *bstate["taken"]):
            have = restored.get(d["uid"], {})
            scored = all(t["status"] in terminal for t in d["tags"])
            if self.score_on_completion and scored and len(have) == self.n:
                payloads, _, _, _ = self.runner.score([have[k] for k in range(self.n)])
                have.update(enumerate(payloads))
        on_evict, self.buffer.on_evict = self.buffer.on_evict, None
        self.buffer.load_state_dict(
            bstate, {(u, k): p for u, ps in restored.items() for k, p in ps.items()}
        )
        self.buffer.on_evict = on_evict
        self._owed = int(state["owed"])
        self._retry = [(int(i), int(e)) for i, e in state.get("retry", [])]
        self._parts = [(int(n), dict(m)) for n, m in state.get("parts", [])]
        for g in self.buffer.groups():
            if g.generated:
                self._score(g.uid)
        self.resume_pending()

    async def drop_in_flight_async(self) -> int:
        """:meth:`drop_in_flight` as a coroutine on the context's loop."""
        tasks = self._cancel_tasks()
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        for key in tasks:
            self.buffer.restart(key)
        return len(tasks)

    def close(self) -> None:
        """Cancel every task still running (their requests are aborted on the replicas)."""
        self._cancel_all()

    async def close_async(self) -> None:
        """:meth:`close` as a coroutine on the context's loop."""
        tasks = self._cancel_tasks()
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    def _cancel_tasks(self) -> dict[tuple[str, int], asyncio.Task[Any]]:
        tasks, self._tasks = self._tasks, {}
        for task in tasks.values():
            task.cancel()
        return tasks

    def _cancel_all(self) -> dict[tuple[str, int], asyncio.Task[Any]]:
        tasks = self._cancel_tasks()
        if tasks and not self.ctx.closed:  # let the cancellations run
            self.ctx.run_async(asyncio.gather(*tasks.values(), return_exceptions=True))
        return tasks


def off_policy_metrics(batch: Any, version: int) -> dict[str, float]:
    """verl's ``training/off_policy/*`` per-trajectory numbers of a taken batch, from
    ``rollout_policy_version`` (B, R; -1 where unknown) — or from the rows' version tags of a
    :class:`~postrl.trainer.ref_batch.RefBatch`: ``trajectory_staleness`` = ``version`` −
    the row's oldest token version, ``trajectory_spans`` = how many policy versions sampled the
    row (2 = interrupted once and resumed on newer weights); mean / max / min over rows with a
    known version."""
    if isinstance(batch, RefBatch):
        nt = batch.non_tensor_batch
        lo, spans = torch.as_tensor(nt["min_version"]), torch.as_tensor(nt["spans"])
        rows = lo >= 0
        if not bool(rows.any()):
            return {}
        return _staleness_stats(version - lo[rows], spans[rows])
    v = batch.batch.get("rollout_policy_version")
    if v is None:
        return {}
    known = v >= 0  # (B, R)
    rows = known.any(-1)  # (B,)
    if not bool(rows.any()):
        return {}
    v, known = v[rows], known[rows]
    big = torch.iinfo(v.dtype).max
    lo = torch.where(known, v, big).min(-1).values  # (B',)
    hi = torch.where(known, v, -1).max(-1).values
    spans = torch.zeros_like(lo)
    for d in range(int((hi - lo).max()) + 1):  # a handful of versions (≤ max_staleness + 1)
        spans += ((v == (lo + d)[:, None]) & known).any(-1).long()
    return _staleness_stats(version - lo, spans)


def _staleness_stats(staleness: torch.Tensor, spans: torch.Tensor) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, x in (("trajectory_staleness", staleness), ("trajectory_spans", spans)):
        x = x.double()
        out[f"training/off_policy/{name}/mean"] = float(x.mean())
        out[f"training/off_policy/{name}/max"] = float(x.max())
        out[f"training/off_policy/{name}/min"] = float(x.min())
    return out


def _tag(handle: Any) -> dict[str, Any]:
    """What a trajectory's tag records of its handle: lengths and the policy-version segments
    of its sampled tokens (unknown versions left out)."""
    return {
        "prompt_len": int(handle.prompt_len),
        "response_len": int(handle.response_len),
        "versions": [
            (int(n), int(v))
            for n, v in (handle.response_versions or [])
            if v is not None and v >= 0
        ],
    }


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written before the buffer owned the groups (``groups``: each group's
    dataset index, epoch and outputs) in today's layout (the index and epoch on the buffer's
    groups, the outputs as ``payloads``)."""
    if "payloads" in state:
        return state
    info = {d["uid"]: d for d in state["groups"]}
    buffer = dict(state["buffer"])
    for part in ("groups", "taken"):
        buffer[part] = [
            {
                **g,
                "index": int(info.get(g["uid"], {}).get("index", -1)),
                "epoch": int(info.get(g["uid"], {}).get("epoch", 0)),
            }
            for g in buffer[part]
        ]
    payloads = [[d["uid"], int(k), o] for d in state["groups"] for k, o in d["outputs"].items()]
    return {**state, "buffer": buffer, "payloads": payloads}


def merge_reward_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Reward metrics of several scored parts: counts and timings summed, the rest
    row-weighted means."""
    if len(parts) == 1:
        return dict(parts[0][1])
    out: dict[str, float] = {}
    rows = sum(n for n, _ in parts)
    summed = ("reward/generated", "reward/scored", "reward/failed/", "timing_s/")
    for key in {k for _, m in parts for k in m}:
        vals = [(n, m[key]) for n, m in parts if key in m]
        if key.startswith(summed) or key.endswith("truncated"):
            out[key] = float(sum(v for _, v in vals))
        else:
            out[key] = float(sum(n * v for n, v in vals) / max(rows, 1))
    return out
