"""``postrl bench modes``: which ``trainer.mode`` to pick, predicted from a few measured steps.

A planner, on paper. It reads a few steps of a ``sync`` run (its ``metrics.jsonl``) — the
engine's compute per batch (``timing_s/gen_engine``), the generation and step times, the
tool calls per trajectory — plus the tool (or reward) latency distribution the user knows or
measured (``--latency lognormal:MEDIAN_MS,SIGMA,LO_MS,HI_MS``, ``uniform:LO_MS,HI_MS``,
``const:MS``), and predicts for ``sync``, ``one_step_off`` and ``fully_async`` the samples/s
and the mean staleness (policy versions), on this machine and extrapolated to ``N`` rollout
workers and ``M`` trainer workers. ``--from-bench results.json`` instead takes the ``sync``
runs of a ``benchmarks/async_modes.py`` output and sets each prediction next to what the
benchmark measured for that mode (the validation in ``docs/async.md``).

The model (every number below is a measured input or one of the formulas; nothing is fitted to
the async modes' measurements):

* a ``sync`` step is ``G + O + W + U``: ``G`` the engine's compute for the batch (all cores), ``W``
  the exposed wait — the batch decodes together, so its tool calls start together, and the
  step waits for the slowest: ``W = E[max over the batch's B trajectories of their latency]``,
  each trajectory calling with probability ``p = min(calls_per_traj, 1)``
  (:func:`expected_max`) —, ``U`` everything after generation (reward, log-probs, update,
  weight sync), ``O`` the generation's time outside the engine and the waits (agent loops,
  request traffic, scoring: :func:`gen_overhead`);
* ``one_step_off`` shares the cores between generation and training (one process: the fleet
  pauses while the actor trains). It admits ``k = min(batches_ahead, max_staleness + 1)``
  batches at once (``batches_ahead = 2 + trainer.async.num_warmup_batches``); they generate
  together and are trained one after another. In the default admission order
  (``trainer.async.take_order``) a step waits for the batch admitted first: it is complete after
  ``X₁ = max(k·(G + O), G + O + W_B)`` — the larger of two bounds: the ``k`` batches' compute
  on the shared cores, and its own path with its own slowest wait (the other batches' compute
  hides in the waits). The last batch needs ``X_k = max(k·(G + O), G + O + W_kB)``, the slowest
  of all ``k·B`` trajectories; what it waits beyond ``X₁`` runs on while the batches before it
  train (a paused fleet stops decoding, not the tool calls in flight). A cycle of ``k`` steps
  is ``X₁ + max(0, X_k − X₁ − (k − 1)·U) + k·U``. The first of
  the ``k`` batches trains at staleness 0, the last at ``k − 1``: mean ``(k − 1) / 2``. In
  completion order a step takes the first complete groups, so a group holds its slot for its
  own slowest wait ``W_g`` (the max over its ``n`` trajectories), not the batch's:
  ``max((G + O) / (1 − d) + U, (G + O + W_g + U) / ((max_staleness + 1)·(1 − d)))``, ``d`` the
  stale-drop fraction (:func:`stale_drop_fraction`);
* ``fully_async`` runs ``R`` replica processes of ``r`` threads beside a trainer of ``t``
  threads: three pipelines, the slowest sets the pace — the trainer (``U`` at ``t`` threads
  plus the push), the replicas (``G`` at ``R × r`` threads) and the latency bound of the
  buffer's pacing cap: at most ``max_staleness + 1`` batches are untrained and a group holds
  its slot from admission until the update that trains it ends. It takes the groups that
  complete first, so a group holds its slot for its generation, its own slowest wait ``W_g``
  and the update: by Little's law a step is at least ``(G_r / R + W_g + trainer) /
  (max_staleness + 1)``. The groups whose wait outlasts the staleness bound are dropped and
  their slots refilled (fraction ``d``, :func:`stale_drop_fraction`), so the rollout and
  latency bounds divide by ``1 − d`` (the trainer's does not: it trains a full batch
  anyway). Thread counts convert through the measured speed-up ``s(n)`` of ``n`` threads
  over one (:func:`thread_time`; ``--speedup``,
  or timed now on the model's forward and backward) — the trainer's through the update's own
  ``s_U(n)`` (``--update-speedup``, or timed now on the engine's packed training pass,
  :func:`measure_speedup` with ``kind="update"``) —, and the trainer's work is slowed by the
  measured contention ``c`` of a replica computing beside it, for the share of the step the
  replicas compute (:func:`contended_time`, :func:`measure_contention`; ``--contention``; ~1
  on cores of its own). With core lending (``trainer.lend_cores``, the default for replica
  processes on the trainer's machine) the trainer runs on ``t + R × r`` threads whenever the
  replicas are idle, and on ``t`` (slowed by ``c``) only for the ``G`` seconds of each step
  they compute (:func:`lent_time`). In the latency bound the update that frees a slot runs on
  all the cores: the cap holds the next groups back until it ends, and the groups in flight
  wait on their calls, so the replicas idle through it (measured on the tail workload: the
  update took 0.32 s in ``fully_async`` on 1 + 1 threads, 0.55 s in ``sync`` on 1, and the
  update's own 2-thread speed-up was 1.83).

Staleness: ``sync`` 0; ``one_step_off`` ``(k − 1) / 2`` in admission order, as
``fully_async``'s in completion order; in
``fully_async`` a group waits in the buffer while the trainer is the bottleneck, so its age is
the time from admission to training in steps, capped by ``max_staleness``
(:func:`fully_async_staleness`).

Extrapolation (``--workers N,M``, the way users size a cluster; every worker is assumed as
fast as this machine's ``T`` cores, no communication cost): ``sync`` and ``one_step_off``
colocate, so both phases use ``N + M`` workers; ``fully_async`` gives ``N`` to rollout and ``M``
to training.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Latency",
    "Profile",
    "Prediction",
    "parse_latency",
    "expected_max",
    "thread_time",
    "predict_sync",
    "predict_one_step_off",
    "predict_fully_async",
    "lent_time",
    "gen_overhead",
    "fully_async_staleness",
    "stale_drop_fraction",
    "kept_wait",
    "predict_all",
    "extrapolate",
    "profile_from_rows",
    "main",
]


# ---------------------------------------------------------------------------- latency
@dataclass(frozen=True)
class Latency:
    """A per-call latency distribution in seconds: ``kind`` is ``const`` (``a``), ``uniform``
    (on ``[lo, hi]``) or ``lognormal`` (median ``a``, log-space standard deviation ``b``,
    clipped to ``[lo, hi]``)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    lo: float = 0.0
    hi: float = 0.0

    def cdf(self, x: float) -> float:
        """``P(latency <= x)``."""
        if self.kind == "const":
            return 1.0 if x >= self.a else 0.0
        if x < self.lo:
            return 0.0
        if x >= self.hi:
            return 1.0
        if self.kind == "uniform":
            return (x - self.lo) / (self.hi - self.lo) if self.hi > self.lo else 1.0
        if x <= 0:
            return 0.0
        if self.b == 0:
            return 1.0 if x >= self.a else 0.0
        return 0.5 * (1 + math.erf((math.log(x) - math.log(self.a)) / (self.b * math.sqrt(2))))

    @property
    def upper(self) -> float:
        """A value the latency never exceeds."""
        return self.a if self.kind == "const" else self.hi


