"""``actor.skip_zero_advantage`` off and on, side by side on W1 (two trainers, steps interleaved).

W1 (docs/benchmarks.md) is GRPO without a filter: every group whose 8 rewards are equal has zero
advantages, and with W1's loss (no entropy bonus, no KL term) leaving those rows out of the
update is the same update to float rounding. Two trainers built from the same W1 config, one
with the option, take their steps in turn (the order alternates every step); the script prints
the median update and step time of each over the measured steps, their ratio, and the share of
rows the second left out. The first step's policy loss and gradient norm of the two are printed
too: same batch, same weights, so they agree to rounding.

    python benchmarks/skip_zero_adv.py [--steps 12] [--threads 2] [--work-dir runs/bench_step]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from postrl.bench.step import W1, prepare_w1, w1_overrides
    from postrl.config import load_config
    from postrl.trainer.trainer import RLTrainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="measured steps per side (after 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work-dir", default="runs/bench_step", help="W1's warmed model cache")
    a = p.parse_args(argv)
    w = W1(threads=a.threads)
    torch.set_num_threads(w.threads)
    model_dir, train = prepare_w1(a.work_dir, w)
    trainers = {}
    for skip in (False, True):
        run = Path(a.work_dir) / f"run-skip-{str(skip).lower()}"
        cfg = load_config(
            None,
            [*w1_overrides(model_dir, train, run, w), f"actor.skip_zero_advantage={skip}"],
        )
        trainers[skip] = RLTrainer(cfg)
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for t in trainers.values():
            t.sync_weights()
        for step in range(1, a.steps + 3):  # steps 1-2: warm-up
            for skip in (False, True) if step % 2 else (True, False):
                rows[skip].append(trainers[skip].step(step))
    finally:
        for t in trainers.values():
            t.close()
    first = {s: (r[0]["actor/pg_loss"], r[0]["actor/grad_norm"]) for s, r in rows.items()}
    print(
        f"step 1 (same batch, same weights): pg_loss / grad_norm off {first[False]}, "
        f"on {first[True]}"
    )
    med = {
        s: {
            k: statistics.median(x[k] for x in r[2:])
            for k in ("timing_s/update_actor", "timing_s/step", "timing_s/gen")
        }
        for s, r in rows.items()
    }
    frac = statistics.mean(x["actor/zero_adv_skipped_frac"] for x in rows[True][2:])
    print(f"W1, {a.threads} threads, median of steps 3-{a.steps + 2}, rows skipped {frac:.0%}:")
    for k in ("timing_s/update_actor", "timing_s/gen", "timing_s/step"):
        off, on = med[False][k], med[True][k]
        print(f"  {k:24s} off {off:.4f} s   on {on:.4f} s   off/on {off / on:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
