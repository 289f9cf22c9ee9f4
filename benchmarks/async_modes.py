"""``trainer.mode=sync`` vs ``one_step_off`` vs ``fully_async``, side by side, on two workloads.

What it measures
    For each workload, short training runs (``--steps`` RL steps each) through the public API
    (``postrl.config.load_config`` + ``postrl.trainer.RLTrainer(cfg).fit()``), **interleaved in
    one process**: sync, one_step_off, sync, one_step_off, ... for ``--repeats`` repeats, so
    background load on a shared machine hits both modes alike. Only ``trainer.mode`` differs
    between the two runs of a pair (same model, data, seed, config; one_step_off with the
    default ``trainer.async.max_staleness=1``). Every run logs to a temporary run dir
    (``trainer.loggers=[jsonl]``, no validation) and the numbers come from its
    ``metrics.jsonl``.

    ``fully_async`` runs its rollout replica in a process of its own: the same cores are split,
    ``--threads // 2`` torch threads for the replica and the rest for the trainer (``sync`` and
    ``one_step_off`` use all ``--threads`` for both, in turn); it pushes weights after every
    batch (``parameter_sync_step=1``: as many optimizer steps per sample as ``sync``). Its
    ``trainer_idle`` column is the fraction of step time the trainer waited for samples
    (``async/trainer_idle_fraction``), ``replica_idle`` the fraction of wall time the replica's
    engine ran no step (``rollout/replica_idle_fraction``, from the engine's busy time sampled
    at the health pings).

    Workloads:

    * ``w1`` — the reference workload W1 (``postrl bench step``, ``postrl.bench.step``): the
      SFT-warmed tiny Qwen2 (``shared/w1/tiny-qwen2-sft``), 16 addition prompts x 8 samples,
      <= 16 new tokens, T=1, GRPO, one optimizer step per batch, fp32. Short, uniform
      responses leave little tail for one_step_off to hide, and on CPU rollout and training
      run on the same cores in one process (no compute overlap), so expect its costs to show:
      the separate old-log-prob forward an off-policy batch needs (sync fuses it into the
      update) and the batch generated ahead.
    * ``tools`` — the multi-turn tool-arith task of ``examples/grpo_tool_arith.yaml`` (2-digit
      products, ``bound`` prompt style, the ``tool_agent`` loop, 8 prompts x 8 samples), on the
      recipe's SFT-warmed model (built once, cached under ``--work-dir``), with the calculator
      replaced by :class:`LatencyCalculatorTool`: the same exact calculator, but every call
      first waits a latency drawn uniformly from ``--latency-ms`` (default 20-300 ms), as a
      real environment waiting on I/O would. Trajectories that answer directly end after a few
      tokens; those that call the tool generate a 42-token call, wait, and generate again: a
      long tail. A sync step waits for its slowest trajectory; one_step_off is meant to keep
      generating the next batch meanwhile, and a tool wait keeps running while the actor
      trains.

    * ``tail`` — the ``tools`` task with the latency async exists for: log-normal per call
      (median 200 ms, sigma 1), clipped to [50 ms, 2 s] (``--tail-latency``), as a sandbox or
      a remote API answers. Calls within a ``sync`` step wait side by side (asyncio), so
      ``sync`` pays the batch's slowest call, not the sum. ``--workload all`` runs all three.

    Before each repeat the benchmark measures ``s(threads)``, the speed-up of ``--threads``
    torch threads over one on the workload's model (``postrl.bench.modes.measure_speedup``),
    and the update's own (``kind="update"``: the engine's packed training pass, whose larger
    matrices and fused kernels scale better than a decode step), so that ``postrl bench modes
    --from-bench OUT`` can predict each mode from the ``sync`` runs and set the prediction next
    to the measurement. ``sync`` logs
    ``timing_s/gen_engine`` (the engine's compute inside ``timing_s/gen``).

    Per run, the first step (warm-up: allocation, first-call costs) is skipped, and so is the
    last one when the run has at least 3 steps: one_step_off generates one batch ahead, so at
    step 1 it generates two batches and at the last step none (the run's budget stops
    admission). Steps 2..N-1 are the steady state, one batch generated and one trained per
    step in both modes; including the last step would credit one_step_off with a batch of
    generation it never did inside the window. (With ``--steps 2`` the window is step 2 and
    includes that drain step: a smoke-test setting, not a measurement.) Over the window:

    * ``samples/s`` — trajectories trained / sum of ``timing_s/step`` (the headline);
    * ``step_s``, ``gen_s`` — mean ``timing_s/step`` and ``timing_s/gen`` (in one_step_off
      ``gen`` is only the part of generation the trainer waited for);
    * ``stale`` — ``replay/staleness/mean`` (mean over steps) and ``replay/staleness/max``
      (max over steps), in policy versions; plus a histogram of the per-step means;
    * ``drop/grp`` — groups evicted (``replay/evicted/{stale,filtered,failed}``) per trained
      group;
    * ``intr/step`` — ``async/interrupted_trajectories`` (trajectories paused mid-generation
      by the weight update and resumed on the new weights), mean per step;
    * ``calls/traj`` — tool calls per trajectory (``agent/num_tool_calls``), so the tail is
      visible.

    ``n/a`` means the mode does not log the metric (sync is on-policy: staleness 0, nothing
    evicted unless DAPO filtering is on, nothing interrupted). The ``whole-run`` line divides
    all trajectories by all step time (warm-up and drain included: both modes then did
    exactly the same work).

How to run
    ``python benchmarks/async_modes.py [--workload w1|tools|both] [--steps N] [--repeats R]
    [--threads T] [--out results.json]``

    Defaults: both workloads, 8 steps, 3 repeats, 2 threads: 12 runs, about 18 minutes on
    the shared 2-core development machine (load average ~4). The first run also SFT-warms
    the tool-arith model as ``examples/tool_arith_recipe.sh`` does (500 steps; 26 minutes on
    that loaded machine) and caches it under ``--work-dir``. ``--set key=value``
    (repeatable) adds a config override to both modes (e.g. ``actor.policy_loss=decoupled``);
    ``--w1-model`` / ``--tools-model`` pick other starting models (no warm-up SFT then).

How to read it
    One table per workload: a row per run, then the median over repeats per mode, then the
    ratio one_step_off / sync of samples/s (per repeat and its median; > 1 means one_step_off
    trains more trajectories per second) and a verdict line that says plainly whether
    one_step_off was faster, slower, or inconclusive (the per-repeat ratios straddle 1). On a
    shared machine the numbers are noisy: compare the per-repeat spread with the gap before
    believing a ratio, and read the load average printed in the header. ``drop/grp`` > 0 is
    generation thrown away (groups that went stale before they completed); a per-step
    staleness mean below 1 in one_step_off means groups of the newer batch were trained
    before older ones. Nothing here is a quality comparison: one_step_off trains on batches
    one policy version old.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from postrl.data.tool_arith import ProblemCalculatorTool
from postrl.tools.base import ToolResponse, register_tool

logger = logging.getLogger("async_modes")

ROOT = Path(__file__).resolve().parents[1]
MODES = (
    "sync",
    "one_step_off",
    "fully_async",
    "fully_async_switch",
    "fully_async_ray",
    "fully_async_ray_os",
    "one_step_off_completion",
    "fully_async_admission",
    "fully_async_wait",
)
"""Every arm the benchmark knows; ``--modes`` picks (``sync`` always runs: the baseline).
``one_step_off_completion`` is ``one_step_off`` taking its groups in completion order
(``trainer.async.take_order=completion``; the mode's own is admission order),
``fully_async_admission`` is ``fully_async`` taking them in admission order (its own is
completion order), and ``fully_async_wait`` never drops a stale group
(``trainer.async.staleness_strategy=wait``: a take waits for the groups it must train now to
keep them within the bound).
``fully_async_switch`` is ``fully_async`` with ``trainer.async.idle_switch=auto``;
``fully_async_ray`` runs it on Ray (replica actors, one training worker; trajectories through
the driver) and ``fully_async_ray_os`` adds ``trainer.async.data_plane=object_store``
(trajectories run, scored and kept on the rollout side). The Ray arms suit the ``w1`` workload:
the ``tools`` workload's tool is registered in this script, which replica actors do not
import."""
DEFAULT_MODES = MODES[:3]
"""What runs without ``--modes`` (the idle-switch arm is asked for by name)."""
_RAY = ["trainer.backend=ray", "trainer.num_workers=1"]
ARM_OVERRIDES = {
    "fully_async_switch": ("fully_async", ["trainer.async.idle_switch=auto"]),
    "fully_async_own": ("fully_async", ["trainer.lend_cores=false"]),  # no core lending
    "fully_async_ray": ("fully_async", _RAY),
    "fully_async_ray_os": ("fully_async", [*_RAY, "trainer.async.data_plane=object_store"]),
    # one_step_off's take in completion order (its default is admission order: verl's batches)
    "one_step_off_completion": ("one_step_off", ["trainer.async.take_order=completion"]),
    "fully_async_admission": ("fully_async", ["trainer.async.take_order=admission"]),
    # never drop a stale group: a take waits for the groups whose bound it would otherwise miss
    "fully_async_wait": ("fully_async", ["trainer.async.staleness_strategy=wait"]),
}
"""Arms that are a registered mode plus overrides: name → (trainer.mode, overrides)."""
WORKLOADS = ("w1", "tools", "tail")
TOOL_NAME = "latency_calculator"  # registry name; the model still calls the function `calculator`
_EVICTED = ("replay/evicted/stale", "replay/evicted/filtered", "replay/evicted/failed")
_KEEP = (
    "step",
    "timing_s/step",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/update_actor",
    "timing_s/replay_wait",
    "replay/staleness/mean",
    "replay/staleness/max",
    *_EVICTED,
    "replay/refills",
    "async/interrupted_trajectories",
    "async/trainer_idle_fraction",
    "async/switch/switched",
    "rollout/replica_idle_fraction",
    "timing_s/gen_engine",
    "timing_s/reward",
    "timing_s/sync_weights",
    "weights/pause_s",
    "async/in_flight_groups",
    "dynamic_sampling/num_kept_groups",
    "agent/num_tool_calls",
    "agent/tool_time_s",
    "response_length/mean",
    "critic/score/mean",
    "driver/in_bytes",
    "driver/out_bytes",
)

# tool-arith recipe (examples/tool_arith_recipe.sh): data and SFT warm-up settings
_TA_DATA = {"min_digits": 2, "max_digits": 2, "kinds": ("mul",), "prompt_style": "bound"}
_TA_SFT = {
    "max_steps": 500,
    "epochs": 10,
    "lr": 1e-3,
    "batch_tokens": 1024,
    "warmup_steps": 5,
}


@register_tool(TOOL_NAME, override=True)
class LatencyCalculatorTool(ProblemCalculatorTool):
    """The tool-arith calculator (:class:`~postrl.data.tool_arith.ProblemCalculatorTool`, exact,
    evaluates the episode's problem) behind a latency per call (an ``asyncio.sleep``: the event
    loop, and so the other trajectories, keep running). Config: ``distribution`` —
    ``uniform`` (default: drawn from ``[min_latency_ms, max_latency_ms]``) or ``lognormal``
    (median ``median_ms``, log-space standard deviation ``sigma``, clipped to
    ``[min_latency_ms, max_latency_ms]``: the heavy tail of a sandbox or a remote API) —,
    ``seed`` and the calculator's own bounds. Adds ``tool/latency_s`` to the call's metrics."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config, tool_schema)
        self.lo = float(self.config.get("min_latency_ms", 20)) / 1000
        self.hi = float(self.config.get("max_latency_ms", 300)) / 1000
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"need 0 <= min_latency_ms <= max_latency_ms, got {self.config}")
        self.dist = str(self.config.get("distribution", "uniform"))
        if self.dist not in ("uniform", "lognormal"):
            raise ValueError(
                f"distribution={self.dist!r}: choose 'uniform' or 'lognormal' (tool config)"
            )
        self.median = float(self.config.get("median_ms", 200)) / 1000
        self.sigma = float(self.config.get("sigma", 1.0))
        if self.dist == "lognormal" and not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"lognormal needs median_ms > 0 and sigma >= 0, got {self.config}")
        self.rng = random.Random(int(self.config.get("seed", 0)))

    def draw(self) -> float:
        """One call's latency in seconds."""
        if self.dist == "uniform":
            return self.rng.uniform(self.lo, self.hi)
        x = self.median * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
        return min(self.hi, max(self.lo, x))

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        """Wait the drawn latency, then evaluate like the calculator."""
        delay = self.draw()
        await asyncio.sleep(delay)
        resp = await super().execute(instance_id, parameters)
        resp.metrics = {**resp.metrics, "tool/latency_s": delay}
        return resp


