#!/usr/bin/env bash
# The expression-writing tool-arith recipe end to end: like examples/tool_arith_recipe.sh, but in
# the `short` style the model must WRITE the problem into the call
# ({"name": "calculator", "arguments": {"expression": "47 * 83"}}, the plain calculator of
# examples/tools/calculator.yaml) — copying both operands ~70 tokens back — and answer
# "The answer is N.". A tiny model, tool-arith data (2-digit products), an SFT warm-up on a mix
# of demonstrations — 50% tool-reading rows (tool result -> answer), the rest full conversations
# of which 30% call the calculator and 70% answer directly —, 1,000 SFT steps (500 are not
# enough to learn the operand copy), GRPO with the multi-turn tool loop
# (examples/grpo_tool_arith.yaml with a longer assistant turn and the plain calculator), and a
# plot of tool-call rate, reward and validation accuracy per step
# (RUN/grpo/tool_arith_expr_curve.png). Single-threaded, CPU, ~7 min (measured results:
# docs/tools.md, "Expression-writing variant").
#
#   examples/tool_arith_expr_recipe.sh [RUN_DIR] [extra key=value overrides for the GRPO run]
#
# RUN_DIR defaults to runs/tool_arith_expr; the base model and the SFT model are kept on a rerun
# when they were made by this version of the recipe (a stamp file records the settings).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/tool_arith_expr}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=(--min-digits 2 --max-digits 2 --kinds mul --prompt-style short)
DEMOS=(--n 6000 --sft --copy-fraction 0.5 --tool-fraction 0.3)
SFT=(max_steps=1000 epochs=10 lr=1e-3 batch_tokens=1024 warmup_steps=5 num_threads=1 log_every=100)
STAMP="expr-v1 ${A[*]} ${DEMOS[*]} ${SFT[*]}"
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
# response_length is per assistant turn: the call with the expression is 66 tokens + end of turn;
# the plain calculator requires the expression (an argument-free call is an error)
postrl train examples/grpo_tool_arith.yaml model.path="$RUN/sft-model" \
  "data.train_files=[$RUN/data/train.parquet]" "data.val_files=[$RUN/data/test.parquet]" \
  trainer.run_dir="$RUN/grpo" trainer.resume_mode=disable \
  rollout.response_length=80 rollout.agent.tool_config_path=examples/tools/calculator.yaml "$@"
t_end=$(date +%s)

python examples/plot_tool_arith.py "$RUN/grpo" "tool-arith, expression in the call: tiny model + calculator, GRPO" tool_arith_expr_curve.png
echo "seconds: SFT stage $((t_sft - t0)), GRPO $((t_end - t_sft)), total $((t_end - t0))"
