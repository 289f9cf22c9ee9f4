"""``make quickstart``: watch a tiny model learn addition with GRPO on a laptop CPU.

Stages (each cached in ``--run-dir`` so a rerun skips finished ones):
  1. ``make-model``: a 2.4M-parameter Qwen2-style model with a byte tokenizer;
  2. addition data: train / test parquet in verl's schema, plus SFT rows;
  3. SFT warm-up: a short supervised run so the model answers in the right format;
  4. GRPO: ``examples/grpo_addition.yaml`` settings with the embedded CPU defaults, validation
     every few steps — accuracy rises;
  5. prints where ``metrics.jsonl``, the plots and the summary are.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger("postrl.quickstart")


def _stage(msg: str) -> None:
    sys.stderr.write(f"\n==> {msg}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run-dir", default="runs/quickstart")
    # 100 steps at lr 1e-3 stop the warm-up where sampled accuracy is ~0.3 on every seed; at
    # lr 3e-3 the loss plateau's escape point moved with float rounding (0.07-0.24 over seeds,
    # 0.69 on an AVX-512 box), see README "What make quickstart shows"
    p.add_argument("--sft-steps", type=int, default=100, help="SFT warm-up optimizer steps")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="SFT warm-up learning rate")
    # a seed whose loss leaves the plateau late (seed 5 on an AVX-512 Xeon: 0.69 at step 100,
    # sampled accuracy 0.10) trains on until it ends where the others do
    p.add_argument(
        "--sft-target-loss",
        type=float,
        default=0.45,
        help="after --sft-steps, train on (at most 200 steps) until the loss is at or below this",
    )
    p.add_argument("--grpo-steps", type=int, default=150, help="GRPO steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seed of the SFT warm-up and of GRPO")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for the GRPO run")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    import torch

    # before the warm-up's first op, so every OpenMP thread of the process inherits it (the
    # GRPO stage's trainer.flush_denormal, on by default, sets only the thread it runs on)
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    from postrl.data import generate_addition, sft_rows_from_rl_rows, write_parquet
    from postrl.testing import make_model

    run = Path(args.run_dir)
    t0 = time.perf_counter()
    base = run / "tiny-model"
    if not (base / "model.safetensors").exists():
        _stage("1/4 creating a tiny model (2.4M params, byte-level tokenizer)")
        make_model(base, preset="tiny", arch="qwen2", seed=0)
    data = run / "data"
    # single-digit sums: small enough that a 2.4M-parameter model learns them in minutes on a CPU
    train_rows = generate_addition(4000, seed=0, split="train", max_digits=1)
    write_parquet(train_rows, data / "addition_train.parquet")
    # validation: fresh draws from the training task distribution (seed 1)
    write_parquet(
        generate_addition(200, seed=1, split="train", max_digits=1), data / "addition_val.parquet"
    )
    write_parquet(sft_rows_from_rl_rows(train_rows), data / "addition_sft.parquet")
    _stage("2/4 addition data written to " + str(data))

    sft_dir = run / "sft-model"
    if not (sft_dir / "model.safetensors").exists():
        _stage(f"3/4 SFT warm-up ({args.sft_steps} steps) so the model answers with a number")
        from postrl.supervised.sft import run_sft

        m = run_sft(
            str(base),
            str(data / "addition_sft.parquet"),
            str(sft_dir),
            max_steps=args.sft_steps,
            epochs=50,
            lr=args.sft_lr,
            batch_tokens=1024,
            warmup_steps=5,
            target_loss=args.sft_target_loss,
            num_threads=args.threads,
            seed=args.seed,
        )
        logger.info(
            "SFT loss %.3f -> %.3f in %d steps (%d past --sft-steps for the target loss), %.0fs",
            m["sft/first_loss"],
            m["sft/final_loss"],
            m["sft/steps"],
            m["sft/extra_steps"],
            m["sft/wall_s"],
        )

    _stage(
        f"4/4 GRPO on CPU for {args.grpo_steps} steps (16 prompts x 8 samples per step); "
        "validation accuracy every 15 steps"
    )
    from postrl.config import load_config
    from postrl.trainer.trainer import RLTrainer

    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition.yaml"
    overrides = [
        f"model.path={sft_dir}",
        f"data.train_files=[{data / 'addition_train.parquet'}]",
        f"data.val_files=[{data / 'addition_val.parquet'}]",
        f"trainer.run_dir={run / 'grpo'}",
        f"trainer.total_steps={args.grpo_steps}",
        f"trainer.num_threads={args.threads}",
        f"trainer.seed={args.seed}",
        *args.overrides,
    ]
    cfg = load_config(example if example.exists() else None, overrides)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(ln) for ln in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    accs = [(r["step"], r["val/acc/mean"]) for r in rows if r.get("val/acc/mean") is not None]
    _stage("done in %.0fs" % (time.perf_counter() - t0))
    sys.stdout.write(
        "validation accuracy by step: " + ", ".join(f"{s}:{a:.2f}" for s, a in accs) + "\n"
    )
    sys.stdout.write(
        f"metrics: {run / 'grpo' / 'metrics.jsonl'}\nplots:   {run / 'grpo' / 'plots'}\n"
        f"summary: {run / 'grpo' / 'summary.txt'}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
