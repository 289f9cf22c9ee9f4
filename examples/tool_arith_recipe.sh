#!/usr/bin/env bash
# The tool-arith recipe end to end (see examples/grpo_tool_arith.yaml): a tiny model, tool-arith
# data, an SFT warm-up on mixed demonstrations (half call the calculator, half answer directly),
# GRPO with the multi-turn tool loop, and a plot of tool-call rate, reward and validation accuracy
# per step (RUN/grpo/tool_arith_curve.png). Single-threaded, CPU.
#
#   examples/tool_arith_recipe.sh [RUN_DIR] [extra key=value overrides for the GRPO run]
#
# RUN_DIR defaults to runs/tool_arith; finished stages (model, data, SFT) are kept on a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/tool_arith}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=(--min-digits 2 --max-digits 2 --kinds mul --prompt-style bound)
t0=$(date +%s)

[ -f "$RUN/base/model.safetensors" ] || postrl make-model "$RUN/base"
postrl data tool-arith "$RUN/data/train.parquet" --n 512 "${A[@]}"
postrl data tool-arith "$RUN/data/test.parquet" --n 32 --split test "${A[@]}"
postrl data tool-arith "$RUN/data/demos.parquet" --n 6000 --sft --tool-fraction 0.5 "${A[@]}"
if [ ! -f "$RUN/sft-model/model.safetensors" ]; then
  postrl sft model_path="$RUN/base" train_file="$RUN/data/demos.parquet" out_dir="$RUN/sft-model" \
    max_steps=1500 epochs=10 lr=3e-3 batch_tokens=1024 warmup_steps=5 num_threads=1 log_every=100
fi
t_sft=$(date +%s)

rm -f "$RUN/grpo/metrics.jsonl"
postrl train examples/grpo_tool_arith.yaml model.path="$RUN/sft-model" \
  "data.train_files=[$RUN/data/train.parquet]" "data.val_files=[$RUN/data/test.parquet]" \
  trainer.run_dir="$RUN/grpo" trainer.resume_mode=disable "$@"
t_end=$(date +%s)

python - "$RUN/grpo" <<'PY'
"""Plot tool-call rate, reward and validation accuracy per GRPO step; print start -> end."""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from postrl.tracking.plots import read_metrics

run = Path(sys.argv[1])
rows = read_metrics(run)


def series(*keys):
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] == r[key]]
        if pts:
            return key, [p[0] for p in pts], [p[1] for p in pts]
    return keys[0], [], []


curves = [series("agent/num_tool_calls/mean", "agent/num_tool_calls"),
          series("critic/score/mean"), series("val/acc/mean")]
fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
for (key, xs, ys), label in zip(curves, ("tool calls per trajectory (train)", "reward (train)",
                                         "validation accuracy (greedy)")):
    if xs:
        ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, ms=3, label=label)
        print(f"{key}: {ys[0]:.3f} -> {ys[-1]:.3f} (steps {xs[0]:g}..{xs[-1]:g})")
ax.set_xlabel("GRPO step")
ax.set_ylim(-0.02, 1.02)
ax.set_title("tool-arith: tiny model + calculator, GRPO")
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(run / "tool_arith_curve.png")
print(f"plot: {run / 'tool_arith_curve.png'}")
PY
echo "seconds: SFT stage $((t_sft - t0)), GRPO $((t_end - t_sft)), total $((t_end - t0))"
