"""``fully_async`` (alias ``separate_async``): rollout replicas on cores of their own never wait
for training.

verl's ``separate_async`` (formerly ``fully_async``). The rollout replicas run in **processes of
their own** (``trainer.backend=local``: ``rollout.num_replicas`` processes with
``trainer.async.rollout_threads`` torch threads each, served over HTTP on 127.0.0.1 by
``postrl.rollout.replica_process``); the trainer process keeps the rest of the cores and
borrows an idle replica's between decoder layers (``trainer.lend_cores``,
:mod:`postrl.protocol.cores`); weights reach a replica through a buffer both map
(:class:`~postrl.weights.buckets.SharedWeightBuffer`). The
trainer's event loop runs in a background thread, so agent loops, tool calls, reward scoring
and the traffic to the replicas go on while the main thread trains.

One step trains **one PPO mini-batch** (``actor.ppo_mini_batch_size`` groups: one optimizer
step), taken from the replay buffer as soon as that many groups are complete (and scored, where
``trainer.async.score_on_completion`` resolves true; else the step's reward stage scores it);
weights are pushed every ``trainer.async.parameter_sync_step`` steps
(``data.train_batch_size = parameter_sync_step × ppo_mini_batch_size``: the samples between two
pushes, and the unit of the staleness bound). An epoch is ``parameter_sync_step`` × as many
steps as in ``sync``, and the learning-rate horizon counts them.

**Weights move without stopping the world**: each replica receives the bucket frames of a push
while it keeps serving; at the last frame it holds its engine for the swap only (no request is
aborted), recomputes the KV cache of its running requests under the new weights and continues
them; every token keeps the version that sampled it (``rollout_policy_version``), so staleness
and the decoupled-PPO correction see the truth. ``weights/pause_s`` / ``weights/recompute_s``
report the swap.

Admission is paced by the buffer: at most ``(max_staleness + 1) × train_batch_size`` groups
are untrained at once, and no more than the run will train. **Replicas may die**: a replica
whose process exits, or that answers no health ping for ``replica_health_timeout_s`` while its
process makes no CPU progress (hung), is declared dead (a silent replica whose process keeps
working is slow, not dead: ``rollout/replica_busy_pings``), its waiting requests are re-issued
to the live replicas (``rollout/replica_failures``, ``rollout/reissued_requests``). A dead
replica is started again in the background (:class:`~postrl.rollout.restart.ReplicaRestarter`,
``trainer.async.max_replica_restarts`` per run) and joins at a later weight push, right after
it, with exactly that push's weights (``rollout/replica_restarts``); when the last one died,
requests wait for the replacement, which the trainer puts in service as soon as it is up with
the actor's current weights as a new version. A restart that fails is counted
(``rollout/replica_restart_failures``) and tried again while the budget lasts; the run stops
with a named error when a failed restart leaves no budget (``ReplicaRestartError``) or when no
replica is left and none may be restarted. With ``trainer.backend=ray`` the replicas are Ray
actors on a placement group of their own (:class:`~postrl.rollout.dedicated.DedicatedReplicas`);
with ``trainer.async.data_plane=object_store`` they also run the agent loops and the reward and
keep the trajectories in Ray's object store, and the driver trains from tags and references
(:mod:`postrl.trainer.object_store`).

Checkpoints hold the buffer exactly as ``one_step_off``'s do (finished trajectories with their
data, in-flight prompts as prompts), so a killed run resumes with every prompt trained once.
The interleaving depends on process timing: runs are not bit-reproducible
(``trainer.deterministic`` is refused).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from postrl.protocol import DataProto
from postrl.trainer.asynchronous.feed import AsyncFeed
from postrl.trainer.asynchronous.idle_switch import IdleSwitch
from postrl.trainer.modes import register_trainer

logger = logging.getLogger(__name__)

__all__ = ["FullyAsyncMode"]


def config_errors(cfg: Any) -> list[str]:
    """What ``fully_async`` asks of the config (registered as the mode's ``config_errors``;
    config validation calls it): one mini-batch per step and a push every
    ``parameter_sync_step`` steps, staleness >= 1, replica processes' settings, no determinism,
    the idle switch's settings."""
    t, ac, e = cfg.trainer, cfg.trainer.async_, []
    mini, k = cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if ac.parameter_sync_step < 1:
        e.append(f"trainer.async.parameter_sync_step={ac.parameter_sync_step} must be >= 1")
    elif k != ac.parameter_sync_step * mini:
        e.append(
            f"data.train_batch_size={k} with trainer.mode={t.mode}: a step trains one mini-batch "
            f"and weights are pushed every trainer.async.parameter_sync_step="
            f"{ac.parameter_sync_step} steps, so data.train_batch_size must equal "
            f"parameter_sync_step × actor.ppo_mini_batch_size = {ac.parameter_sync_step * mini}; "
            f"set data.train_batch_size={ac.parameter_sync_step * mini} or "
            f"actor.ppo_mini_batch_size={max(k // max(ac.parameter_sync_step, 1), 1)}"
        )
    if ac.max_staleness < 1:
        e.append(
            f"trainer.async.max_staleness={ac.max_staleness} with trainer.mode={t.mode}: the "
            f"replicas generate while weights move, so groups span versions; set "
            f"trainer.async.max_staleness >= 1 (or use trainer.mode=sync)"
        )
    if ac.rollout_threads < 1:
        e.append(f"trainer.async.rollout_threads={ac.rollout_threads} must be >= 1")
    if ac.replica_health_interval_s <= 0 or ac.replica_health_timeout_s <= 0:
        e.append(
            f"trainer.async.replica_health_interval_s={ac.replica_health_interval_s} and "
            f"replica_health_timeout_s={ac.replica_health_timeout_s} must be > 0 (seconds)"
        )
    if ac.replica_busy_timeout_s < 0:
        e.append(
            f"trainer.async.replica_busy_timeout_s={ac.replica_busy_timeout_s} must be >= 0 "
            f"(seconds; 0 = max(10 × replica_health_timeout_s, 60))"
        )
    if t.deterministic:
        e.append(
            f"trainer.deterministic=true with trainer.mode={t.mode}: rollout processes run "
            f"concurrently with training, so the interleaving is not reproducible; use "
            f"trainer.mode=one_step_off for bit-exact async runs"
        )
    if not 0 <= ac.rollout_nice <= 19:
        e.append(f"trainer.async.rollout_nice={ac.rollout_nice} must be in 0..19 (os.nice)")
    if ac.max_replica_restarts < 0:
        e.append(
            f"trainer.async.max_replica_restarts={ac.max_replica_restarts} must be >= 0 "
            f"(0: a dead rollout replica is not started again)"
        )
    if ac.idle_switch not in ("never", "auto", "always"):
        e.append(f"trainer.async.idle_switch={ac.idle_switch!r} must be one of never, auto, always")
    elif ac.idle_switch != "never" and t.backend != "local":
        e.append(
            f"trainer.async.idle_switch={ac.idle_switch} with trainer.backend={t.backend}: the "
            f"idle switch loads the actor's weights into a replica in the trainer process, "
            f"which needs the in-process actor; set trainer.backend=local or "
            f"trainer.async.idle_switch=never"
        )
    return e