# ---------------------------------------------------------------------------- workloads
def _find_w1_model() -> Path | None:
    env = os.environ.get("POSTRL_W1_MODEL")
    cands = [Path(env)] if env else []
    # the checkout, or a folder above it (a worktree under /work/wt/<name> finds /work/shared)
    cands += [d / "shared/w1/tiny-qwen2-sft" for d in (ROOT, *ROOT.parents)]
    return next((p for p in cands if (p / "config.json").exists()), None)


def prepare_w1(work: Path, model: str | None, threads: int) -> tuple[Path, Path]:
    """W1's starting model (``--w1-model``, else ``shared/w1/tiny-qwen2-sft``, else the one
    ``postrl bench step`` SFT-warms and caches) and its 512 addition prompts: 3-digit sums for
    the shared model (or ``--w1-model``), 2-digit for bench step's."""
    from postrl.bench.step import W1
    from postrl.bench.step import prepare_w1 as bench_prepare_w1
    from postrl.data import generate_addition, write_parquet

    w = W1(threads=threads)

    def prompts(digits: int) -> Path:
        # the shared model was warmed on 3-digit sums and answers every sum with three digits
        # (2-digit prompts would score 0 and train nothing); bench step's own model on 2-digit
        train = work / "data" / f"addition{digits}_train_{w.train_rows}_{w.seed}.parquet"
        if not train.exists():
            rows = generate_addition(w.train_rows, seed=w.seed, split="train", max_digits=digits)
            write_parquet(rows, train)
        return train

    if model:
        return Path(model), prompts(3)
    found = _find_w1_model()
    if found is not None:
        return found, prompts(3)
    logger.warning("shared/w1/tiny-qwen2-sft not found: SFT-warming W1's model as bench step does")
    return bench_prepare_w1(work / "w1", w)[0], prompts(2)


