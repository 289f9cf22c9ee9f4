"""``one_step_off``: the next batches generate while the current one is taken and trained.

verl's ``colocate_async``: rollout and training share the devices (with
``trainer.async.data_plane=object_store`` on Ray the groups run on replica actors of their own,
on the same schedule). Generation runs ahead of
training through the replay buffer: at a step's start the mode tops the buffer up to
``(2 + trainer.async.num_warmup_batches) × train_batch_size`` untrained groups (within the
buffer's pacing cap ``(max_staleness + 1) × train_batch_size`` and the run's remaining budget),
runs the rollout until the ``train_batch_size`` groups admitted first are complete and scored,
and takes them (``trainer.async.take_order=admission``, the mode's default: no group overtakes
an earlier one, so which prompts train does not depend on how long they took; ``completion``
takes any complete groups, what finishes first). A step whose batch is already complete (the
last step's rollout finished it) takes it without topping up: groups admitted then would be
interrupted before they generate anything (nothing generates during a local update), so the
next step admits them. When there is
nothing to overlap (pure compute, uniform lengths) every other batch is then trained at
staleness 0 and the mode costs what ``sync`` costs. The groups still generating are
**interrupted**: the fleet pauses (their requests are aborted), the actor trains, the weights are
pushed, the fleet resumes — and the rollout client continues each interrupted request on the new
weights (partial rollout; the native engine shares the prompt's prefill among a group's
continuations, ``SamplingParams.continued``). Every
token keeps the version that sampled it (``rollout_policy_version``), so staleness — the
current version minus a group's oldest token version — and the off-policy correction see the
truth.

Why it pays: a sync step waits for its slowest trajectory while the batch's other slots idle;
here the long tail of one batch overlaps the start of the next, and a trajectory waiting on a
tool keeps waiting (the tool still runs) while the actor trains.

Where the scores are needed early (``trainer.async.score_on_completion``: DAPO's filter, a
reward model or a batch reward function) groups are scored as they complete (the reward
overlaps generation; the groups that complete in one loop turn by one reward call), and
``filtered`` (DAPO) and ``failed`` (``reward.max_failure_ratio``) groups are evicted and
refilled at once; otherwise the taken batch is scored whole by the step's reward stage, as in
``sync`` (a per-sample rule still scores each trajectory as it finishes). Stale groups
(``staleness_strategy=drop``) are evicted when an update would take them. The update must
correct for the behaviour policy: PPO clipped against it
(``actor.policy_loss=bypass_mode``: ``r = π_θ/μ``, μ the rollout's log-probs — the two batches of
a pair are sampled by the same weights, and only a trust region around μ stops the second update
from pushing again what the first already pushed; docs/async.md), decoupled PPO
(``actor.policy_loss=decoupled``: clip on π_θ/π_prox, weight π_prox/μ) or rollout correction.
With decoupled PPO and one mini-batch per update π_prox is the update's own first forward
(fused, no extra pass); a loss that reads old log-probs as the behaviour policy (vanilla PPO)
gets them from a separate forward, never fused.

``trainer.deterministic=true`` fixes the interleaving: groups are scored inline, the fleet
pauses the moment the batch is complete, and a checkpoint restarts in-flight trajectories from
their prompts (in this run too), so a resumed run reproduces the uninterrupted one bit for bit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from postrl.protocol import DataProto
from postrl.trainer.asynchronous.feed import AsyncFeed
from postrl.trainer.modes import engine_busy_s, register_trainer

__all__ = ["OneStepOffMode"]


def config_errors(cfg: Any) -> list[str]:
    """What ``one_step_off`` asks of the config (the mode's registered ``config_errors``): a
    staleness bound that admits the batches generated ahead, and the local backend."""
    t, ac, e = cfg.trainer, cfg.trainer.async_, []
    if ac.max_staleness < 1 + max(ac.num_warmup_batches, 0):
        e.append(
            f"trainer.async.max_staleness={ac.max_staleness} with trainer.mode={t.mode} "
            f"and trainer.async.num_warmup_batches={ac.num_warmup_batches}: batches generated "
            f"ahead of training are {1 + ac.num_warmup_batches} version(s) old when trained; "
            f"set trainer.async.max_staleness >= {1 + max(ac.num_warmup_batches, 0)} (or use "
            f"trainer.mode=sync for on-policy training)"
        )
    if t.backend != "local" and not _rollout_side(ac.data_plane):
        e.append(
            f"trainer.mode={t.mode} runs with trainer.backend=local (rollout and training "
            "share this process's devices) unless its trajectories run on replica actors of "
            "their own (a data plane that declares rollout_side: "
            "trainer.async.data_plane=object_store); use trainer.backend=local"
        )
    return e


def _rollout_side(plane: str) -> bool:
    """Whether data plane ``plane`` runs the trajectories on replica actors of their own (its
    declared ``rollout_side`` fact; False for an unknown plane, which validation reports)."""
    from postrl.trainer.planes import DATA_PLANES

    return plane in DATA_PLANES and bool(DATA_PLANES.meta(plane).get("rollout_side"))


@register_trainer(
    "one_step_off",
    on_policy=False,
    object_store=True,
    config_errors=config_errors,
    take_order="admission",
)
class OneStepOffMode:
    """Generation runs one (or ``1 + num_warmup_batches``) batch ahead of training (module
    docstring). Built from a :class:`~postrl.trainer.context.TrainerContext`."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.k = cfg.data.train_batch_size
        self.deterministic = cfg.trainer.deterministic
        self.feed = AsyncFeed(ctx, groups_per_step=self.k, inline_scoring=self.deterministic)
        if self.deterministic:
            self.feed.stream.on_ready = self._pause_when_ready
        # untrained groups at a step's start
        self.ahead = (2 + cfg.trainer.async_.num_warmup_batches) * self.k
        self._taking = False  # inside take (validation also runs the loop)

    # ------------------------------------------------------------------ the step
    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        """Top up the buffer, generate until a batch is complete, take it, pause the rest."""
        ctx, feed = self.ctx, self.feed
        ctx.fleet.wake_up()
        busy0 = engine_busy_s(ctx.fleet.replicas)
        # a batch already complete (within the staleness bound) is taken without a top-up:
        # groups admitted now would only run until the take returns and then be interrupted by
        # the pause below (nothing generates during a local update), and their agent loops
        # would start beside the update; the next step admits them (the top-up is to ``ahead``
        # untrained groups)
        ready = not self.deterministic and len(feed.buffer.takeable()) >= self.k
        admitted = 0 if ready else feed.admit(self._draw, step, ahead=self.ahead)
        self._taking = True
        try:
            batch, metrics = feed.stream.take(self.k, step, ctx.loader.next_prompts)
        finally:
            self._taking = False
        if not self.deterministic:
            ctx.run_async(self._settle())
        ctx.fleet.pause()  # in-flight requests stop here and resume on the new weights
        if ctx.cfg.rollout.free_cache_engine:
            ctx.fleet.sleep()
        busy = engine_busy_s(ctx.fleet.replicas)
        if busy is not None:  # the engines' compute seconds this step (the rest: waiting)
            metrics["timing_s/gen_engine"] = busy - busy0
        metrics.update(feed.occupancy(admitted))
        metrics["async/interrupted_trajectories"] = float(feed.stream.in_flight)
        return batch, feed.taken(metrics)

    async def _settle(self, turns: int = 64) -> None:
        """Let the loop deliver what the engines already finished: trajectories whose last
        token was sampled in the take's last engine steps are scored now, so the next step sees
        their groups complete (and takes them without a top-up). Stops at the first engine step
        (whatever is still generating is left to the pause), when nothing is in flight or
        awaits its score, or after ``turns`` loop turns. Only with an in-process engine that
        counts its steps."""
        busy = engine_busy_s(self.ctx.fleet.replicas)
        if busy is None:
            return
        for _ in range(turns):
            if not self.feed.stream.unsettled:
                return
            await asyncio.sleep(0)
            if engine_busy_s(self.ctx.fleet.replicas) != busy:
                return

    def _draw(self, room: int) -> DataProto | None:
        """Whole batches from the loader while ``room`` holds one."""
        return self.ctx.loader.next_batch() if room >= self.k else None

    def _pause_when_ready(self, ready: int) -> None:
        if (
            self._taking and ready >= self.k
        ):  # deterministic: no token is sampled after the batch completes
            self.ctx.fleet.pause()

    def sync_weights(self) -> dict[str, float]:
        """Push the updated weights, advance the buffer's version, let the interrupted
        requests continue on the new weights."""
        metrics = self.ctx.sync_weights()
        self.feed.buffer.set_version(self.ctx.fleet.version)
        self.ctx.fleet.resume()
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The feed's snapshot (:meth:`AsyncFeed.snapshot
        <postrl.trainer.asynchronous.feed.AsyncFeed.snapshot>`: the loader position, the buffer, the
        groups trained so far). In-flight trajectories restart from their prompts after this call,
        in this run too (a resumed run then continues exactly as this one does)."""
        return self.feed.snapshot()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (pending trajectories start when the rollout next runs)."""
        self.feed.restore(state)

    def close(self) -> None:
        """Cancel the trajectories still running."""
        self.feed.stream.close()