def parse_latency(spec: str) -> Latency:
    """``none`` | ``const:MS`` | ``uniform:LO_MS,HI_MS`` | ``lognormal:MEDIAN_MS,SIGMA,LO_MS,HI_MS``
    (milliseconds) → :class:`Latency` in seconds; a bad spec raises ``ValueError`` naming it."""
    kind, _, rest = spec.partition(":")
    try:
        vals = [float(v) for v in rest.split(",") if v.strip()]
    except ValueError:
        vals = None
    want = {"none": 0, "const": 1, "uniform": 2, "lognormal": 4}
    if kind not in want or vals is None or len(vals) != want[kind]:
        raise ValueError(
            f"--latency={spec!r}: write none, const:MS, uniform:LO_MS,HI_MS or "
            f"lognormal:MEDIAN_MS,SIGMA,LO_MS,HI_MS (milliseconds)"
        )
    if kind == "none":
        return Latency("const", 0.0)
    if kind == "const":
        return Latency("const", vals[0] / 1e3)
    if kind == "uniform":
        lo, hi = vals
        if not 0 <= lo <= hi:
            raise ValueError(f"--latency={spec!r}: need 0 <= LO_MS <= HI_MS")
        return Latency("uniform", lo=lo / 1e3, hi=hi / 1e3)
    med, sigma, lo, hi = vals
    if med <= 0 or sigma < 0 or not 0 <= lo <= hi:
        raise ValueError(f"--latency={spec!r}: need MEDIAN_MS > 0, SIGMA >= 0, 0 <= LO <= HI")
    return Latency("lognormal", med / 1e3, sigma, lo / 1e3, hi / 1e3)


def _max_cdf(lat: Latency, count: int, p: float, x: float) -> float:
    """``P(max ≤ x)`` over ``count`` independent trajectories, each of which waits one draw of
    ``lat`` with probability ``p`` (else 0): ``(1 − p + p·F(x))^count``."""
    return (1.0 - p + p * lat.cdf(x)) ** count


def expected_max(lat: Latency, count: int, p: float = 1.0, steps: int = 4000) -> float:
    """``E[max]`` over ``count`` independent trajectories, each of which waits one draw of
    ``lat`` with probability ``p`` (else 0): ``∫_0^upper 1 − (1 − p + p·F(x))^count dx``
    (midpoint rule on ``steps`` points; exact for ``const``)."""
    if count <= 0 or p <= 0:
        return 0.0
    p = min(p, 1.0)
    if lat.kind == "const":
        return lat.a * (1 - (1 - p) ** count)
    top = lat.upper
    h = top / steps
    return sum(1 - _max_cdf(lat, count, p, (i + 0.5) * h) for i in range(steps)) * h


# ---------------------------------------------------------------------------- the model
def thread_time(
    t_ref: float, ref_threads: int, threads: float, speedup: Callable[[float], float]
) -> float:
    """The time of work that took ``t_ref`` on ``ref_threads`` threads, on ``threads`` threads:
    ``t_ref × s(ref_threads) / s(threads)``."""
    return t_ref * speedup(ref_threads) / speedup(threads)


def power_speedup(s_at: float, threads: int = 2) -> Callable[[float], float]:
    """``s(n) = n^a`` through ``s(threads) = s_at`` (time on 1 thread / time on ``threads``);
    measured on one thread there is nothing to scale by: ``s(n) = n`` is not known, so 1."""
    if threads <= 1:
        return lambda n: 1.0
    a = math.log(max(s_at, 1e-9)) / math.log(threads)
    return lambda n: max(n, 1e-9) ** a


