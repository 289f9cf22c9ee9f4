"""Training throughput of one PPO update vs plain torch forward+backward, measured side by side.

W1-shaped batch: 16 prompts × 8 responses (128 sequences), prompts ~33 tokens (left-padded),
responses up to 16 tokens (right-padded), tiny model, fp32. Plain torch = one HF forward+backward
over the padded (128, P+R) tensors with a 2D attention mask and a full-vocab log-softmax — the
minimum any padded trainer does. postrl = ``Actor.update_policy`` (packing, prefix sharing,
policy loss, optimizer step) over the same tensors, with sharing on and off, and with sharing on
but torch's ops instead of the fused training kernels (``model.kernels=torch``).

    python benchmarks/train_step.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def _batch(num_prompts=16, n=8, p=36, r=16, seed=0):
    sys.path.insert(0, "tests/engine")
    from conftest import synth_batch

    b = synth_batch(num_prompts=num_prompts, n=n, p=p, r=r, seed=seed)
    # prompts of 30..36 tokens like W1's chat prompts
    am = b.batch["attention_mask"].clone()
    am[:, :p] = (
        torch.arange(p).unsqueeze(0) >= (p - 30 - (torch.arange(len(b)) // n % 7)).unsqueeze(1)
    ).long()
    b.batch["attention_mask"] = am
    b.batch["input_ids"] = b.batch["input_ids"] * am
    b.batch["position_ids"] = (am.cumsum(1) - 1).clamp(min=0)
    return b


def _interleaved_best(fns: dict, repeats: int) -> dict:
    """Min wall time of each fn, runs interleaved so background load hits all alike."""
    for f in fns.values():
        f()  # warm-up
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    """Print tokens/s of postrl's update and of the plain padded forward+backward, and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from postrl.engine.actor import Actor, PolicyLossSpec
    from postrl.engine.model import ModelSpec, load_policy
    from postrl.engine.optim import OptimSpec
    from postrl.engine.update import BatchSpec
    from postrl.testing import make_model

    d = make_model(tempfile.mkdtemp(prefix="bench_train_"))
    batch = _batch()
    tokens = int(batch.batch["attention_mask"].sum())
    r = batch.batch["responses"].shape[1]

    plain = AutoModelForCausalLM.from_pretrained(
        str(d), attn_implementation="sdpa", dtype=torch.float32
    )
    plain.train()
    ids, am, pos = (
        batch.batch["input_ids"],
        batch.batch["attention_mask"],
        batch.batch["position_ids"],
    )

    def plain_step():
        logits = plain(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, -r - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -r:].unsqueeze(-1)).squeeze(-1)
        (-(lp * batch.batch["response_mask"]).sum() / batch.batch["response_mask"].sum()).backward()
        plain.zero_grad(set_to_none=True)

    fns = {"plain": plain_step}
    for name, share, kernels in (
        ("postrl update (packed)            ", False, "auto"),
        ("postrl update (shared prefix)     ", True, "auto"),
        ("postrl update (shared, torch ops) ", True, "torch"),
    ):
        actor = Actor(
            load_policy(ModelSpec(path=str(d), kernels=kernels)),
            batch=BatchSpec(ppo_mini_batch_size=16),
            loss=PolicyLossSpec(),
            optim=OptimSpec(lr=1e-5),
            rollout_n=8,
            share_prefix=share,
        )
        b = batch.union(actor.compute_log_prob(batch))
        fns[name] = lambda b=b, a=actor: a.update_policy(b)
    best = _interleaved_best(fns, args.repeats)
    t_plain = best.pop("plain")
    results = best
    print(
        f"batch: 128 sequences, {tokens} valid tokens, padded width {ids.shape[1]}, "
        f"threads {args.threads}"
    )
    print(f"plain torch padded fwd+bwd : {t_plain:.3f} s  {tokens / t_plain:9.0f} tok/s")
    for name, t in results.items():
        print(
            f"{name}: {t:.3f} s  {tokens / t:9.0f} tok/s  ratio plain/postrl = {t_plain / t:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
