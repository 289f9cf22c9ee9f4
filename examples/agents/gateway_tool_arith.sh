#!/usr/bin/env bash
# The tool-arith GRPO run with the OpenAI-client agent through the gateway
# (examples/agents/gateway_tool_arith.yaml), on the tool-arith recipe's SFT model and data:
#   examples/agents/gateway_tool_arith.sh [RUN_DIR] [extra key=value overrides]
# RUN_DIR (default runs/tool_arith) must hold the recipe's sft-model/ and data/ (run
# examples/tool_arith_recipe.sh first). The rows are copied with agent_name=gateway.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${1:-runs/tool_arith}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for split in train test; do
  python - "$RUN/data/$split.parquet" "$RUN/data/${split}_gateway.parquet" <<'PY'
import sys

import pyarrow as pa
import pyarrow.parquet as pq

t = pq.read_table(sys.argv[1])
t = t.set_column(t.schema.get_field_index("agent_name"), "agent_name",
                 pa.array(["gateway"] * len(t)))
pq.write_table(t, sys.argv[2])
PY
done
t0=$(date +%s)
rm -f "$RUN/gateway/metrics.jsonl"
postrl train examples/agents/gateway_tool_arith.yaml model.path="$RUN/sft-model" \
  "data.train_files=[$RUN/data/train_gateway.parquet]" \
  "data.val_files=[$RUN/data/test_gateway.parquet]" \
  trainer.run_dir="$RUN/gateway" trainer.resume_mode=disable "$@"
echo "seconds: GRPO through the gateway $(( $(date +%s) - t0 ))"