@dataclass(frozen=True)
class Profile:
    """What the planner needs from a few measured ``sync`` steps (medians per step)."""

    trajectories: float
    """B: trajectories per step (``data.train_batch_size × rollout.n``)."""
    group_size: int
    """``rollout.n``."""
    gen_compute_s: float
    """G: the engine's seconds in steps per batch (``timing_s/gen_engine``)."""
    gen_s: float
    """``timing_s/gen`` (G plus the exposed wait)."""
    after_gen_s: float
    """U: ``timing_s/step − timing_s/gen`` (reward, log-probs, update, weight sync)."""
    calls_per_traj: float
    """``agent/num_tool_calls`` (0 without tools)."""
    threads: int
    """The torch threads the sync run used (``trainer.num_threads``)."""
    push_s: float = 0.0
    """A weight push to a replica process (``timing_s/sync_weights`` is an in-process bound)."""
    response_length: float = 0.0
    """``response_length/mean`` (reported with the tail)."""


@dataclass
class Prediction:
    """One mode's predicted step time, samples/s and staleness, and what bounds it."""

    mode: str
    step_s: float
    samples_per_s: float
    staleness: float
    bound: str
    parts: dict[str, float] = field(default_factory=dict)


def _wait(p: Profile, lat: Latency, count: float) -> float:
    return expected_max(lat, int(round(count)), min(p.calls_per_traj, 1.0))


def gen_overhead(p: Profile, wait_s: float) -> float:
    """``O``: the generation's seconds outside the engine and outside the waits — agent loops,
    request traffic, scoring, the batch's assembly — ``gen − G − W`` of the ``sync`` steps, at
    least 0 (on W1 ≈ 19 ms of a 62 ms generation)."""
    return max(0.0, p.gen_s - p.gen_compute_s - wait_s)


def predict_sync(p: Profile, lat: Latency) -> Prediction:
    """``G + O + W + U`` (module docstring)."""
    w = _wait(p, lat, p.trajectories)
    o = gen_overhead(p, w)
    step = p.gen_compute_s + o + w + p.after_gen_s
    return Prediction(
        "sync",
        step,
        p.trajectories / step,
        0.0,
        "compute + slowest wait",
        {"G": p.gen_compute_s, "O": o, "W": w, "U": p.after_gen_s},
    )


def stale_drop_fraction(p: Profile, lat: Latency, gen_s: float, deadline_s: float) -> float:
    """The fraction of groups a completion-order buffer drops as stale: those whose generation
    ``gen_s`` plus slowest wait (the max ``M`` over the group's ``n`` trajectories) outlasts
    ``deadline_s`` — ``P(gen_s + M > deadline_s)``. A group is admitted as an update ends and
    its weights are pushed, so its first token carries that version; it is dropped when the
    trainer has moved more than ``max_staleness`` versions past it before taking it, i.e. when
    it is not complete by the take that precedes the ``max_staleness + 1``-th push after its
    admission: ``deadline = (max_staleness + 1)·step − train`` (``train``: the update and push
    after a take)."""
    x = deadline_s - gen_s
    if x <= 0:
        return 1.0
    return 1.0 - _max_cdf(lat, p.group_size, min(p.calls_per_traj, 1.0), x)


def _deadline(step_s: float, train_s: float, max_staleness: int) -> float:
    """``(max_staleness + 1)·step − train`` (:func:`stale_drop_fraction`)."""
    return (max_staleness + 1) * step_s - train_s


def kept_wait(p: Profile, lat: Latency, limit_s: float, steps: int = 2000) -> float:
    """The mean slowest wait of a group among the groups whose slowest wait is at most
    ``limit_s`` (those a completion-order buffer keeps): ``E[M | M ≤ x] = ∫_0^x 1 − F(y) / F(x)
    dy``, ``F`` the CDF of the max over the group's ``n`` trajectories (midpoint rule)."""
    q = min(p.calls_per_traj, 1.0)
    x = min(max(limit_s, 0.0), lat.upper)
    if x <= 0 or q <= 0:
        return 0.0

    top = _max_cdf(lat, p.group_size, q, x)
    if top <= 0:
        return x
    h = x / steps
    return sum(1.0 - _max_cdf(lat, p.group_size, q, (i + 0.5) * h) / top for i in range(steps)) * h


def _with_drops(
    step_of: Callable[[float], float], drop: Callable[[float], float], cap: float = 0.9
) -> tuple[float, float]:
    """The step ``T`` with ``T = step_of(d(T))``, ``d(T)`` the stale-drop fraction at step
    ``T`` (at most ``cap``). ``d`` never rises with ``T`` and ``step_of`` never falls with ``d``,
    so ``T − step_of(d(T))`` rises: the smallest ``T`` where it is ``≥ 0`` (bisection; where
    ``d`` jumps, as for a constant latency, the step stretches until the groups just make the
    deadline). Returns ``(T, d(T))``."""

    def d_at(t: float) -> float:
        return min(max(drop(t), 0.0), cap)

    lo, hi = step_of(0.0), step_of(cap)
    if lo - step_of(d_at(lo)) >= 0:
        return lo, d_at(lo)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if mid - step_of(d_at(mid)) >= 0:
            hi = mid
        else:
            lo = mid
    return hi, d_at(hi)


