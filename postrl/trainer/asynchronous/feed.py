"""``AsyncFeed``: the replay side both off-policy modes hold, so each mode keeps only its schedule.

``one_step_off`` and ``fully_async`` differ in *when* they fill the buffer, take a batch, pause
the fleet and push weights. What they share is here, once:

* the **stream** — the replay buffer and
  :class:`~postrl.trainer.asynchronous.stream.GroupStream` of an off-policy mode: groups scored as
  they complete, bounded by ``trainer.async.*`` (``max_staleness``, ``staleness_strategy``,
  ``timeout_s``), ``data.train_batch_size`` groups per policy version, DAPO refills
  (``algorithm.filter_groups``) within :func:`~postrl.trainer.modes.refill_limit`;
* the **admission budget** — :meth:`AsyncFeed.room`: how many groups may be admitted now, given
  the buffer's pacing cap ``(max_staleness + 1) × train_batch_size``, the run's remaining budget
  (``total_steps × groups_per_step`` less the groups trained and those untrained in the buffer:
  nothing is generated that the run will not train) and, optionally, a mode's own target of
  untrained groups; :meth:`AsyncFeed.admit` admits what the mode's ``draw(room)`` hands out;
* the **taken batch's bookkeeping** — :meth:`AsyncFeed.taken` counts the groups a step trains
  (the budget) and leaves the ``dynamic_sampling/*`` metrics out unless
  ``algorithm.filter_groups.enable`` (nothing is filtered then: they would only say so);
* **snapshot / restore** — :meth:`AsyncFeed.snapshot` (or :meth:`snapshot_async` on the
  context's loop thread) and :meth:`AsyncFeed.restore`: the loader position, the stream (the
  buffer: finished trajectories with their data, in-flight prompts as prompts, refills owed)
  and the groups trained so far. In-flight trajectories restart from their prompts at a
  snapshot, in this run too, so a resumed run continues exactly as this one does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from postrl.config.validate import take_order
from postrl.protocol import DataProto
from postrl.trainer.asynchronous.replay import ReplayBuffer
from postrl.trainer.asynchronous.stream import GroupStream
from postrl.trainer.modes import refill_limit

logger = logging.getLogger(__name__)

__all__ = ["AsyncFeed", "score_on_completion"]


def score_on_completion(cfg: Any) -> bool:
    """``trainer.async.score_on_completion`` resolved (its docstring): when unset, groups are
    scored as they complete only where that buys something — DAPO's filter needs the scores to
    evict, and a reward model or a batch reward function is hidden behind the generation —
    and otherwise the taken batch is scored at once, as ``sync`` scores it."""
    from postrl.reward.registry import REWARD_FNS

    explicit = cfg.trainer.async_.score_on_completion
    if explicit is not None:
        return bool(explicit)
    return bool(
        cfg.algorithm.filter_groups.enable
        or cfg.reward.model.enable
        or cfg.reward.custom_function.batch
        or any(REWARD_FNS.meta(name).get("batch") for name in REWARD_FNS.names())
    )


class AsyncFeed:
    """Stream, admission budget, taken-batch bookkeeping and checkpoints of an off-policy mode
    (module docstring).

    Args:
        ctx: the :class:`~postrl.trainer.context.TrainerContext`.
        groups_per_step: groups one step trains (``one_step_off``: ``data.train_batch_size``;
            ``fully_async``: ``actor.ppo_mini_batch_size``); the run's budget is
            ``ctx.total_steps ×`` this.
        inline_scoring: score a completed group before the loop runs on (deterministic
            interleaving), else as a task while generation continues.
    """

    def __init__(self, ctx: Any, *, groups_per_step: int, inline_scoring: bool) -> None:
        cfg = ctx.cfg
        ac, fg = cfg.trainer.async_, cfg.algorithm.filter_groups
        self.ctx = ctx
        self.groups_per_step = groups_per_step
        self.filtering = bool(fg.enable)
        buffer = ReplayBuffer(
            cfg.rollout.n,
            cfg.data.train_batch_size,
            max_staleness=ac.max_staleness,
            strategy=ac.staleness_strategy,
            take_order=take_order(cfg),
            sampler=cfg.trainer.sampler,
            filter_groups=fg.enable,
            max_failure_ratio=cfg.reward.max_failure_ratio,
            timeout_s=ac.timeout_s,
        )
        self.stream = GroupStream(
            ctx,
            buffer,
            score_on_completion=score_on_completion(cfg),
            inline_scoring=inline_scoring,
            max_refills=refill_limit(cfg) if fg.enable else None,
        )
        self.buffer = buffer
        self.trained = 0
        """Groups taken so far (the admission budget's spent part)."""

    # ------------------------------------------------------------------ admission
    def room(self, ahead: int | None = None) -> int:
        """Groups that may be admitted now: the buffer's pacing cap; with ``ctx.total_steps``,
        no more than the run will still train; with ``ahead``, no more than brings the
        untrained groups to ``ahead``."""
        untrained = len(self.buffer.groups())
        room = self.buffer.can_admit()
        if ahead is not None:
            room = min(room, ahead - untrained)
        if self.ctx.total_steps:
            budget = self.ctx.total_steps * self.groups_per_step
            room = min(room, budget - self.trained - untrained)
        return room

    def admit(
        self, draw: Callable[[int], DataProto | None], step: int, *, ahead: int | None = None
    ) -> int:
        """Admit the prompts ``draw(room)`` returns (:meth:`room` with ``ahead``) until it
        returns None, each group dispatched at ``step``; returns how many groups."""
        n = 0
        while (prompts := draw(self.room(ahead))) is not None:
            self.stream.admit(prompts, step)
            n += len(prompts)
        return n

    def occupancy(self, admitted: int) -> dict[str, float]:
        """``async/admitted_groups`` (``admitted``) and ``async/in_flight_groups`` (groups
        untrained in the buffer now)."""
        return {
            "async/admitted_groups": float(admitted),
            "async/in_flight_groups": float(len(self.buffer.groups())),
        }

    # ------------------------------------------------------------------ the taken batch
    def taken(self, metrics: dict[str, float]) -> dict[str, float]:
        """Count the groups a take kept (``dynamic_sampling/num_kept_groups``) as trained and
        return the step's metrics, without ``dynamic_sampling/*`` unless filtering is on."""
        self.trained += int(metrics["dynamic_sampling/num_kept_groups"])
        if self.filtering:
            return metrics
        return {k: v for k, v in metrics.items() if not k.startswith("dynamic_sampling/")}

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> dict[str, Any]:
        """The feed's state for a checkpoint (module docstring; plain JSON values). In-flight
        trajectories restart from their prompts after this call."""
        return self._state(self.stream.drop_in_flight())

    async def snapshot_async(self) -> dict[str, Any]:
        """:meth:`snapshot` as a coroutine on the context's loop thread."""
        return self._state(await self.stream.drop_in_flight_async())

    def _state(self, dropped: int) -> dict[str, Any]:
        if dropped:
            logger.info("checkpoint: %d in-flight trajectories restart from their prompts", dropped)
        state = {
            "loader": self.ctx.loader.state_dict(),
            "stream": self.stream.state_dict(),
            "trained": self.trained,
        }
        self.stream.resume_pending()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Restore :meth:`snapshot` (pending trajectories start when the rollout next runs)."""
        self.ctx.loader.load_state_dict(state["loader"])
        self.trained = int(state["trained"])
        self.stream.load_state_dict(state["stream"])
