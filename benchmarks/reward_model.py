"""Reward-model scoring of a GRPO-shaped batch, three ways, measured side by side (interleaved).

    python benchmarks/reward_model.py [--rm DIR] [--prompts 16] [--n 8] [--threads 2] [--repeats 5]

1. ``hf``: the plain way — HF ``*ForSequenceClassification`` forward over the right-padded
   batch in micro-batches of 64 (what a reward-model worker without postrl's packing does);
2. ``packed``: postrl's padding-free forward, every conversation on its own;
3. ``shared``: padding-free with each prompt computed once for its ``n`` samples (what
   ``RewardModelWorker`` runs).

Prints ms per batch and the ratios; the three scores are checked equal (float tolerance) first.
Without ``--rm`` a tiny random reward model is created in a temp dir.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

import torch


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rm", default=None, help="reward model dir (default: a tiny random one)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForSequenceClassification

    from postrl.engine.reward_model import RewardModel, render_conversations, sequence_scores
    from postrl.testing import make_model

    path = a.rm or make_model(tempfile.mkdtemp(prefix="postrl-rm-"), head="reward")
    rm = RewardModel(path, micro_batch_size=64)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    hf.config.pad_token_id = rm.tokenizer.pad_token_id
    rng = random.Random(0)
    msgs, resps = [], []
    for _ in range(a.prompts):
        x, y = rng.randrange(100), rng.randrange(100)
        for _k in range(a.n):
            msgs.append(
                [{"role": "user", "content": f"What is {x}+{y}? Answer with the number only."}]
            )
            resps.append(str(x + y + rng.randint(-3, 3)) * rng.randint(1, 3))
    ids, _ = rm.encode(render_conversations(rm.tokenizer, msgs, resps))
    prompts, rest, _ = rm.split_encode(msgs, resps)

    @torch.inference_mode()
    def run_hf() -> torch.Tensor:
        return torch.cat(
            [
                sequence_scores(hf, ids[s : s + 64], rm.tokenizer.pad_token_id, "cpu")
                for s in range(0, len(ids), 64)
            ]
        )

    runs = {
        "hf": run_hf,
        "packed": lambda: rm.score_ids(ids),
        "shared": lambda: rm.score_split(prompts, rest),
    }
    ref = run_hf()
    for name, fn in runs.items():
        torch.testing.assert_close(
            fn(), ref, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(a.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    ntok = sum(len(x) for x in ids)
    shared_tok = sum(len(r) + 1 for r in rest) + sum(
        len(prompts[i]) for i in range(0, len(prompts), a.n)
    )
    sys.stdout.write(
        f"reward-model scoring: {a.prompts} prompts x {a.n} samples, {ntok} tokens "
        f"({shared_tok} with shared prompts), threads={a.threads}, best of {a.repeats}\n"
    )
    for name, t in best.items():
        sys.stdout.write(f"  {name:<7} {t * 1e3:8.1f} ms   {best['hf'] / t:5.2f}x vs hf\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
