"""Do the async modes learn like ``sync``? Held-out accuracy after the same number of samples.

Runs the quickstart task (single-digit addition, the quickstart's SFT-warmed tiny model, the
``examples/grpo_addition.yaml`` recipe) for the same number of GRPO steps in ``sync`` and in
``one_step_off`` (with PPO clipped against the behaviour policy, ``actor.policy_loss=bypass_mode``;
``fully_async`` with decoupled PPO), for each seed,
interleaved (sync seed 0, one_step_off seed 0, sync seed 1, ...), and prints the held-out
accuracy every ``--test-freq`` steps, the mean over seeds and the difference. Both modes train on
exactly ``steps × 16 × 8`` samples; only the policy that generated them differs (one version
old in ``one_step_off``; up to one in ``fully_async``, which runs its rollout replica in a process
of its own with half of ``--threads`` and pushes the weights after every batch,
``parameter_sync_step=1``, so it takes as many optimizer steps as ``sync``).

    python benchmarks/async_learning.py --steps 150 --seeds 0 1      # ≈ 6 × 2 min on 2 cores
    python benchmarks/async_learning.py --modes sync fully_async    # a subset
    python benchmarks/async_learning.py --modes sync fully_async --set trainer.lend_cores=false

The quickstart's model and data are made first if ``--run-dir`` lacks them (``make
quickstart`` stages 1–3). Accuracy is sampled (temperature 1, 4 samples per prompt, 200 prompts),
the quickstart's own validation. Results also go to ``--out`` as JSON.

``--workload tail`` asks the same on the latency workload of ``benchmarks/async_modes.py``
(item 2 of the async goals: "at equal learning per sample"): the multi-turn tool-arith task
(``examples/grpo_tool_arith.yaml``, its SFT-warmed model, built once under ``--work-dir``),
the calculator answering after a log-normal latency (``--tail-latency``, default median 200 ms,
sigma 1, clipped to [50 ms, 2 s]), held-out accuracy on 128 fresh problems, sampled as the
quickstart's (temperature 1, 4 samples each: greedy reaches 1.0 after one step on this task and
would hide any difference), through the same tool loop and latency. A ``fully_async`` or
``one_step_off`` group whose straggler waited on a slow call can age past
``trainer.async.max_staleness`` and be dropped, so what each mode trains is also reported:
the tool calls per trained trajectory and the groups dropped as stale.

    python benchmarks/async_learning.py --workload tail --steps 30 --test-freq 10 --seeds 0 1 2

``--modes`` also takes the arms of ``async_modes.py`` (a mode plus overrides), e.g.
``one_step_off_completion``: ``one_step_off`` taking its groups as they complete instead of in
admission order (``trainer.async.take_order``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # async_modes.py: the tail workload and the arms
    sys.path.insert(0, str(ROOT / "benchmarks"))


OFF_POLICY_LOSS = {"one_step_off": "bypass_mode"}
"""Each async mode's loss (``actor.policy_loss``; ``decoupled`` when not listed): ``one_step_off``
trains two batches sampled by the same weights one after the other, and only PPO clipped against
the behaviour policy keeps the second update from pushing again what the first already pushed
(docs/async.md, "The collapse at the recipe's learning rate"). ``--set`` overrides it."""


def _ensure_quickstart(run: Path, threads: int) -> None:
    if (run / "sft-model" / "model.safetensors").exists():
        return
    from postrl.recipes.quickstart import main as quickstart

    # stages 1-3 (model, data, SFT) plus one GRPO step
    quickstart(["--run-dir", str(run), "--grpo-steps", "1", "--threads", str(threads)])


def _tail_task(work: Path, threads: int, latency: str, model: str = "") -> tuple[Path, list[str]]:
    """The latency workload of ``benchmarks/async_modes.py`` (its config and SFT-warmed
    model, or ``model``), with a held-out set of its own: ``(base config, overrides)``."""
    import async_modes

    from postrl.data import write_parquet
    from postrl.data.tool_arith import generate_tool_arith

    args = async_modes.parse_args(
        ["--workload", "tail", "--threads", str(threads), "--work-dir", str(work)]
        + ["--tail-latency", latency, "--tools-model", model]
    )
    base, over, _ = async_modes.workload_config("tail", args, work)
    val = work / "tools" / "data" / "tool_arith_val.parquet"
    if not val.exists():  # disjoint from the training draw (its own seed and split)
        write_parquet(generate_tool_arith(128, seed=1, split="val", **async_modes._TA_DATA), val)
    sampled = ["rollout.val_kwargs.temperature=1.0", "rollout.val_kwargs.n=4"]
    return Path(base), over + [f"data.val_files=[{val}]", *sampled]


def _train(
    run: Path,
    out: Path,
    mode: str,
    seed: int,
    steps: int,
    freq: int,
    threads: int,
    overrides: tuple[str, ...] = (),
    task: tuple[Path, list[str]] | None = None,
):
    from async_modes import ARM_OVERRIDES  # arms: a registered mode plus overrides

    from postrl.config import load_config
    from postrl.trainer import RLTrainer

    mode, arm = ARM_OVERRIDES.get(mode, (mode, []))
    loss = OFF_POLICY_LOSS.get(mode, "decoupled")
    extra = [f"trainer.mode={mode}", f"actor.policy_loss={loss}"] if mode != "sync" else []
    extra += arm
    if mode == "fully_async":
        rollout = max(1, threads // 2)
        extra += [
            "trainer.async.parameter_sync_step=1",
            f"trainer.async.rollout_threads={rollout}",
        ]
        threads = max(1, threads - rollout)
    if task is None:  # the quickstart task
        base, data = (
            ROOT / "examples" / "grpo_addition.yaml",
            [
                f"model.path={run / 'sft-model'}",
                f"data.train_files=[{run / 'data' / 'addition_train.parquet'}]",
                f"data.val_files=[{run / 'data' / 'addition_val.parquet'}]",
            ],
        )
    else:
        base, data = task
    cfg = load_config(
        base,
        [
            *data,
            "trainer.val_before_train=true",
            f"trainer.run_dir={out}",
            f"trainer.total_steps={steps}",
            f"trainer.test_freq={freq}",
            f"trainer.num_threads={threads}",
            f"trainer.seed={seed}",
            "trainer.loggers=[jsonl]",
            "trainer.resume_mode=disable",
            *extra,
            *overrides,
        ],
    )
    t0 = time.perf_counter()
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r["val/acc/mean"] for r in rows if r.get("val/acc/mean") is not None}
    calls = [r["agent/num_tool_calls"] for r in rows if "agent/num_tool_calls" in r]
    stale = sum(r.get("replay/evicted/stale", 0.0) for r in rows)
    return {
        "acc": acc,
        "wall_s": time.perf_counter() - t0,
        # what the mode trained: tool calls per trained trajectory (mean over steps) and the
        # groups dropped as too stale (whole run)
        "calls_per_traj": sum(calls) / len(calls) if calls else None,
        "stale_dropped": stale,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workload",
        choices=["quickstart", "tail"],
        default="quickstart",
        help="the quickstart task, or the latency workload of benchmarks/async_modes.py",
    )
    p.add_argument(
        "--tail-latency",
        default="200,1,50,2000",
        metavar="MEDIAN_MS,SIGMA,LO_MS,HI_MS",
        help="tail: the calculator's log-normal latency, as async_modes.py takes it",
    )
    p.add_argument(
        "--tools-model", default="", help="tail: the starting model (default: SFT-warm one)"
    )
    p.add_argument("--run-dir", default="runs/quickstart", help="quickstart model and data")
    p.add_argument("--work-dir", default="runs/async_learning")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--test-freq", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON results (default WORK_DIR/results.json)")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "one_step_off", "fully_async"],
        help="sync first; also an arm of async_modes.py (e.g. one_step_off_completion)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every mode's run (repeatable), e.g. trainer.lend_cores=false",
    )
    a = p.parse_args(argv)
    if a.modes[0] != "sync":
        p.error("--modes must start with sync (the baseline)")
    run, work = Path(a.run_dir), Path(a.work_dir)
    task = None
    if a.workload == "tail":
        task = _tail_task(work, a.threads, a.tail_latency, a.tools_model)
    else:
        _ensure_quickstart(run, a.threads)
    results: dict[str, dict[int, dict]] = {m: {} for m in a.modes}
    for seed in a.seeds:
        for mode in results:
            sys.stderr.write(f"==> {mode}, seed {seed}\n")
            res = _train(
                run,
                work / f"{mode}-s{seed}",
                mode,
                seed,
                a.steps,
                a.test_freq,
                a.threads,
                tuple(a.set),
                task,
            )
            results[mode][seed] = res
    steps = sorted(next(iter(results["sync"].values()))["acc"])
    what = "quickstart task" if task is None else "tail (tool latency) task"
    print(f"held-out accuracy (sampled), {what}, {a.steps} steps, seeds {a.seeds}")
    others = a.modes[1:]
    print(
        f"{'step':>6} "
        + " ".join(f"{m + ' s' + str(s):>16}" for m in results for s in a.seeds)
        + "".join(f" {m + ' mean':>17}" for m in results)
        + "".join(f" {'diff ' + m:>17}" for m in others)
    )
    summary = []
    for st in steps:
        means = {m: sum(results[m][s]["acc"][st] for s in a.seeds) / len(a.seeds) for m in results}
        row = {"step": st, **means}
        row.update({f"diff_{m}": means[m] - means["sync"] for m in others})
        summary.append(row)
        cells = " ".join(f"{results[m][s]['acc'][st]:>16.3f}" for m in results for s in a.seeds)
        print(
            f"{st:>6} {cells}"
            + "".join(f" {means[m]:>17.3f}" for m in results)
            + "".join(f" {means[m] - means['sync']:>+17.3f}" for m in others)
        )
    if task is not None:
        for m in results:
            runs = results[m].values()
            calls = [r["calls_per_traj"] for r in runs if r["calls_per_traj"] is not None]
            print(
                f"{m}: tool calls per trained trajectory "
                f"{sum(calls) / max(len(calls), 1):.3f} (mean of seeds), groups dropped as stale "
                f"{sum(r['stale_dropped'] for r in runs):.0f} (all seeds)"
            )
    walls = {m: sum(r["wall_s"] for r in results[m].values()) for m in results}
    print(
        "wall time (s, all seeds, incl. validation): "
        + ", ".join(f"{m} {w:.0f}" for m, w in walls.items())
    )
    out = Path(a.out) if a.out else work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "runs": results, "summary": summary}, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