def prepare_tools(work: Path, model: str | None, threads: int) -> tuple[Path, Path]:
    """The tool-arith recipe's data and SFT-warmed model (cached under ``work``; a marker
    records the settings, a rerun with the same ones skips the SFT)."""
    from postrl.data import write_parquet
    from postrl.data.tool_arith import generate_tool_arith, tool_arith_demonstrations

    train = work / "data" / "tool_arith_train.parquet"
    if not train.exists():
        write_parquet(generate_tool_arith(512, seed=0, split="train", **_TA_DATA), train)
    if model:
        return Path(model), train
    from postrl.supervised.sft import run_sft
    from postrl.testing import make_model

    sft_dir, marker = work / "sft-model", work / "sft-model" / "bench_done.json"
    key = {
        "data": {**_TA_DATA, "kinds": list(_TA_DATA["kinds"])},
        "demos": {"n": 6000, "copy_fraction": 0.5, "tool_fraction": 0.3},
        "sft": _TA_SFT,
    }
    if marker.exists() and json.loads(marker.read_text()) == key:
        return sft_dir, train
    logger.info("SFT-warming the tool-arith model (examples/tool_arith_recipe.sh settings)")
    base = make_model(work / "base", preset="tiny", seed=0)
    demos = write_parquet(
        tool_arith_demonstrations(seed=0, **key["demos"], **_TA_DATA),
        work / "data" / "tool_arith_demos.parquet",
    )
    t0 = time.perf_counter()
    m = run_sft(str(base), str(demos), str(sft_dir), num_threads=threads, log_every=100, **_TA_SFT)
    logger.info(
        "SFT: loss %.3f -> %.3f, %.0f s",
        m["sft/first_loss"],
        m["sft/final_loss"],
        time.perf_counter() - t0,
    )
    marker.write_text(json.dumps(key))
    return sft_dir, train


