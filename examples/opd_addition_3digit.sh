#!/usr/bin/env bash
# On-policy distillation on 3-digit addition (issue 36), end to end:
#   1. data: the GRPO recipe's split (20 000 training prompts, 1 000 held-out problems of the
#      disjoint test split), written where examples/grpo_addition_3digit.yaml reads it;
#   2. a teacher that is good at 3-digit sums: the student's own starting model
#      (../shared/w1/tiny-qwen2-sft, so the tokenizer is the student's by construction) trained
#      further on the ground-truth sums of the training prompts for TEACHER_S seconds of training
#      time (benchmarks/sft_curve.py: lr 1e-3, 64 examples per step; 82.6 % held-out after 600 s
#      and 1 387 steps on 2 quiet AVX2 cores, docs/learning.md); its held-out accuracy is printed;
#   3. distillation into the W1 student for BUDGET_S seconds of training time
#      (examples/opd_addition_3digit.yaml: the student samples, the teacher scores every sampled
#      token, GKD's JSD(0.5) against the teacher's top-32 is a loss term), validated on the
#      held-out split at trainer.test_at_s.
#
#   examples/opd_addition_3digit.sh [extra key=value overrides for the distillation run]
#
# Environment: WORK (runs/opd), TEACHER_S (600), BUDGET_S (600), THREADS (2). The teacher is kept
# on a rerun when WORK/teacher exists (delete it to rebuild). ~25 minutes on 2 quiet cores
# (10 + 10 minutes of training, plus the held-out evaluations).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/opd}
TEACHER_S=${TEACHER_S:-600}
BUDGET_S=${BUDGET_S:-600}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
PY=${PYTHON:-python}

# 1. the GRPO recipe's data (same generator and seeds as benchmarks/learning.py)
mkdir -p runs/a3
[ -f runs/a3/train.parquet ] || postrl data addition runs/a3/train.parquet --n 20000 --max-digits 3
[ -f runs/a3/test.parquet ] ||
  postrl data addition runs/a3/test.parquet --n 1000 --max-digits 3 --split test --seed 1

# 2. the teacher: supervised learning on the training prompts' answers, from the student's start
if [ ! -f "$WORK/teacher/model.safetensors" ]; then
  "$PY" benchmarks/sft_curve.py --work-dir "$WORK" --budget-s "$TEACHER_S" --marks "$TEACHER_S" \
    --threads "$THREADS"
  rm -rf "$WORK/teacher"
  cp -r "$WORK/sft/at$(printf '%.0f' "$TEACHER_S")s" "$WORK/teacher"
fi

# 3. on-policy distillation into the W1 student
postrl train examples/opd_addition_3digit.yaml distill.teacher_path="$WORK/teacher" \
  trainer.run_dir="$WORK/distill" trainer.time_budget_s="$BUDGET_S" \
  trainer.num_threads="$THREADS" trainer.resume_mode=disable "$@"
"$PY" - "$WORK/distill/metrics.jsonl" <<'PYEOF'
import json
import sys

for line in open(sys.argv[1]):
    row = json.loads(line)
    if "val/acc/mean" in row:
        t, acc = row.get("perf/train_time_s", 0.0), row["val/acc/mean"]
        print("%7.0f s of training: held-out greedy accuracy %.3f" % (t, acc))
PYEOF
