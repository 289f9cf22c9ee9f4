#!/usr/bin/env bash
# The CUDA check of postrl on a lent GPU machine (issue 20): one script, at most 8 minutes (its
# parts time out at 270 + 120 + 90 s). Not yet run on a GPU: no session has been lent one.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere; needs no network
#
# 1. makes postrl importable without installing anything (PYTHONPATH = this checkout; the image
#    already holds torch, transformers, tokenizers, safetensors, pyarrow, pyyaml, numpy, tqdm,
#    matplotlib, pytest, pytest-timeout; vLLM and SGLang are not there and stay unrun);
# 2. runs `pytest -m gpu tests/gpu`: FSDP2 bf16 update vs CPU fp32 (cosine > 0.99), native engine
#    on CUDA greedy == transformers on CUDA, the hf backend on CUDA, weight sync into a CUDA
#    engine == a reload, a 20-step GRPO run on the `small` preset with actor + rollout on CUDA;
# 3. prints the W1-shaped step time on the `small` preset (16 prompts x 8 samples, 16 new
#    tokens, one update; actor and native rollout on CUDA): median of 5 steps after 1 warm-up,
#    with the stage breakdown;
# 4. prints rollout tokens/s, native engine on CUDA vs transformers `generate` on CUDA (W1
#    shape: 128 sequences = 16 prompts x 8, 16 and 128 new tokens, sampling at temperature 1).
#
# Environment: PY (python, default python3), WORK (scratch dir, default /tmp/postrl_gpu_check),
# GPU_CHECK_DEVICE=cpu (dry run of every part on the CPU, shrunk; the GPU tests then run their
# bodies on CPU with 2 GRPO steps), GPU_CHECK_PARTS (default 123: which of parts 1-3 to run, e.g.
# 23 for a rerun of the measurements). Exit status: 0 all green, 1 some part failed, 2 no CUDA.
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT="$PWD"
PY="${PY:-python3}"
WORK="${WORK:-/tmp/postrl_gpu_check}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
PARTS="${GPU_CHECK_PARTS:-123}"
mkdir -p "$WORK"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TQDM_DISABLE=1
T0=$(date +%s)
FAILED=()

section() { echo; echo "== $1   (t=$(( $(date +%s) - T0 ))s)"; }

section "0. environment"
"$PY" - "$DEVICE" <<'EOF' || exit 2
import platform, sys
import torch, transformers
import postrl
dev = sys.argv[1]
print(f"python {platform.python_version()}  torch {torch.__version__}  transformers "
      f"{transformers.__version__}  postrl {postrl.__version__} ({postrl.__file__})")
if dev == "cuda":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch: this check needs a GPU (GPU_CHECK_DEVICE=cpu for a dry run)")
    p = torch.cuda.get_device_properties(0)
    print(f"cuda {torch.version.cuda}  device {p.name}  {p.total_memory / 2**30:.0f} GiB  "
          f"sm {p.major}.{p.minor}  bf16 {torch.cuda.is_bf16_supported()}")
else:
    print("dry run on the CPU (GPU_CHECK_DEVICE=cpu)")
EOF

if [[ $PARTS == *1* ]]; then
section "1. pytest -m gpu tests/gpu"
if [ "$DEVICE" = cpu ]; then export POSTRL_GPU_TEST_DEVICE=cpu POSTRL_GPU_TEST_STEPS=2; fi
timeout 270 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts=-ra \
  --timeout=250 -s 2>&1 | tee "$WORK/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED+=("pytest -m gpu")
fi

section "2. W1-shaped step, small preset, actor + rollout on $DEVICE"
# Python parts are real files with a __main__ guard: the reward workers start with `spawn`, which
# re-imports the main module (stdin cannot be).
cat > "$WORK/w1_step.py" <<'EOF'
"""W1-shaped RL step on the small preset: median step time and its stages."""
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

DIGITS = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)


