#!/usr/bin/env bash
# The FrozenLake recipe end to end (see examples/envs/grpo_frozenlake.yaml): a tiny model,
# episode rows (3x3 lakes, 1 hole, one layout per seed), an SFT warm-up on expert transcripts
# that play a random move 30% of the time, GRPO with the env_agent loop, and a plot of the
# training and validation success per step (RUN/grpo/frozenlake_curve.png).
# Single-threaded, CPU (measured results: docs/agent.md, "Environments").
#
#   examples/envs/frozenlake_recipe.sh [RUN_DIR] [extra key=value overrides for the GRPO run]
#
# RUN_DIR defaults to runs/frozenlake; the base and SFT models are kept on a rerun when they were
# made by this version of the recipe (a stamp file records the settings).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${1:-runs/frozenlake}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
K='{"size": 3, "holes": 1}'
DEMOS=(--n 3000 --sft --noise 0.3 --max-turns 4)
SFT=(max_steps=300 epochs=10 lr=1e-3 batch_tokens=1024 warmup_steps=5 num_threads=1 log_every=50)
STAMP="frozenlake-v2 $K ${DEMOS[*]} ${SFT[*]}"
t0=$(date +%s)

[ -f "$RUN/base/model.safetensors" ] || postrl make-model "$RUN/base"
postrl data frozenlake "$RUN/data/train.parquet" --n 512 --env-kwargs "$K"
postrl data frozenlake "$RUN/data/test.parquet" --n 64 --split test --env-kwargs "$K"
postrl data frozenlake "$RUN/data/demos.parquet" "${DEMOS[@]}" --env-kwargs "$K"
if [ "$(cat "$RUN/sft-model/recipe_stamp" 2>/dev/null)" != "$STAMP" ]; then
  postrl sft model_path="$RUN/base" train_file="$RUN/data/demos.parquet" out_dir="$RUN/sft-model" "${SFT[@]}"
  echo "$STAMP" > "$RUN/sft-model/recipe_stamp"
fi
t_sft=$(date +%s)

rm -f "$RUN/grpo/metrics.jsonl"
postrl train examples/envs/grpo_frozenlake.yaml model.path="$RUN/sft-model" \
  "data.train_files=[$RUN/data/train.parquet]" "data.val_files=[$RUN/data/test.parquet]" \
  trainer.run_dir="$RUN/grpo" trainer.resume_mode=disable "$@"
t_end=$(date +%s)

python examples/envs/plot_env.py "$RUN/grpo" "FrozenLake 3x3: tiny model, GRPO (env_agent)" frozenlake_curve.png
echo "seconds: SFT stage $((t_sft - t0)), GRPO $((t_end - t_sft)), total $((t_end - t0))"
