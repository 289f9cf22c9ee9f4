"""The W1 step, postrl against TRL's ``GRPOTrainer``, side by side on one machine (issue 37 item 1).

Both sides train W1's starting model (``shared/w1/tiny-qwen2-sft``, found as
``benchmarks/async_modes.py`` finds it; ``--w1-model`` for another) on the same 3-digit addition
prompts (the task that model was warmed on) with W1's shape: 16 prompts × 8 samples, up to 16 new
tokens at temperature 1, GRPO advantages, one optimizer step per batch, no KL, fp32,
``--threads`` torch threads. Each side runs in a process of its own (TRL in an environment that
has it, ``--trl-python``; it is not a dependency of postrl) for ``--steps`` steps, and the
processes alternate: round 1 runs postrl then TRL, round 2 TRL then postrl, and so on, so
minute-scale drift of a shared machine hits both. A side's time for a round is the median of
its steps 3..N (the first two warm up); the ratio is TRL / postrl per round, and the report
gives the median over rounds.

The postrl side also writes down where its step goes (``timing_s/*``: generation, reward, old
log-probs, advantages, update, weight sync, and the rest — Python between the stages), and how
fast its update computes: the update's GEMM work (``6 · N · Σ in·out`` over the model's linear
layers, N the packed tokens with each prompt stored once) over ``timing_s/update_actor``, against
the fp32 GEMM rate this machine reaches on the update's own shapes (``torch.matmul`` of each
linear layer's forward, input-gradient and weight-gradient products at N tokens, timed in the same
process before the run). Attention, norms, the loss and the optimizer are not counted as work, so
the fraction is a lower bound.

Usage (the TRL venv as in ``benchmarks/trl_addition.py``)::

    python -m venv /tmp/trlenv && /tmp/trlenv/bin/pip install torch==2.13.0 trl pandas pyarrow
    .venv/bin/python benchmarks/trl_step.py --trl-python /tmp/trlenv/bin/python --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync_weights")


def _measured(times: list[float]) -> float:
    """Median of steps 3..N (steps 1 and 2 warm up)."""
    if len(times) < 3:
        raise ValueError(f"need at least 3 steps to skip two warm-up steps, got {len(times)}")
    return statistics.median(times[2:])


def gemm_peak(model, n_tokens: int, repeats: int = 5) -> dict[str, float]:
    """fp32 GFLOP/s of ``torch.matmul`` on the update's shapes at ``n_tokens`` packed tokens.

    For each ``nn.Linear`` (in → out) of ``model``: the forward ``[N,in]·[in,out]``, the input
    gradient ``[N,out]·[out,in]`` and the weight gradient ``[out,N]·[N,in]``; the best of
    ``repeats`` timings of the whole set. Returns ``{"gflops": ..., "flop_per_token": ...}``, the
    second being ``6 · Σ in·out`` (the update's GEMM work per packed token).
    """
    import torch

    shapes = [
        (m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    ops = []
    for i, o in shapes:
        x, w, dy = torch.randn(n_tokens, i), torch.randn(i, o), torch.randn(n_tokens, o)
        ops += [(x, w), (dy, w.t().contiguous()), (dy.t().contiguous(), x)]
    flop = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in ops)
    for a, b in ops:  # warm the BLAS
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for a, b in ops:
            torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return {"gflops": flop / best / 1e9, "flop_per_token": 6.0 * sum(i * o for i, o in shapes)}


def side_postrl(a: argparse.Namespace) -> dict:
    """postrl's ``RLTrainer.step`` on W1 for ``a.steps`` steps; per-step timings and GEMM rates."""
    import torch
    from transformers import AutoModelForCausalLM

    from postrl.bench.step import W1, w1_overrides
    from postrl.config import load_config
    from postrl.trainer.trainer import RLTrainer

    torch.set_num_threads(a.threads)
    w = W1(threads=a.threads, lr=a.lr)
    run = Path(a.work_dir) / f"postrl-run-{a.round}"
    trainer = RLTrainer(load_config(None, w1_overrides(a.model, a.train, run, w)))
    rows = []
    try:
        trainer.sync_weights()
        for step in range(1, a.steps + 1):
            rows.append(trainer.step(step))
    finally:
        trainer.close()
    # packed tokens of the update: each prompt once, every completion
    n_tok = statistics.median(
        r["perf/completion_tokens"]
        + (r["perf/total_num_tokens"] - r["perf/completion_tokens"]) / w.n
        for r in rows[2:]
    )
    peak = gemm_peak(AutoModelForCausalLM.from_pretrained(a.model), int(n_tok))
    upd = _measured([r["timing_s/update_actor"] for r in rows])
    update_gflops = peak["flop_per_token"] * n_tok / upd / 1e9
    stages = {s: _measured([r.get(f"timing_s/{s}", 0.0) for r in rows]) for s in _STAGES}
    step = _measured([r["timing_s/step"] for r in rows])
    stages["other"] = max(step - sum(stages.values()), 0.0)
    return {
        "side": "postrl",
        "step_s": [r["timing_s/step"] for r in rows],
        "step": step,
        "stages": stages,
        "timings": {  # every timing_s/* the step logs (sub-stages too), median of steps 3..N
            k: _measured([r.get(k, 0.0) for r in rows])
            for k in sorted({k for r in rows for k in r if k.startswith("timing_s/")})
        },
        "packed_tokens": n_tok,
        "update_gflops": update_gflops,
        "peak_gflops": peak["gflops"],
        "update_fraction_of_peak": update_gflops / peak["gflops"],
        "score": _measured([r["critic/score/mean"] for r in rows]),
    }


def side_trl(a: argparse.Namespace) -> dict:
    """TRL's ``GRPOTrainer`` on W1 for ``a.steps`` steps; per-step wall times (generation,
    reward, loss, backward and optimizer: TRL's whole training step)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_addition import _reward_rule, _rows, addition_reward, grpo_config

    torch.set_num_threads(a.threads)
    score = _reward_rule()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    times: list[float] = []
    t0 = [0.0]

    class Clock(TrainerCallback):
        """Wall time of each training step."""

        def on_step_begin(self, args, st, control, **kw):
            t0[0] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            times.append(time.perf_counter() - t0[0])

    cfg = grpo_config(
        str(Path(a.work_dir) / f"trl-out-{a.round}"),
        seed=0,
        lr=a.lr,
        batch=16 * 8,
        n=8,
        response_length=16,
        max_steps=a.steps,
    )
    GRPOTrainer(
        model=model,
        reward_funcs=addition_reward(score),
        args=cfg,
        train_dataset=Dataset.from_list(_rows(a.train)),
        processing_class=tok,
        callbacks=[Clock()],
    ).train()
    return {"side": "trl", "step_s": times, "step": _measured(times)}


def _run_side(python: str, side: str, a: argparse.Namespace, rnd: int) -> dict:
    out = Path(a.work_dir) / f"{side}-{rnd}.json"
    args = {
        "side": side, "model": a.model, "train": a.train, "work-dir": a.work_dir,
        "steps": a.steps, "threads": a.threads, "lr": a.lr, "round": rnd, "json": out,
    }  # fmt: skip
    cmd = [python, str(Path(__file__).resolve())]
    for k, v in args.items():
        cmd += [f"--{k}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, timeout=a.timeout_s, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def report(rounds: list[dict]) -> str:
    """The side-by-side table of ``rounds`` (each ``{"postrl": ..., "trl": ...}``)."""
    lines = ["round  postrl s/step  trl s/step  trl/postrl  update GFLOP/s  peak GFLOP/s  fraction"]
    for i, r in enumerate(rounds, 1):
        p, t = r["postrl"], r["trl"]
        lines.append(
            f"{i:5d}  {p['step']:13.3f}  {t['step']:10.3f}  {t['step'] / p['step']:9.2f}x"
            f"  {p['update_gflops']:14.1f}  {p['peak_gflops']:12.1f}"
            f"  {p['update_fraction_of_peak']:8.2f}"
        )
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    lines.append(
        f"median  postrl {med(lambda r: r['postrl']['step']):.3f} s, trl "
        f"{med(lambda r: r['trl']['step']):.3f} s, trl/postrl "
        f"{med(lambda r: r['trl']['step'] / r['postrl']['step']):.2f}x, update at "
        f"{med(lambda r: r['postrl']['update_fraction_of_peak']):.0%} of the measured GEMM rate"
    )
    st = {s: med(lambda r, s=s: r["postrl"]["stages"][s]) for s in rounds[0]["postrl"]["stages"]}
    total = med(lambda r: r["postrl"]["step"])
    lines.append(
        "postrl step, median s (share): "
        + ", ".join(f"{s} {v:.3f} ({v / total:.0%})" for s, v in st.items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Driver (default): prepare W1, alternate the two sides for ``--rounds``, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", help="python of an environment with trl (driver)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5, help="both sides (W1's learning rate)")
    p.add_argument("--work-dir", default="runs/bench_trl_step")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="deadline of one side's run")
    p.add_argument("--json", help="write the rounds (driver) or one side's result here")
    p.add_argument("--w1-model", default="", help="W1 starting model (default: shared/w1/...)")
    p.add_argument("--side", choices=["postrl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--train", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        res = (side_postrl if a.side == "postrl" else side_trl)(a)
        Path(a.json).write_text(json.dumps(res))
        return 0
    if not a.trl_python:
        p.error("--trl-python is required: the python of an environment with trl installed")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from async_modes import prepare_w1  # W1's model (shared/w1/tiny-qwen2-sft) and prompts

    Path(a.work_dir).mkdir(parents=True, exist_ok=True)
    a.model, a.train = prepare_w1(Path(a.work_dir), a.w1_model, a.threads)  # 3-digit prompts
    rounds = []
    for rnd in range(1, a.rounds + 1):
        order = [("postrl", sys.executable), ("trl", a.trl_python)]
        if rnd % 2 == 0:
            order.reverse()
        rounds.append({side: _run_side(py, side, a, rnd) for side, py in order})
        r = rounds[-1]
        print(
            f"round {rnd}: postrl {r['postrl']['step']:.3f} s, trl {r['trl']['step']:.3f} s",
            flush=True,
        )
    print(report(rounds))
    if a.json:
        Path(a.json).write_text(json.dumps(rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