def main(dev: str, work: Path) -> None:
    from postrl.bench.step import W1, w1_overrides
    from postrl.config import load_config
    from postrl.data import generate_addition, write_parquet
    from postrl.testing import make_model
    from postrl.trainer import RLTrainer

    w = W1() if dev == "cuda" else replace(W1(), num_prompts=4, n=4, new_tokens=8)
    steps = 5 if dev == "cuda" else 1
    model = make_model(work / "small", preset="small", seed=0)
    train = write_parquet(generate_addition(512, seed=0), work / "addition_train.parquet")
    reward = work / "digits.py"  # dense rewards: the random small model gets real gradients
    reward.write_text(DIGITS)
    run = work / "w1_run"
    ov = w1_overrides(model, train, run, w) + [
        f"trainer.device={dev}",
        f"trainer.total_steps={steps + 1}",
        f"reward.custom_function.path={reward}",
    ]
    trainer = RLTrainer(load_config(None, ov))
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows if k in r)

    print(
        f"W1 on the small preset ({w.num_prompts} prompts x {w.n}, {w.new_tokens} new tokens, "
        f"one update, {dev}): median of {len(rows)} steps after 1 warm-up"
    )
    print(f"  step          {med('timing_s/step'):8.3f} s")
    for k in ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync_weights"):
        if f"timing_s/{k}" in rows[0]:
            print(f"  {k:<13} {med(f'timing_s/{k}'):8.3f} s")
    for k in ("perf/throughput", "response_length/mean", "actor/grad_norm"):
        if k in rows[0]:
            print(f"  {k:<22}{med(k):10.3f}")
    bad = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and v != v})
    assert not bad, f"non-finite metrics: {bad}"


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
EOF
if [[ $PARTS == *2* ]]; then
  timeout 120 "$PY" "$WORK/w1_step.py" "$DEVICE" "$WORK" || FAILED+=("W1 step")
fi

section "3. rollout tokens/s: native engine vs transformers generate, both on $DEVICE"
cat > "$WORK/rollout_tok_s.py" <<'EOF'
"""Rollout tokens/s, native engine vs transformers generate, same device, W1 shape."""
import asyncio
import sys
import time
from pathlib import Path


def main(dev: str, work: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from postrl.rollout import SamplingParams, create_rollout_backend
    from postrl.testing import make_model

    model_dir = work / "small"
    if not (model_dir / "config.json").exists():  # part 2 writes it; make it if that failed
        make_model(model_dir, preset="small", seed=0)
    groups, n = (16, 8) if dev == "cuda" else (4, 4)
    lengths = (16, 128) if dev == "cuda" else (8,)
    g = torch.Generator().manual_seed(0)
    base = [
        torch.randint(0, 256, (int(torch.randint(24, 41, (1,), generator=g)),), generator=g)
        .tolist()
        for _ in range(groups)
    ]
    prompts = [p for p in base for _ in range(n)]  # W1: n samples of each prompt
    native = create_rollout_backend(
        "native", model_dir, device=dev, max_num_seqs=len(prompts),
        max_model_len=64 + max(lengths),
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    pad = hf.generation_config.pad_token_id or 0
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    def run_native(k: int) -> int:
        async def go():
            return await asyncio.gather(*[
                native.generate(
                    p, SamplingParams(temperature=1.0, max_new_tokens=k, ignore_eos=True, seed=i),
                    f"r{i}",
                )
                for i, p in enumerate(prompts)
            ])

        return sum(len(o.token_ids) for o in asyncio.run(go()))

    def run_hf(k: int) -> int:
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=k, min_new_tokens=k, pad_token_id=pad,
            )
        return (out.shape[1] - L) * out.shape[0]

    print(
        f"{'new_tok':>8}{'native tok/s':>14}{'hf tok/s':>12}{'ratio':>8}   ({len(prompts)} "
        f"sequences = {groups} prompts x {n}, small preset, {dev}, fp32, best of 3)"
    )
    for k in lengths:
        best = [0.0, 0.0]
        for fn in (run_native, run_hf):
            fn(2)  # warm-up
        for _ in range(3):  # interleaved rounds: both sides see the same machine
            for j, fn in enumerate((run_native, run_hf)):
                sync()
                t = time.perf_counter()
                ntok = fn(k)
                sync()
                best[j] = max(best[j], ntok / (time.perf_counter() - t))
        print(f"{k:>8}{best[0]:>14.0f}{best[1]:>12.0f}{best[0] / best[1]:>7.2f}x")
    native.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
EOF
if [[ $PARTS == *3* ]]; then
  timeout 90 "$PY" "$WORK/rollout_tok_s.py" "$DEVICE" "$WORK" || FAILED+=("rollout tokens/s")
fi

section "done"
echo "total $(( $(date +%s) - T0 )) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "FAILED: ${FAILED[*]}"; exit 1; fi
echo "all parts passed"