def _tool_config(
    work: Path, latency_ms: tuple[float, float], lognormal: tuple[float, float] | None = None
) -> Path:
    """The tool config file: uniform latency in ``latency_ms``, or with ``lognormal=(median_ms,
    sigma)`` log-normal clipped to ``latency_ms``."""
    import yaml

    tag = f"_ln{lognormal[0]:g}_{lognormal[1]:g}" if lognormal else ""
    path = work / f"latency_calculator_{latency_ms[0]:g}_{latency_ms[1]:g}{tag}.yaml"
    dist = (
        {"distribution": "lognormal", "median_ms": lognormal[0], "sigma": lognormal[1]}
        if lognormal
        else {}
    )
    entry = {
        "class_name": TOOL_NAME,
        "config": {
            **dist,
            "min_latency_ms": latency_ms[0],
            "max_latency_ms": latency_ms[1],
            "seed": 0,
            "max_digits": 2000,
            "max_exponent": 1000,
            "max_length": 200,
        },
    }
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    return path


def workload_config(
    name: str, args: argparse.Namespace, work: Path
) -> tuple[str | None, list[str], str]:
    """``(base config file, overrides without mode/run dir/steps, description)``."""
    t = args.threads
    common = [
        f"trainer.num_threads={t}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.resume_mode=disable",
        "trainer.loggers=[jsonl]",
        "data.val_files=[]",
    ]
    if name == "w1":
        from postrl.bench.step import W1, w1_overrides

        model, train = prepare_w1(work, args.w1_model, t)
        w = W1(threads=t)
        over = w1_overrides(model, train, "RUN", w)
        over = [o for o in over if not o.startswith("trainer.run_dir=")]
        desc = (
            f"W1: {model.name}, {w.num_prompts} prompts x {w.n} samples, <= {w.new_tokens} new "
            f"tokens, T={w.temperature}, GRPO, fp32, {t} threads"
        )
        base = None
    elif name in ("tools", "tail"):
        model, train = prepare_tools(work / "tools", args.tools_model, t)
        if name == "tools":
            lat, ln = args.latency_ms, None
            law = f"U({lat[0]:g}, {lat[1]:g}) ms"
        else:
            med, sigma, lo, hi = args.tail_latency
            lat, ln = (lo, hi), (med, sigma)
            law = f"lognormal(median {med:g} ms, sigma {sigma:g}) clipped to [{lo:g}, {hi:g}] ms"
        over = [
            f"model.path={model}",
            f"data.train_files=[{train}]",
            f"rollout.agent.tool_config_path={_tool_config(work, lat, ln)}",
        ]
        desc = (
            f"{name}: tool-arith (examples/grpo_tool_arith.yaml), {model.name}, 8 prompts x 8 "
            f"samples, <= 2 assistant turns of <= 48 tokens, calculator latency {law} per "
            f"call, {t} threads"
        )
        base = str(ROOT / "examples" / "grpo_tool_arith.yaml")
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    if args.prompts:
        over += [
            f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={args.prompts}",
        ]
    if args.n:
        over += [f"rollout.n={args.n}"]
    return base, over + common + list(args.set), desc