def predict_one_step_off(
    p: Profile,
    lat: Latency,
    max_staleness: int = 1,
    take_order: str = "admission",
    batches_ahead: int = 2,
) -> Prediction:
    """``one_step_off`` (module docstring): ``k = min(batches_ahead, max_staleness + 1)``
    batches generate together and train one after another. ``take_order="admission"`` (the
    mode's default): ``(X₁ + max(0, X_k − X₁ − (k − 1)·U) + k·U) / k`` with ``X₁ = max(k·(G +
    O), G + O + W_B)`` and ``X_k = max(k·(G + O), G + O + W_kB)``, staleness ``(k − 1) / 2``;
    ``"completion"``: ``max((G + O) / (1 − d) + U, (G + O + W_g + U) / ((max_staleness + 1)·(1
    − d)))`` with ``d`` the stale drops (:func:`stale_drop_fraction`)."""
    if take_order not in ("admission", "completion"):
        raise ValueError(f"take_order={take_order!r}: admission or completion")
    k = max(1, min(batches_ahead, max_staleness + 1))
    w = _wait(p, lat, p.trajectories)
    gen = p.gen_compute_s + gen_overhead(p, w)
    if take_order == "admission":
        # the k batches' compute shares the engine; the first batch is complete after its own
        # slowest wait W_B, the last after the slowest of all k·B, W_kB. The later batches'
        # extra wait elapses while the batches before them train: a paused fleet stops
        # decoding, not the tool calls in flight. A cycle of k steps: the first batch's
        # generation, whatever of the last one's is left after k − 1 updates, k updates.
        w_k = _wait(p, lat, k * p.trajectories)
        u = p.after_gen_s
        first, last = max(k * gen, gen + w), max(k * gen, gen + w_k)
        late = max(0.0, last - first - (k - 1) * u)
        step = (first + late + k * u) / k
        bound = "compute (G + U)" if k * gen >= gen + w else "latency (slowest of a batch)"
        parts = {
            "G+U": gen + u,
            "W": w,
            "W_kB": w_k,
            "k": float(k),
            "generation": first + late,
        }
        return Prediction("one_step_off", step, p.trajectories / step, (k - 1) / 2, bound, parts)
    w_g = _wait(p, lat, p.group_size)
    life = (gen + w_g + p.after_gen_s) / (max_staleness + 1)
    # compute: the generation (repeated for the dropped groups) and the update; latency: a
    # group holds its slot for its generation, its own slowest wait and the update (Little)
    step, d = _with_drops(
        lambda d: max(gen / (1 - d) + p.after_gen_s, life / (1 - d)),
        lambda t: stale_drop_fraction(p, lat, gen, _deadline(t, p.after_gen_s, max_staleness)),
    )
    compute = gen / (1 - d) + p.after_gen_s
    return Prediction(
        "one_step_off",
        step,
        p.trajectories / step,
        fully_async_staleness(
            gen + kept_wait(p, lat, _deadline(step, p.after_gen_s, max_staleness) - gen),
            step,
            max_staleness,
        ),
        "compute (G + U)" if compute >= life / (1 - d) else "latency (in-flight cap)",
        {"G+U": gen + p.after_gen_s, "W_group": w_g, "latency": life, "drop": d},
    )


def fully_async_staleness(lifetime_s: float, step_s: float, max_staleness: int) -> float:
    """Mean age in policy versions of a trained group: ``lifetime / step`` (the versions that
    passed while it was admitted, generated and buffered), at least 0, at most the bound."""
    return min(float(max_staleness), max(0.0, lifetime_s / step_s)) if step_s > 0 else 0.0


def predict_fully_async(
    p: Profile,
    lat: Latency,
    speedup: Callable[[float], float],
    *,
    trainer_threads: float = 1,
    rollout_threads: float = 1,
    replicas: int = 1,
    max_staleness: int = 1,
    contention: float = 1.0,
    lend_cores: bool = True,
    update_speedup: Callable[[float], float] | None = None,
) -> Prediction:
    """The slowest of three pipelines (module docstring): trainer ``U(t) + push`` slowed by
    ``c`` while the replicas compute (:func:`contended_time`; with ``lend_cores`` the update
    runs on the replicas' threads too while they are idle, :func:`lent_time`), replicas
    ``G(R × r) / (1 − d)``, latency ``(G(r) / R + W_g + trainer) / ((max_staleness + 1)·(1 −
    d))`` (``W_g`` a group's slowest wait: the groups that complete first are taken, each holds
    its slot for its own wait; ``d`` the stale drops, :func:`stale_drop_fraction`, whose refills
    the rollout repeats); ``c`` the measured slow-down of the
    trainer's work while a replica computes beside it on the same machine
    (:func:`measure_contention`; 1 on cores of its own). ``speedup`` converts the rollout's
    compute between thread counts, ``update_speedup`` the trainer's (the update's own ``s(n)``,
    :func:`measure_speedup` with ``kind="update"``: the engine's packed training pass scales
    better than a decode step; None: ``speedup``)."""
    s_upd = update_speedup or speedup
    base = thread_time(p.after_gen_s, p.threads, trainer_threads, s_upd)
    gen = thread_time(p.gen_compute_s, p.threads, replicas * rollout_threads, speedup)
    w_group = _wait(p, lat, p.group_size)
    w_batch = _wait(p, lat, p.trajectories)
    if lend_cores:  # a replica holds its cores while its requests trickle in: G + O
        lent = thread_time(
            p.after_gen_s, p.threads, trainer_threads + replicas * rollout_threads, s_upd
        )
        busy = gen + gen_overhead(p, w_batch)
        train = lent_time(base, lent, busy, contention) + p.push_s
        # the update that frees a slot in the latency bound: the replicas idle through it
        idle_train = lent + p.push_s
    else:
        train = contended_time(base, p.push_s, gen, contention)
        idle_train = train
    # a group is done when its slowest member is; its generation overlaps the other groups'
    gen_r = thread_time(p.gen_compute_s, p.threads, rollout_threads, speedup) / replicas
    # the pacing cap (Little's law): a group holds its slot for its generation, its own
    # slowest wait and the update that trains it (on lent cores: nothing new generates until
    # it ends); the groups that complete first are taken, the stale ones dropped and refilled
    # (fraction d), which the rollout repeats
    latency = (gen_r + w_group + idle_train) / (max_staleness + 1)
    step, d = _with_drops(
        lambda d: max(train, gen / (1 - d), latency / (1 - d)),
        lambda t: stale_drop_fraction(p, lat, gen_r, _deadline(t, train, max_staleness)),
    )
    if train >= max(gen, latency) / (1 - d):
        bound = "trainer"
    elif gen >= latency:
        bound = "rollout compute"
    else:
        bound = "latency (in-flight cap)"
    # admitted when room opens, trained when the trainer reaches it: a full buffer when the
    # trainer is the bound, otherwise just its generation and slowest wait
    kept = gen_r + kept_wait(p, lat, _deadline(step, train, max_staleness) - gen_r)  # not dropped
    stale_life = kept + (max_staleness * step if bound == "trainer" else 0.0)
    return Prediction(
        "fully_async",
        step,
        p.trajectories / step,
        fully_async_staleness(stale_life, step, max_staleness),
        bound,
        {
            "trainer": train,
            "rollout": gen,
            "latency": latency,
            "W_group": w_group,
            "W": w_batch,
            "drop": d,
        },
    )


