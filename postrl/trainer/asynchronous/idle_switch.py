"""The idle switch of ``fully_async``: the trainer's cores generate while it would wait.

verl's ``separate_async.hybrid_rollout`` (shipped off, and until August 2026 with
``should_switch_to_rollout()`` hard-coded False). In ``fully_async`` the rollout replicas run
on cores of their own; when they cannot keep up, the trainer waits for samples with its cores
idle. With ``trainer.async.idle_switch`` on, the trainer process holds one more rollout replica
of its own (an in-process backend, made at startup, asleep and on ``standby`` between
switches). At a step whose batch is not complete yet, :class:`IdleSwitch` decides from two
measured numbers whether to switch:

* the **predicted wait**: an exponential moving average of the trainer's measured waits for a
  batch (``async/trainer_wait_s``; the first steps measure before any switch);
* the **switch cost**: the measured time to load the actor's weights into the replica and wake
  it, plus the time to take it out again (abort what it runs, wait for the aborted requests to
  return, release its KV cache) — measured once at startup, then on every switch (moving
  average).

``auto`` switches when the predicted wait exceeds the cost; ``always`` whenever the batch is
not complete; ``never`` never (the default). A switch puts the replica in service and moves its
share of the work to it (``1 / (1 + replicas × rollout_threads)`` of the requests in flight: the
most recently started
segments are aborted on their replicas and resume, from the tokens they have, on the least
loaded replica — partial rollout); the balancer routes new requests to it as well. When the
batch is complete the trainer takes it out: it goes on standby (nothing more is routed to it),
its running requests are aborted and the resuming client continues each one on a dedicated
replica from the tokens it already has (partial rollout), then its KV cache is released and
training starts.

Policy versions stay exact: the replica is loaded only at steps where the actor's weights are
exactly the fleet's current version (right after a push: every step with
``parameter_sync_step=1``, else the first step after each push), so its tokens carry that
version. Its generation runs in the trainer's event-loop thread on one torch thread (the
trainer's own OpenMP team is idle while it waits; a second team would oversubscribe the cores).

Metrics, every step: ``async/switch/switched`` (0/1), ``async/switch/predicted_wait_s``,
``async/switch/cost_s``; on a switched step also ``async/switch/in_s``, ``async/switch/out_s``,
``async/switch/gen_s`` (engine seconds of the replica during the switch),
``async/switch/moved_in`` (in-flight requests moved to it at the switch-in) and
``async/switch/moved_out`` (requests it handed back at the switch-out).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from postrl.rollout.types import RolloutTimeoutError

logger = logging.getLogger(__name__)

__all__ = ["IDLE_SWITCH_MODES", "IdleSwitch", "should_switch"]

IDLE_SWITCH_MODES = ("never", "auto", "always")


def should_switch(
    mode: str,
    *,
    ready_groups: int,
    needed_groups: int,
    weights_current: bool,
    predicted_wait_s: float | None,
    cost_s: float,
) -> tuple[bool, str]:
    """Whether to switch the trainer's cores to generation for this step, and why (pure).

    Args:
        mode: ``never``, ``auto`` or ``always`` (``trainer.async.idle_switch``; not YAML's
            booleans ``on``/``off``).
        ready_groups: complete groups waiting in the buffer now.
        needed_groups: groups the step takes.
        weights_current: the actor's weights are exactly the fleet's current policy version.
        predicted_wait_s: the expected wait for the batch (None: nothing measured yet).
        cost_s: the measured cost of one switch in and out.

    Returns:
        ``(switch, reason)``; reason is one of ``never``, ``ready`` (no wait expected),
        ``weights`` (the actor is ahead of the fleet's version), ``unmeasured``, ``cheap_wait``
        (the predicted wait does not cover the cost), ``forced`` (``always``), ``pays``.
    """
    if mode not in IDLE_SWITCH_MODES:
        raise ValueError(f"idle switch mode {mode!r} is not one of {IDLE_SWITCH_MODES}")
    if mode == "never":
        return False, "never"
    if ready_groups >= needed_groups:
        return False, "ready"
    if not weights_current:
        return False, "weights"
    if mode == "always":
        return True, "forced"
    if predicted_wait_s is None:
        return False, "unmeasured"
    if predicted_wait_s <= cost_s:
        return False, "cheap_wait"
    return True, "pays"


class IdleSwitch:
    """The trainer's in-process rollout replica and the decision to use it (module docstring).

    Args:
        ctx: the :class:`~postrl.trainer.context.TrainerContext` (its fleet's balancer routes to
            the replica; ``weight_source`` loads it; ``rollout_options`` build it).
        mode: ``auto`` or ``always`` (``never`` builds nothing: don't construct one).
        smoothing: weight of the newest measurement in the moving averages.
        drain_timeout_s: deadline for the aborted requests to leave the replica at a switch-out.
    """

    def __init__(
        self, ctx: Any, mode: str, smoothing: float = 0.5, drain_timeout_s: float = 60.0
    ) -> None:
        from postrl.rollout import RolloutReplica, create_rollout_backend

        if mode not in ("auto", "always"):
            raise ValueError(f"IdleSwitch mode must be 'auto' or 'always', got {mode!r}")
        self.ctx = ctx
        self.mode = mode
        self.smoothing = smoothing
        self.drain_timeout_s = drain_timeout_s
        cfg = ctx.cfg
        backend = create_rollout_backend(cfg.rollout.backend, cfg.model.path, **ctx.rollout_options)
        self.replica = RolloutReplica(backend, replica_id=len(ctx.fleet.replicas))
        ctx.fleet.add_standby(self.replica)
        ac = cfg.trainer.async_
        self.share = 1.0 / (1.0 + len(ctx.fleet.replicas) * ac.rollout_threads)
        """The share of the in-flight requests moved to it at a switch-in: one torch thread
        against the dedicated replicas' threads."""
        self._moved_in = 0
        self.predicted_wait_s: float | None = None
        self._gen_mark = 0.0  # the replica's engine seconds at the switch-in
        self._in_s = 0.0  # how long the switch-in took
        # the cost of one switch, measured now on the model's own weights (version 0)
        t0 = time.perf_counter()
        self._load(0)
        t1 = time.perf_counter()
        self.replica.sleep()
        self.cost_s = time.perf_counter() - t0
        logger.info(
            "idle switch (%s): in-process rollout replica ready; switch in %.3fs, cost %.3fs",
            mode,
            t1 - t0,
            self.cost_s,
        )

    def _load(self, version: int) -> None:
        self.replica.wake_up()
        self.replica.update_weights(self.ctx.weight_source()(version), version=version)

    def observe_wait(self, wait_s: float) -> None:
        """Fold one measured wait for a batch into the prediction."""
        w = self.smoothing
        prev = self.predicted_wait_s
        self.predicted_wait_s = wait_s if prev is None else w * wait_s + (1 - w) * prev

    def begin(self, *, ready_groups: int, needed_groups: int, weights_current: bool) -> bool:
        """Decide (:func:`should_switch`) and, if so, put the replica in service with the
        actor's weights as the fleet's current version. Runs on the loop thread while the
        trainer's thread waits for the batch (nothing else touches the actor then)."""
        ok, reason = should_switch(
            self.mode,
            ready_groups=ready_groups,
            needed_groups=needed_groups,
            weights_current=weights_current,
            predicted_wait_s=self.predicted_wait_s,
            cost_s=self.cost_s,
        )
        logger.debug("idle switch: %s (%s)", "in" if ok else "stay out", reason)
        if not ok:
            return False
        t0 = time.perf_counter()
        self._load(self.ctx.fleet.version)
        self.replica.resume()
        self.replica.standby = False
        # its share of the work already queued on the dedicated replicas moves over now
        # (their replicas run every admitted request at once, so nothing would reach it)
        self._moved_in = self.ctx.agents.client.shed(self.share, exclude=self.replica)
        self._in_s = time.perf_counter() - t0
        self._gen_mark = float(getattr(self.replica.backend, "busy_s", 0.0))
        return True

    async def end(self) -> dict[str, float]:
        """Take the replica out of service: standby, abort what it runs (the client resumes
        each request on a dedicated replica), wait for the aborted requests to return, release
        its KV cache. Returns the switch's metrics."""
        t0 = time.perf_counter()
        rep = self.replica
        rep.standby = True
        moved = rep.load
        rep.pause()  # aborts every in-flight request; resumed ones go elsewhere (standby)
        if not await rep.drained(self.drain_timeout_s):
            raise RolloutTimeoutError(
                f"idle switch: {rep.load} aborted request(s) did not leave the trainer's "
                f"rollout replica within {self.drain_timeout_s}s"
            )
        rep.sleep()
        out_s = time.perf_counter() - t0
        cost = self._in_s + out_s
        self.cost_s = self.smoothing * cost + (1 - self.smoothing) * self.cost_s
        return {
            "async/switch/in_s": self._in_s,
            "async/switch/out_s": out_s,
            "async/switch/gen_s": float(getattr(rep.backend, "busy_s", 0.0)) - self._gen_mark,
            "async/switch/moved_in": float(self._moved_in),
            "async/switch/moved_out": float(moved),
        }

    def metrics(self, switched: bool) -> dict[str, float]:
        """The per-step decision metrics."""
        m = {"async/switch/switched": float(switched), "async/switch/cost_s": self.cost_s}
        if self.predicted_wait_s is not None:
            m["async/switch/predicted_wait_s"] = self.predicted_wait_s
        return m

    def close(self) -> None:
        """Release the in-process backend."""
        close = getattr(self.replica.backend, "close", None)
        if close is not None:
            close()