_FACTS: dict[str, Any] = dict(
    on_policy=False,
    dedicated_rollout=True,
    minibatch_steps=True,
    idle_switch=True,
    object_store=True,
    config_errors=config_errors,
    take_order="completion",
)
"""What ``fully_async`` declares in its registry entry (and ``separate_async``, its alias)."""


@register_trainer("fully_async", **_FACTS)
class FullyAsyncMode:
    """Continuous generation on dedicated replicas, one mini-batch per step (module docstring).
    Built from a :class:`~postrl.trainer.context.TrainerContext` whose fleet holds
    :class:`~postrl.rollout.http_replica.HTTPRolloutReplica` handles."""

    def __init__(self, ctx: Any) -> None:
        from postrl.rollout.watchdog import ReplicaWatchdog

        self.ctx = ctx
        cfg = ctx.cfg
        ac = cfg.trainer.async_
        self.k = cfg.data.train_batch_size  # groups per policy version
        self.mini = cfg.actor.ppo_mini_batch_size  # groups per step
        self.sync_every = ac.parameter_sync_step
        self.feed = AsyncFeed(ctx, groups_per_step=self.mini, inline_scoring=False)
        self.step = 0  # the step whose update the next sync_weights pushes (0: the first push)
        self.watchdog = ReplicaWatchdog(
            ctx.fleet.replicas,
            ac.replica_health_interval_s,
            ac.replica_health_timeout_s,
            ac.replica_busy_timeout_s or None,
        )
        ctx.fleet.enable_restarts(ctx.replica_spawner or _no_spawner, ac.max_replica_restarts)
        self.restarter = ctx.fleet.restarter
        self.switch: IdleSwitch | None = None
        if ac.idle_switch != "never":  # made before the loop thread starts: it loads weights
            self.switch = IdleSwitch(ctx, ac.idle_switch)
        ctx.start_background()
        self._watch = ctx.run_async(self._start_watchdog())
        self._last_take = time.perf_counter()
        self._admitted_at_sync = 0  # admitted after the last push: counted in the next step
        self._restore: dict[str, Any] | None = None  # a checkpoint's state, applied at the push
        # the admission after the last push, running on the loop while this thread goes on (its
        # result, or error, is collected by whatever runs on the loop next)
        self._after: concurrent.futures.Future[None] | None = None
        self._busy_mark = (0.0, 0.0)  # (the last ping answer's time, the replicas' busy seconds)
        self._core_wait = 0.0  # the replicas' summed waits for lent cores, as last read

    async def _start_watchdog(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.watchdog.run())

    # ------------------------------------------------------------------ the step
    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        """Top up admission, then take the next mini-batch as soon as it is complete."""
        self.step = step
        ctx = self.ctx
        ctx.fleet.restart_dead()
        t0 = time.perf_counter()
        batch, metrics = ctx.run_async(self._next(step), ctx.fleet.changed, self._rescue)
        wait = time.perf_counter() - t0
        since = max(time.perf_counter() - self._last_take, 1e-9)
        self._last_take = time.perf_counter()
        metrics["async/trainer_wait_s"] = wait
        metrics["async/trainer_idle_fraction"] = min(1.0, wait / since)
        if self.switch is not None:
            self.switch.observe_wait(wait)
        metrics.update(self._fleet_metrics())
        return batch, metrics

    def _await_replacement(self) -> None:
        """No replica is live at a push: wait (``restart_wait_s`` at most) until a replacement
        serves the actor's current weights; ``ReplicaDeadError`` when none comes."""
        from postrl.rollout.types import ReplicaDeadError

        lb = self.ctx.fleet.balancer
        deadline = time.monotonic() + (lb.restart_wait_s if lb is not None else 300.0)
        while not self.ctx.fleet.live:
            left = deadline - time.monotonic()
            if not self.restarter.expected() or left <= 0:
                raise ReplicaDeadError(
                    -1, "no rollout replica is left and none could be restarted in time"
                )
            self.ctx.fleet.restart_dead()
            self.restarter.wait_ready(left)  # woken when a replacement finished starting
            self._rescue()

    def _rescue(self) -> None:
        """While the take waits (this thread, woken by ``fleet.changed``: a replica declared
        dead, a replacement that finished starting): start replacements for dead replicas,
        and when none is live, put one that came up in service at once with the actor's
        current weights as a new policy version (the usual push would only come after this
        batch, which no replica is left to generate)."""
        fleet = self.ctx.fleet
        fleet.restart_dead()
        if not fleet.rescue(self.ctx.weight_source()):  # the actor's weights: a new version
            fleet.restart_dead()  # a replacement that failed to join starts again (budget)
            return
        logger.warning(
            "no rollout replica was live: a restarted one serves version %d", fleet.version
        )
        self.ctx.run_async(self._after_sync(self.step, self.ctx.fleet.version))

    async def _next(self, step: int) -> tuple[DataProto, dict[str, float]]:
        await self._settled()
        feed = self.feed
        admitted, self._admitted_at_sync = self._admitted_at_sync, 0
        admitted += feed.admit(self._draw, step)
        switch, switched = self.switch, False
        if switch is not None:  # the actor's weights are the fleet's right after a push
            switched = switch.begin(
                ready_groups=len(feed.buffer.ready()),
                needed_groups=self.mini,
                weights_current=(step - 1) % self.sync_every == 0,
            )
        try:
            batch, metrics = await feed.stream.take_async(
                self.mini, step, self.ctx.loader.next_prompts
            )
        finally:
            if switched:
                switch_metrics = await switch.end()  # type: ignore[union-attr]
        if switch is not None:
            metrics.update(switch.metrics(switched))
            if switched:
                metrics.update(switch_metrics)
        metrics = feed.taken(metrics)  # counted as trained before the room is computed again
        admitted += feed.admit(self._draw, step)  # the groups taken leave room at once
        metrics.update(feed.occupancy(admitted))
        metrics["async/in_flight_trajectories"] = float(feed.stream.in_flight)
        return batch, metrics

    def _draw(self, room: int) -> DataProto | None:
        """The next mini-batch of prompts (``room`` permitting), in the loader's order and cut
        into the same batches as ``sync``: an epoch's trailing partial batch is skipped (the
        whole next batch is drawn from the next epoch), so each prompt of an epoch is trained
        exactly once. Runs on the loop thread."""
        loader = self.ctx.loader
        if room < self.mini:
            return None
        if loader.position % self.k == 0 and loader.position + self.k > len(loader.dataset):
            return loader.next_batch() if room >= self.k else None  # rolls into the next epoch
        return loader.next_prompts(self.mini)

    def _fleet_metrics(self) -> dict[str, float]:
        reps = self.ctx.fleet.replicas
        live = [r for r in reps if not r.dead]
        busy = sum(r.busy_s for r in live)
        at = max((float(getattr(r, "busy_at", 0.0)) for r in live), default=0.0)
        t0, b0 = self._busy_mark
        idle = {}
        # The replicas' busy seconds arrive with their health pings (every
        # trainer.async.replica_health_interval_s), so the fraction is taken between two pings'
        # answers, on the steps a new one arrived: per step it would read 1.0 between pings and
        # clamp the whole interval's work into one step.
        if live and at > t0 and t0 > 0.0:
            frac = (busy - b0) / (len(live) * (at - t0))
            idle["rollout/replica_idle_fraction"] = float(min(1.0, max(0.0, 1.0 - frac)))
        if at > t0:
            self._busy_mark = (at, busy)
        dead = sum(1 for r in reps if r.dead)
        wait = sum(float(getattr(r, "core_wait_s", 0.0)) for r in reps)
        wait_delta, self._core_wait = max(0.0, wait - self._core_wait), wait
        return {
            **idle,
            # seconds the replicas waited for their lent cores (trainer.lend_cores), this step
            "rollout/core_wait_s": wait_delta,
            # deaths so far: the dead still in their slots plus those a restart replaced
            "rollout/replica_failures": float(dead + self.ctx.fleet.restarts),
            "rollout/replica_restarts": float(self.ctx.fleet.restarts),
            "rollout/replica_restart_failures": float(self.restarter.failed),
            "rollout/replica_busy_pings": float(self.watchdog.busy_pings),
            "rollout/live_replicas": float(len(reps) - dead),
            "rollout/reissued_requests": float(self.ctx.runner.reissued),
        }

    def sync_weights(self) -> dict[str, float]:
        """Every ``parameter_sync_step`` steps (and before the first): push the weights to the
        replicas while they keep generating, advance the buffer's version, admit what the new
        version makes room for."""
        if self.step % self.sync_every:
            return {}
        from postrl.rollout.types import ReplicaDeadError

        if not self.ctx.fleet.live and self.restarter.expected():
            self._await_replacement()  # the push goes to the replacement, as a rescue does
            return {"weights/version": float(self.ctx.fleet.version)}
        try:
            metrics = self.ctx.sync_weights()  # to the live replicas (a dead one is skipped)
        except ReplicaDeadError:  # the last live replica died during the push
            if self.ctx.fleet.live or not self.restarter.expected():
                raise
            self._await_replacement()
            return {"weights/version": float(self.ctx.fleet.version)}
        self.ctx.fleet.install_restarted(self.ctx.weight_source())  # with the same weights
        self.ctx.fleet.restart_dead()
        swaps = [r.last_swap for r in self.ctx.fleet.live if r.last_swap]
        for key in ("pause_s", "recompute_s", "running"):
            vals = [s[key] for s in swaps if key in s]
            if vals:
                metrics[f"weights/{key}"] = float(max(vals))
        # the version and the admission it makes room for run on the loop thread; this thread
        # does not wait for the loop to get to them (it was busy with the trajectories: ~8 ms
        # of W1's step). Anything the mode runs on the loop later awaits them first.
        # (the step and version are read here: the loop may run it after next_batch has moved
        # self.step on, and the dispatch step seeds the admitted groups' samples)
        self._after = self.ctx.submit_async(self._after_sync(self.step, self.ctx.fleet.version))
        return metrics

    async def _settled(self) -> None:
        """Await the admission after the last push (on the loop thread; raises its error)."""
        after, self._after = self._after, None
        if after is not None:
            await asyncio.wrap_future(after)

    async def _after_sync(self, step: int, version: int) -> None:
        """On the loop: apply a checkpoint's state at the first push, advance the buffer to
        ``version`` (the fleet's, as pushed) and admit what it makes room for, dispatched at
        ``step`` (the step whose update was pushed)."""
        if self._restore is not None:
            state, self._restore = self._restore, None
            self.feed.restore(state)
        self.feed.buffer.set_version(version)
        self._admitted_at_sync += self.feed.admit(self._draw, step)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The feed's snapshot (:meth:`AsyncFeed.snapshot
        <postrl.trainer.asynchronous.feed.AsyncFeed.snapshot>`: the loader position, the buffer, the
        groups trained so far), taken on the loop thread. In-flight trajectories restart from their
        prompts after this call (their partial outputs are discarded)."""
        return self.ctx.run_async(self._snapshot())

    async def _snapshot(self) -> dict[str, Any]:
        await self._settled()
        return await self.feed.snapshot_async()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` at the first weight push (the replicas start from the
        model's files: trajectories restarted before the checkpoint's weights reach them would
        be sampled by the wrong policy)."""
        self._restore = state

    def close(self) -> None:
        """Stop the watchdog and cancel the trajectories still running."""
        if self.ctx.closed:
            return
        self.ctx.run_async(self._close())
        if self.switch is not None:
            self.switch.close()

    async def _close(self) -> None:
        try:
            await self._settled()
        except Exception as e:  # noqa: BLE001 (closing: the error was the step's to raise)
            logger.warning("the admission after the last weight push failed: %r", e)
        self._watch.cancel()
        await asyncio.gather(self._watch, return_exceptions=True)
        await self.feed.stream.close_async()


def _no_spawner(slot: int) -> Any:
    raise RuntimeError(f"rollout replica {slot}: this context cannot start replicas")


register_trainer("separate_async", **_FACTS)(FullyAsyncMode)