def lent_time(own_s: float, lent_s: float, other_s: float, contention: float) -> float:
    """The trainer's work on lent cores: ``own_s`` is its time on its own threads, ``lent_s``
    on its own plus the replicas' (while they are idle); the replicas compute ``other_s`` of
    each step, during which it runs on its own threads, slowed by ``contention``. So it does
    ``other / (c · own)`` of its work then and the rest at the lent rate: ``other + (1 −
    other / (c · own)) · lent`` (``c · own`` when the replicas never rest)."""
    slow = max(contention, 1.0) * own_s
    if other_s >= slow:
        return slow
    return other_s + (1.0 - other_s / slow) * lent_s


def contended_time(work_s: float, push_s: float, other_s: float, contention: float) -> float:
    """The trainer's step ``T`` when its ``work_s`` is slowed by ``contention`` only while the
    replicas compute (``other_s`` of every ``T``): ``T = work·(1 + (c − 1)·min(1, other/T)) +
    push``; the positive root of ``T² − (work + push)·T − (c − 1)·work·other = 0`` (or
    ``c·work + push`` when the replicas never rest)."""
    extra = max(contention - 1.0, 0.0)
    a = work_s + push_s
    t = (a + math.sqrt(a * a + 4 * extra * work_s * other_s)) / 2
    return contention * work_s + push_s if other_s >= t else t


def predict_all(
    p: Profile,
    lat: Latency,
    speedup: Callable[[float], float],
    trainer_threads: float = 1,
    rollout_threads: float = 1,
    replicas: int = 1,
    max_staleness: int = 1,
    contention: float = 1.0,
    lend_cores: bool = True,
    take_order: str = "admission",
    batches_ahead: int = 2,
    update_speedup: Callable[[float], float] | None = None,
) -> dict[str, Prediction]:
    """Every mode's :class:`Prediction` on the measured machine (``lend_cores``: the
    ``fully_async`` trainer borrows idle replicas' cores, ``trainer.lend_cores``;
    ``take_order`` and ``batches_ahead``: ``one_step_off``'s, :func:`predict_one_step_off`;
    ``update_speedup``: the trainer's ``s(n)``, :func:`predict_fully_async`)."""
    return {
        "sync": predict_sync(p, lat),
        "one_step_off": predict_one_step_off(p, lat, max_staleness, take_order, batches_ahead),
        "fully_async": predict_fully_async(
            p,
            lat,
            speedup,
            trainer_threads=trainer_threads,
            rollout_threads=rollout_threads,
            replicas=replicas,
            max_staleness=max_staleness,
            contention=contention,
            lend_cores=lend_cores,
            update_speedup=update_speedup,
        ),
    }


def extrapolate(
    p: Profile,
    lat: Latency,
    rollout_workers: int,
    trainer_workers: int,
    max_staleness: int = 1,
    take_order: str = "admission",
    batches_ahead: int = 2,
) -> dict[str, Prediction]:
    """On paper, ``N`` rollout and ``M`` trainer workers, each as fast as the measured
    machine (module docstring): the colocated modes split ``G`` and ``U`` over ``N + M``
    workers; ``fully_async`` gives ``N`` to rollout, ``M`` to training (linear scaling, no
    communication cost: an upper bound)."""
    n, m = rollout_workers, trainer_workers
    linear = lambda x: x  # noqa: E731 - one worker = one unit of the measured machine
    w = _wait(p, lat, p.trajectories)
    both = Profile(
        **{
            **asdict(p),
            "gen_compute_s": p.gen_compute_s / (n + m),
            "after_gen_s": p.after_gen_s / (n + m),
            # the generation's own overhead splits over the workers too; the wait does not
            "gen_s": (p.gen_compute_s + gen_overhead(p, w)) / (n + m) + w,
        }
    )
    fa = Profile(**{**asdict(p), "after_gen_s": p.after_gen_s / m, "threads": 1})
    return {
        "sync": predict_sync(both, lat),
        "one_step_off": predict_one_step_off(both, lat, max_staleness, take_order, batches_ahead),
        "fully_async": predict_fully_async(
            fa,
            lat,
            linear,
            trainer_threads=1,
            rollout_threads=1,
            replicas=n,
            max_staleness=max_staleness,
            lend_cores=False,  # workers on machines of their own lend nothing
        ),
    }


# ---------------------------------------------------------------------------- inputs
def _med(rows: Sequence[dict[str, Any]], key: str, default: float | None = None) -> float:
    vals = [float(r[key]) for r in rows if key in r]
    if vals:
        return statistics.median(vals)
    if default is None:
        raise ValueError(
            f"the sync metrics have no {key!r}: run the profile steps with trainer.mode=sync "
            f"on the native rollout backend (it reports timing_s/gen_engine)"
        )
    return default


