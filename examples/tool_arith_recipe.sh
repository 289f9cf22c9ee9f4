#!/usr/bin/env bash
# The tool-arith recipe end to end (see examples/grpo_tool_arith.yaml): a tiny model, tool-arith
# data (2-digit products), an SFT warm-up on a mix of demonstrations — 50%
# tool-reading rows (tool result -> answer), the rest full conversations of which 30% call the
# calculator and 70% answer directly —, GRPO with the multi-turn tool loop, and a plot of
# tool-call rate, reward and validation accuracy per step (RUN/grpo/tool_arith_curve.png).
# Single-threaded, CPU, ~4-5 min (measured results: docs/tools.md, "Tool-arith recipe").
#
#   examples/tool_arith_recipe.sh [RUN_DIR] [extra key=value overrides for the GRPO run]
#
# RUN_DIR defaults to runs/tool_arith; the base model and the SFT model are kept on a rerun when
# they were made by this version of the recipe (a stamp file records the settings).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/tool_arith}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=(--min-digits 2 --max-digits 2 --kinds mul --prompt-style bound)
DEMOS=(--n 6000 --sft --copy-fraction 0.5 --tool-fraction 0.3)
SFT=(max_steps=500 epochs=10 lr=1e-3 batch_tokens=1024 warmup_steps=5 num_threads=1 log_every=100)
STAMP="tool-tags-v1 ${A[*]} ${DEMOS[*]} ${SFT[*]}"
t0=$(date +%s)

# a base model from before the tool tags became single tokens would not match the data
if [ ! -f "$RUN/base/model.safetensors" ] || ! grep -q '"<tool_response>"' "$RUN/base/tokenizer.json"; then
  postrl make-model "$RUN/base"
fi
postrl data tool-arith "$RUN/data/train.parquet" --n 512 "${A[@]}"
postrl data tool-arith "$RUN/data/test.parquet" --n 32 --split test "${A[@]}"
postrl data tool-arith "$RUN/data/demos.parquet" "${DEMOS[@]}" "${A[@]}"
if [ "$(cat "$RUN/sft-model/recipe_stamp" 2>/dev/null)" != "$STAMP" ]; then
  postrl sft model_path="$RUN/base" train_file="$RUN/data/demos.parquet" out_dir="$RUN/sft-model" "${SFT[@]}"
  echo "$STAMP" > "$RUN/sft-model/recipe_stamp"
fi
t_sft=$(date +%s)

rm -f "$RUN/grpo/metrics.jsonl"
postrl train examples/grpo_tool_arith.yaml model.path="$RUN/sft-model" \
  "data.train_files=[$RUN/data/train.parquet]" "data.val_files=[$RUN/data/test.parquet]" \
  trainer.run_dir="$RUN/grpo" trainer.resume_mode=disable "$@"
t_end=$(date +%s)

python examples/plot_tool_arith.py "$RUN/grpo" "tool-arith: tiny model + calculator, GRPO" tool_arith_curve.png
echo "seconds: SFT stage $((t_sft - t0)), GRPO $((t_end - t_sft)), total $((t_end - t0))"