# ---------------------------------------------------------------------------- one run
def mode_overrides(
    mode: str, overrides: list[str], split: tuple[int, int] | None = None
) -> list[str]:
    """What a mode changes besides ``trainer.mode``: ``fully_async`` gives its rollout replica
    process ``split[1]`` torch threads and the trainer ``split[0]`` (default: the cores of
    ``trainer.num_threads`` split in half), pushes weights after every batch
    (``parameter_sync_step=1``, so it takes as many optimizer steps per sample as ``sync``)."""
    if mode in ARM_OVERRIDES:
        return [*mode_overrides(ARM_OVERRIDES[mode][0], overrides, split), *ARM_OVERRIDES[mode][1]]
    if mode != "fully_async":
        return []
    threads = next(
        (
            int(o.split("=", 1)[1])
            for o in reversed(overrides)
            if o.startswith("trainer.num_threads=")
        ),
        2,
    )
    trainer, rollout = split or (max(1, threads - max(1, threads // 2)), max(1, threads // 2))
    return [
        f"trainer.async.rollout_threads={rollout}",
        f"trainer.num_threads={trainer}",
        "trainer.async.parameter_sync_step=1",
    ]


def _model_of(overrides: list[str]) -> str | None:
    """The ``model.path=`` among a workload's overrides (None: the base config's)."""
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("model.path=")), None)


def run_once(
    base: str | None,
    overrides: list[str],
    mode: str,
    steps: int,
    split: tuple[int, int] | None = None,
) -> list[dict]:
    """Train ``steps`` steps in ``mode`` in a temporary run dir; return its metrics rows
    (the :data:`_KEEP` keys of each step) plus ``trajectories`` and ``groups`` per step."""
    from postrl.config import load_config
    from postrl.trainer import RLTrainer

    with tempfile.TemporaryDirectory(prefix=f"postrl-async-{mode}-") as run:
        cfg = load_config(
            base,
            [
                *overrides,
                *mode_overrides(mode, overrides, split),
                f"trainer.mode={ARM_OVERRIDES.get(mode, (mode,))[0]}",
                f"trainer.total_steps={steps}",
                f"trainer.run_dir={run}",
            ],
        )
        trainer = RLTrainer(cfg)
        try:
            trainer.fit()
        finally:
            trainer.close()
        lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
    rows = []
    for line in lines:
        r = json.loads(line)
        if "timing_s/step" not in r:  # e.g. a final validation row
            continue
        groups = r.get("dynamic_sampling/num_kept_groups", cfg.data.train_batch_size)
        row = {k: float(r[k]) for k in _KEEP if k in r}
        row["groups"] = float(groups)
        row["trajectories"] = float(groups) * cfg.rollout.n
        rows.append(row)
    if len(rows) != steps:
        raise RuntimeError(f"{mode}: expected {steps} step rows in metrics.jsonl, got {len(rows)}")
    return rows


def window(rows: list[dict]) -> list[dict]:
    """The measured steps: drop the first (warm-up) and, with >= 3 steps, the last (drain)."""
    return rows[1:-1] if len(rows) >= 3 else rows[1:]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def summarize_run(rows: list[dict]) -> dict[str, Any]:
    """The reported numbers of one run (module docstring); ``None`` where not logged."""
    w = window(rows)
    step_time = sum(r["timing_s/step"] for r in w)
    groups = sum(r["groups"] for r in w)
    has_replay = any(_EVICTED[0] in r for r in w)
    evicted = sum(r.get(k, 0.0) for r in w for k in _EVICTED) if has_replay else None
    stale_max = [r["replay/staleness/max"] for r in w if "replay/staleness/max" in r]
    return {
        "measured_steps": [int(r["step"]) for r in w],
        "samples_per_s": sum(r["trajectories"] for r in w) / step_time,
        "step_s": _mean(w, "timing_s/step"),
        "gen_s": _mean(w, "timing_s/gen"),
        "old_log_prob_s": _mean(w, "timing_s/old_log_prob"),
        "update_actor_s": _mean(w, "timing_s/update_actor"),
        "staleness_mean": _mean(w, "replay/staleness/mean"),
        "staleness_max": max(stale_max) if stale_max else None,
        "staleness_step_means": [
            r["replay/staleness/mean"] for r in w if "replay/staleness/mean" in r
        ],
        "evicted_groups": evicted,
        "drop_rate": evicted / groups if evicted is not None and groups else None,
        "interrupted_per_step": _mean(w, "async/interrupted_trajectories"),
        "tool_calls_per_traj": _mean(w, "agent/num_tool_calls"),
        "trainer_idle": _mean(w, "async/trainer_idle_fraction"),
        "replica_idle": _mean(w, "rollout/replica_idle_fraction"),
        "switched": _mean(w, "async/switch/switched"),
        "driver_kb": (_mean(w, "driver/in_bytes") or 0.0) / 1e3
        + (_mean(w, "driver/out_bytes") or 0.0) / 1e3
        if any("driver/in_bytes" in r for r in w)
        else None,
        "swap_pause_s": _mean(w, "weights/pause_s"),
        "response_length": _mean(w, "response_length/mean"),
        "score": _mean(w, "critic/score/mean"),
        "whole_run_samples_per_s": sum(r["trajectories"] for r in rows)
        / sum(r["timing_s/step"] for r in rows),
    }


def _median(vals: list[float | None]) -> float | None:
    v = [x for x in vals if x is not None]
    return statistics.median(v) if v else None


def summarize_workload(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats per mode, each async mode's ratio to sync and its verdict."""
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    med: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mine = [r["summary"] for r in runs if r["mode"] == mode]
        keys = [k for k in mine[0] if k not in ("measured_steps", "staleness_step_means")]
        med[mode] = {k: _median([s[k] for s in mine]) for k in keys}
        hist = Counter(f"{x:.2f}" for s in mine for x in s["staleness_step_means"])
        med[mode]["staleness_histogram"] = dict(sorted(hist.items()))
    by_rep = {(r["mode"], r["repeat"]): r["summary"] for r in runs}
    reps = sorted({r["repeat"] for r in runs})
    ratios, verdicts = {}, {}
    for mode in modes[1:]:
        per_rep = [
            by_rep[(mode, i)]["samples_per_s"] / by_rep[("sync", i)]["samples_per_s"] for i in reps
        ]
        whole = [
            by_rep[(mode, i)]["whole_run_samples_per_s"]
            / by_rep[("sync", i)]["whole_run_samples_per_s"]
            for i in reps
        ]
        ratio = statistics.median(per_rep)
        if min(per_rep) < 1 < max(per_rep):
            verdict = (
                f"INCONCLUSIVE: the per-repeat ratios straddle 1 ({min(per_rep):.2f}x .. "
                f"{max(per_rep):.2f}x); the difference is within this machine's noise"
            )
        elif ratio > 1:
            verdict = f"{mode} is FASTER than sync here: {ratio:.2f}x the samples/s (median)"
        else:
            verdict = (
                f"{mode} is NOT faster than sync here: {ratio:.2f}x the samples/s (median), "
                f"i.e. {100 * (1 - ratio):.0f}% fewer samples/s"
            )
        ratios[mode] = {
            "samples_per_s": ratio,
            "samples_per_s_per_repeat": per_rep,
            "whole_run_samples_per_s": statistics.median(whole),
            "whole_run_per_repeat": whole,
        }
        verdicts[mode] = verdict
    return {"median": med, "ratios": ratios, "verdicts": verdicts}


# ---------------------------------------------------------------------------- report
_COLS = (
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("step_s", "step_s", "{:.3f}"),
    ("gen_s", "gen_s", "{:.3f}"),
    ("stale_mean", "staleness_mean", "{:.2f}"),
    ("stale_max", "staleness_max", "{:.0f}"),
    ("drop/grp", "drop_rate", "{:.3f}"),
    ("intr/step", "interrupted_per_step", "{:.1f}"),
    ("calls/traj", "tool_calls_per_traj", "{:.2f}"),
    ("trainer_idle", "trainer_idle", "{:.2f}"),
    ("replica_idle", "replica_idle", "{:.2f}"),
    ("switched", "switched", "{:.2f}"),
    ("driver_kB", "driver_kb", "{:.1f}"),
)


def _fmt(v: Any, f: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)


def format_table(name: str, res: dict[str, Any]) -> str:
    """The table printed for one workload."""
    runs, med = res["runs"], res["median"]
    modes = list(med)
    steps = runs[0]["summary"]["measured_steps"]
    n_steps = len(runs[0]["steps"])
    head = f"{'mode':<20}{'rep':>4}" + "".join(f"{c:>13}" for c, _, _ in _COLS)
    lines = [
        f"== {name} ==  {res['description']}",
        f"   {n_steps} steps per run, measured steps {steps[0] if steps else '-'}.."
        f"{steps[-1] if steps else '-'} ({len(steps)}), {len(runs) // len(modes)} repeat(s), "
        "interleaved"
        + ("  [window includes the drain step: smoke setting]" if n_steps < 3 else ""),
        head,
        "-" * len(head),
    ]
    for r in runs:
        s = r["summary"]
        lines.append(
            f"{r['mode']:<20}{r['repeat'] + 1:>4}"
            + "".join(f"{_fmt(s[k], f):>13}" for _, k, f in _COLS)
        )
    lines.append("-" * len(head))
    for mode in modes:
        lines.append(
            f"{mode:<20}{'med':>4}" + "".join(f"{_fmt(med[mode][k], f):>13}" for _, k, f in _COLS)
        )
    for mode in modes:
        h = med[mode]["staleness_histogram"]
        if h:
            lines.append(
                f"staleness histogram ({mode}, per-step mean, all repeats): "
                + "  ".join(f"{k}: {v}" for k, v in h.items())
            )
    for mode, ratio in res["ratios"].items():
        lines += [
            f"{mode} / sync samples/s: median {ratio['samples_per_s']:.2f}x   per repeat "
            + ", ".join(f"{x:.2f}x" for x in ratio["samples_per_s_per_repeat"]),
            f"  whole-run (all steps, warm-up and drain included) median "
            f"{ratio['whole_run_samples_per_s']:.2f}x   per repeat "
            + ", ".join(f"{x:.2f}x" for x in ratio["whole_run_per_repeat"]),
            f"  verdict: {res['verdicts'][mode]}",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driver
def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (workload, repeat, mode) in order and return the raw and summarized numbers."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    names = {"both": WORKLOADS[:2], "all": WORKLOADS}.get(args.workload, (args.workload,))
    out: dict[str, Any] = {
        "settings": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(vars(args).items())
        },
        "machine": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
        "workloads": {},
    }
    for name in names:
        base, overrides, desc = workload_config(name, args, work)
        runs, speedups, update_speedups, contention = [], [], [], []
        fa = args.fa_threads or (
            max(1, args.threads - args.threads // 2),
            max(1, args.threads // 2),
        )
        s_threads = max(args.threads, fa[0] + fa[1])
        for rep in range(args.repeats):
            # this machine's thread speed-up and contention now (postrl bench modes reads them)
            from postrl.bench.modes import measure_contention, measure_speedup

            if args.probes:  # up to every core a lending trainer may run on
                model = _model_of(overrides)
                speedups.append(measure_speedup(s_threads, model))
                if model:  # the update's own: the engine's packed training pass
                    update_speedups.append(measure_speedup(s_threads, model, kind="update"))
                contention.append(measure_contention(fa[0], fa[1], model))
            for mode in ("sync", *[m for m in args.modes if m != "sync"]):
                t0 = time.perf_counter()
                rows = run_once(base, overrides, mode, args.steps, args.fa_threads)
                s = summarize_run(rows)
                logger.info(
                    "%s %s repeat %d: %.1f samples/s (%.0f s wall)",
                    name,
                    mode,
                    rep + 1,
                    s["samples_per_s"],
                    time.perf_counter() - t0,
                )
                runs.append({"mode": mode, "repeat": rep, "steps": rows, "summary": s})
        out["workloads"][name] = {
            "description": desc,
            "base_config": base,
            "overrides": overrides,
            "runs": runs,
            "speedup": speedups,
            "update_speedup": update_speedups,
            "speedup_threads": s_threads,
            "contention": contention,
            "loadavg": list(os.getloadavg()),
            **summarize_workload(runs),
        }
    out["machine"]["loadavg_end"] = list(os.getloadavg())
    return out


def _latency(s: str) -> tuple[float, float]:
    lo, _, hi = s.partition(",")
    return float(lo), float(hi or lo)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmarks/async_modes.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workload", choices=[*WORKLOADS, "both", "all"], default="both")
    ap.add_argument(
        "--modes",
        type=lambda v: tuple(m for m in v.split(",") if m),
        default=DEFAULT_MODES,
        help=f"comma-separated arms compared with sync, of {','.join(MODES)} "
        f"(default: {','.join(DEFAULT_MODES)})",
    )
    ap.add_argument("--steps", type=int, default=8, help="RL steps per run (>= 2; default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="sync/one_step_off pairs per workload")
    ap.add_argument("--threads", type=int, default=2, help="trainer.num_threads")
    ap.add_argument("--out", default="", help="write the raw numbers as JSON to this path")
    ap.add_argument(
        "--work-dir",
        default=str(ROOT / "runs" / "bench_async_modes"),
        help="caches data and the SFT-warmed tool-arith model",
    )
    ap.add_argument("--w1-model", default="", help="W1 starting model (default: shared/w1/...)")
    ap.add_argument("--tools-model", default="", help="tool-arith model (default: SFT-warm one)")
    ap.add_argument(
        "--latency-ms", type=_latency, default=(20.0, 300.0), help="tool latency range LO,HI"
    )
    ap.add_argument(
        "--tail-latency",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=(200.0, 1.0, 50.0, 2000.0),
        metavar="MEDIAN_MS,SIGMA,LO_MS,HI_MS",
        help="the tail workload's log-normal tool latency (default 200,1,50,2000)",
    )
    ap.add_argument(
        "--fa-threads",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=None,
        metavar="TRAINER,ROLLOUT",
        help="fully_async torch threads of the trainer and of the replica (default: half each)",
    )
    ap.add_argument(
        "--no-probes",
        dest="probes",
        action="store_false",
        help="skip the s(threads) and contention probes before each repeat (tests)",
    )
    ap.add_argument("--prompts", type=int, default=0, help="override prompts per step (tests)")
    ap.add_argument("--n", type=int, default=0, help="override samples per prompt (tests)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra override, both modes"
    )
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps={args.steps}: need >= 2 (the first step is a warm-up, not measured)")
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats}: need >= 1")
    if len(args.tail_latency) != 4 or not 0 < args.tail_latency[2] <= args.tail_latency[3]:
        ap.error(f"--tail-latency={args.tail_latency}: need MEDIAN_MS,SIGMA,LO_MS,HI_MS, LO <= HI")
    return args


def main(argv: list[str] | None = None) -> int:
    """CLI entry (module docstring); prints one table per workload, writes ``--out``."""
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
        )
    res = {"argv": sys.argv[1:] if argv is None else list(argv), **run_benchmark(args)}
    la0, la1 = res["machine"]["loadavg_start"][0], res["machine"]["loadavg_end"][0]
    report = [
        f"{' vs '.join(('sync', *[m for m in args.modes if m != 'sync']))}, "
        f"{res['machine']['cpus']} CPUs, load average (1 min) "
        f"{la0:.2f} at start, {la1:.2f} at end; other jobs on this machine make these numbers noisy"
    ]
    report += [format_table(name, w) for name, w in res["workloads"].items()]
    sys.stdout.write("\n\n".join(report) + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