def profile_from_rows(
    rows: Sequence[dict[str, Any]], trajectories: float, group_size: int, threads: int
) -> Profile:
    """A :class:`Profile` from ``sync`` metric rows (medians; pass the measured steps, not
    the warm-up)."""
    gen = _med(rows, "timing_s/gen")
    return Profile(
        trajectories=trajectories,
        group_size=group_size,
        gen_compute_s=_med(rows, "timing_s/gen_engine"),
        gen_s=gen,
        after_gen_s=_med(rows, "timing_s/step") - gen,
        calls_per_traj=_med(rows, "agent/num_tool_calls", 0.0),
        threads=threads,
        push_s=_med(rows, "timing_s/sync_weights", 0.0),
        response_length=_med(rows, "response_length/mean", 0.0),
    )


def _work(model: str | None, rows: int = 32, length: int = 64) -> Callable[[], None]:
    """The generation's kind of work: with ``model`` (an HF directory) its forward and backward
    on ``rows × length`` random tokens; without, an fp32 256 → 512 → 256 MLP block's on 2048
    rows (the tiny models' shapes)."""
    import torch

    if model:
        from transformers import AutoModelForCausalLM

        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        ids = torch.randint(0, net.config.vocab_size, (rows, length))

        def work() -> None:
            net(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

        return work
    x = torch.randn(2048, 256)
    w1 = torch.randn(256, 512, requires_grad=True)
    w2 = torch.randn(512, 256, requires_grad=True)

    def mlp() -> None:
        for _ in range(10):
            (torch.nn.functional.silu(x @ w1) @ w2).square().mean().backward()

    return mlp


def _update_work(
    model: str, groups: int = 8, n: int = 4, prompt: int = 16, response: int = 32
) -> Callable[[], None]:
    """The update's kind of work on ``model`` as the engine runs it: loaded by
    :func:`postrl.engine.model.load_policy` (its packed varlen attention and, where they build,
    the fused training kernels), one micro-batch of ``groups × n`` rows whose ``n`` responses
    share a prompt (packed with the prefix shared: ``groups × prompt + groups × n × response``
    tokens, ≈ 1 150 by default, a W1 batch's size), log-probs and entropy forward and backward.
    Its thread speed-up is the update's own: larger matrices and fused kernels scale better
    across threads than :func:`_work`'s padded forward."""
    import torch

    from postrl.engine.model import load_policy
    from postrl.engine.specs import ModelSpec

    pol = load_policy(ModelSpec(path=model, dtype="float32"))
    vocab = int(pol.causal_lm.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    heads = torch.randint(1, vocab, (groups, prompt), generator=gen).repeat_interleave(n, 0)
    ids = torch.cat([heads, torch.randint(1, vocab, (groups * n, response), generator=gen)], 1)
    mask = torch.ones_like(ids)

    def work() -> None:
        lp, ent = pol.logprobs(ids, mask, response, calculate_entropy=True, share_prefix=True)
        (lp.mean() + ent.mean()).backward()

    return work


_WORK: dict[tuple[str | None, str], Callable[[], None]] = {}
WORK_KINDS = ("generation", "update")
"""What :func:`measure_speedup` times: ``generation`` the padded forward and backward of
:func:`_work` (the speed-up the planner applies to the rollout's compute), ``update`` the engine's
packed training pass of :func:`_update_work` (the one it applies to the trainer's; needs a
model)."""


def _work_of(model: str | None, kind: str) -> Callable[[], None]:
    if kind not in WORK_KINDS:
        raise ValueError(f"work kind {kind!r}: choose one of {WORK_KINDS}")
    if not model:  # no model: the MLP block stands for both kinds
        kind = "generation"
    key = (model, kind)
    if key not in _WORK:
        _WORK[key] = _update_work(model) if model and kind == "update" else _work(model)
    return _WORK[key]


def measure_work_time(
    threads: int, model: str | None = None, reps: int = 3, kind: str = "generation"
) -> float:
    """Median seconds of one call of the ``kind`` of work (:data:`WORK_KINDS`) on ``threads``
    torch threads (after a warm-up)."""
    import torch

    work = _work_of(model, kind)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        work()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            work()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)
    finally:
        torch.set_num_threads(old)


def measure_speedup(
    threads: int, model: str | None = None, reps: int = 3, kind: str = "generation"
) -> float:
    """Time on 1 thread / time on ``threads`` threads of the ``kind`` of work
    (:data:`WORK_KINDS`), medians of ``reps``: this machine's ``s(threads)`` under whatever load
    it has now (on a loaded machine a team of threads waits for its slowest member at every op,
    and ``s`` can fall below 1)."""
    if threads <= 1:
        return 1.0
    return measure_work_time(1, model, reps, kind) / measure_work_time(threads, model, reps, kind)


_CONTENDER = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(2048, 256); w = torch.randn(256, 512); v = torch.randn(512, 256)
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    torch.nn.functional.silu(x @ w) @ v
"""


def measure_contention(
    threads: int,
    other_threads: int = 1,
    model: str | None = None,
    reps: int = 3,
    kind: str = "update",
) -> float:
    """How much slower the update's kind of work (``kind``, as in :func:`measure_speedup`) runs on
    ``threads`` threads while another process computes on ``other_threads`` threads beside it
    (a rollout replica generating), than alone: median time with / median time without. On
    cores of its own it is ~1; on a machine whose cores the two share, or that other jobs
    load, more."""
    import subprocess

    def median_time() -> float:
        return measure_work_time(threads, model, reps, kind)

    alone = median_time()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTENDER, str(other_threads), "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("measure_contention: the contending process did not start")
        beside = median_time()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return beside / alone


# ---------------------------------------------------------------------------- report
def format_predictions(
    preds: dict[str, Prediction], measured: dict[str, float] | None = None
) -> str:
    """A table: mode, predicted step s, samples/s, staleness, bound (and measured, error)."""
    head = f"{'mode':<24}{'step_s':>9}{'samples/s':>11}{'stale':>7}  {'bound':<31}"
    if measured:
        head += f"{'measured':>10}{'error':>8}"
    lines = [head, "-" * len(head)]
    for name, pr in preds.items():
        line = (
            f"{name:<24}{pr.step_s:>9.3f}{pr.samples_per_s:>11.1f}{pr.staleness:>7.2f}  "
            f"{pr.bound:<31}"
        )
        if measured and name in measured:
            err = pr.samples_per_s / measured[name] - 1
            line += f"{measured[name]:>10.1f}{100 * err:>+7.0f}%"
        lines.append(line)
    return "\n".join(lines)


def bench_latency(settings: dict[str, Any], workload: str) -> Latency:
    """The tool latency of a ``benchmarks/async_modes.py`` workload, from its settings:
    ``tail`` log-normal (``--tail-latency``), ``tools`` uniform (``--latency-ms``), else none."""
    if workload == "tail":
        med, sigma, lo, hi = settings["tail_latency"]
        return Latency("lognormal", med / 1e3, sigma, lo / 1e3, hi / 1e3)
    if workload == "tools":
        lo, hi = settings["latency_ms"]
        return Latency("uniform", lo=lo / 1e3, hi=hi / 1e3)
    return Latency("const", 0.0)


def validate_bench(
    results: dict[str, Any],
    workload: str,
    lat: Latency | None,
    speedup: Callable[[float], float] | None = None,
) -> dict[str, Any]:
    """Predictions from the ``sync`` runs of ``workload`` in an ``async_modes.py`` output,
    next to each mode's measured median samples/s; ``speedup`` None: the median ``s(threads)``
    the benchmark measured beside its runs. The update's own ``s(threads)`` is the benchmark's
    ``update_speedup`` where it measured one (older outputs: ``speedup`` for both)."""
    w = results["workloads"][workload]
    settings = results["settings"]
    at = int(w.get("speedup_threads") or settings.get("threads", 2))

    def measured(key: str) -> tuple[float, Callable[[float], float]]:
        """The median ``s(at)`` the benchmark recorded under ``key`` beside its runs."""
        s = statistics.median(w[key]) if at > 1 else 1.0
        return s, power_speedup(s, at)

    s_measured = None
    if speedup is None:
        if not w.get("speedup"):
            raise ValueError(
                f"{workload}: the benchmark output records no speed-up: pass --speedup"
            )
        s_measured, speedup = measured("speedup")
    # the update's own, when the benchmark measured it
    s_update, update_speedup = (
        measured("update_speedup") if w.get("update_speedup") else (None, None)
    )
    contention = statistics.median(w["contention"]) if w.get("contention") else 1.0
    if lat is None:  # the workload's own latency, from the benchmark's settings
        lat = bench_latency(settings, workload)
    sync_runs = [r for r in w["runs"] if r["mode"] == "sync"]
    rows = [row for r in sync_runs for row in r["steps"][1:-1]]
    threads = int(settings.get("threads", 2))
    traj = statistics.median(row["trajectories"] for row in rows)
    groups = statistics.median(row["groups"] for row in rows)
    prof = profile_from_rows(rows, traj, int(round(traj / groups)), threads)
    fa = settings.get("fa_threads") or [max(1, threads - threads // 2), max(1, threads // 2)]
    preds = predict_all(
        prof,
        lat,
        speedup,
        trainer_threads=fa[0],
        rollout_threads=fa[1],
        contention=contention,
        update_speedup=update_speedup,
    )
    if "one_step_off_completion" in w["median"]:  # the benchmark's arm in completion order
        preds["one_step_off_completion"] = predict_one_step_off(prof, lat, take_order="completion")
    measured = {m: v["samples_per_s"] for m, v in w["median"].items() if m in preds}
    stale = {m: v.get("staleness_mean") for m, v in w["median"].items() if m in preds}
    return {
        "workload": workload,
        "latency": asdict(lat),
        "speedup_measured": s_measured,
        "update_speedup_measured": s_update,
        "contention_measured": contention,
        "profile": asdict(prof),
        "predicted": {m: asdict(p) for m, p in preds.items()},
        "measured_samples_per_s": measured,
        "measured_staleness": stale,
        "error": {m: preds[m].samples_per_s / v - 1 for m, v in measured.items()},
        "table": format_predictions(preds, measured),
    }


def _parse_workers(v: str) -> list[tuple[int, int]]:
    out = []
    for pair in v.split(";"):
        n, _, m = pair.partition(",")
        if not n.strip().isdigit() or not m.strip().isdigit() or int(n) < 1 or int(m) < 1:
            raise argparse.ArgumentTypeError(
                f"--workers={v!r}: write N,M pairs (rollout, trainer workers >= 1), ';' between"
            )
        out.append((int(n), int(m)))
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry (module docstring)."""
    ap = argparse.ArgumentParser(prog="postrl bench modes", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics", help="a sync run's metrics.jsonl (a few steps)")
    src.add_argument("--from-bench", help="a benchmarks/async_modes.py --out JSON: validate")
    ap.add_argument(
        "--workload", default="", help="with --from-bench: which workload (default all)"
    )
    ap.add_argument(
        "--latency",
        default="",
        help="tool/reward latency per call (see above; --from-bench: the workload's settings)",
    )
    ap.add_argument("--trajectories", type=float, default=0, help="B (default: from the rows)")
    ap.add_argument("--group-size", type=int, default=0, help="rollout.n (--metrics)")
    ap.add_argument("--threads", type=int, default=2, help="the sync run's trainer.num_threads")
    ap.add_argument("--skip", type=int, default=1, help="--metrics: warm-up steps to skip")
    ap.add_argument("--fa-threads", default="", help="fully_async TRAINER,ROLLOUT threads")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument(
        "--take-order",
        choices=("admission", "completion"),
        default="admission",
        help="one_step_off's trainer.async.take_order (its default: admission)",
    )
    ap.add_argument(
        "--num-warmup-batches",
        type=int,
        default=0,
        help="trainer.async.num_warmup_batches (one_step_off admits 2 + this many batches)",
    )
    ap.add_argument(
        "--speedup",
        type=float,
        default=0.0,
        help="time on 1 thread / on --threads threads (default: measured with a GEMM now)",
    )
    ap.add_argument(
        "--workers",
        type=_parse_workers,
        default=_parse_workers("1,1;4,4;8,8;12,4"),
        help="N,M rollout/trainer worker pairs to extrapolate to ('1,1;4,4;8,8;12,4')",
    )
    ap.add_argument(
        "--update-speedup",
        type=float,
        default=0.0,
        help="--metrics: the update's own speed-up (default: timed now on --model's packed "
        "training pass; without --model, --speedup's)",
    )
    ap.add_argument("--model", default="", help="time s(threads) on this model's fwd+bwd")
    ap.add_argument(
        "--contention",
        type=float,
        default=0.0,
        help="--metrics: the trainer's slow-down beside a computing replica (0: measure now)",
    )
    ap.add_argument("--out", default="", help="write the numbers as JSON")
    args = ap.parse_args(argv)
    try:
        lat = parse_latency(args.latency) if args.latency else None
    except ValueError as e:
        ap.error(str(e))
    if lat is None and not args.from_bench:
        ap.error("--metrics needs --latency (none, const:MS, uniform:..., lognormal:...)")
    if args.from_bench and not args.speedup:
        s_at, how = None, "the benchmark's, measured beside its runs"
    else:
        s_at = args.speedup or measure_speedup(args.threads, args.model or None)
        how = "given" if args.speedup else "measured now"
    speedup = power_speedup(s_at, args.threads) if s_at else None
    out: dict[str, Any] = {"latency": args.latency, "speedup": s_at, "threads": args.threads}
    text = [
        f"speed-up of {args.threads} threads over 1: "
        + (f"{s_at:.2f}x ({how})" if s_at else how)
        + f"; latency {args.latency or 'the workload settings'}"
    ]
    if args.from_bench:
        res = json.loads(Path(args.from_bench).read_text())
        names = [args.workload] if args.workload else list(res["workloads"])
        out["validation"] = []
        for name in names:
            v = validate_bench(res, name, lat, speedup)
            out["validation"].append(v)
            text += [
                f"== {name}: predicted from its sync runs vs measured (latency "
                f"{v['latency']}, s({args.threads}) {v['speedup_measured'] or s_at:.2f}, the "
                f"update's {v['update_speedup_measured'] or v['speedup_measured'] or s_at:.2f}, "
                f"contention {v['contention_measured']:.2f}) ==",
                v["table"],
            ]
        prof = Profile(**out["validation"][-1]["profile"])
        lat = Latency(**out["validation"][-1]["latency"])
    else:
        rows = [json.loads(x) for x in Path(args.metrics).read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "timing_s/step" in r][args.skip :]
        if not rows:
            ap.error(f"--metrics={args.metrics}: no step rows after skipping {args.skip}")
        if not args.trajectories or not args.group_size:
            ap.error("--metrics needs --trajectories (train_batch_size x n) and --group-size (n)")
        prof = profile_from_rows(rows, args.trajectories, args.group_size, args.threads)
        fa = (
            [int(x) for x in args.fa_threads.split(",")]
            if args.fa_threads
            else [max(1, args.threads - args.threads // 2), max(1, args.threads // 2)]
        )
        c = args.contention or measure_contention(fa[0], fa[1], args.model or None)
        s_upd = args.update_speedup or (
            measure_speedup(args.threads, args.model, kind="update") if args.model else s_at
        )
        out["update_speedup"] = s_upd
        preds = predict_all(
            prof,
            lat,
            speedup,
            trainer_threads=fa[0],
            rollout_threads=fa[1],
            max_staleness=args.max_staleness,
            contention=c,
            take_order=args.take_order,
            batches_ahead=2 + args.num_warmup_batches,
            update_speedup=power_speedup(s_upd, args.threads),
        )
        out["profile"], out["predicted"] = asdict(prof), {m: asdict(p) for m, p in preds.items()}
        out["contention"] = c
        text += [
            f"profile: B={prof.trajectories:g} G={prof.gen_compute_s:.3f}s gen={prof.gen_s:.3f}s "
            f"U={prof.after_gen_s:.3f}s calls/traj={prof.calls_per_traj:.2f}; contention {c:.2f}"
            f"; the update's speed-up {s_upd:.2f}x",
            format_predictions(preds),
        ]
    text.append("extrapolated (each worker = this machine's cores, linear, no comm cost):")
    out["extrapolated"] = {}
    for n, m in args.workers:
        preds = extrapolate(
            prof, lat, n, m, args.max_staleness, args.take_order, 2 + args.num_warmup_batches
        )
        out["extrapolated"][f"{n},{m}"] = {k: asdict(p) for k, p in preds.items()}
        text.append(
            f"  N={n:<3} M={m:<3} "
            + "  ".join(
                f"{k} {p.samples_per_s:8.1f}/s (stale {p.staleness:.2f})" for k, p in preds.items()
            )
        )
    sys.stdout.write("\n".join(text) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
