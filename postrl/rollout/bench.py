"""``postrl bench rollout --model DIR``: native engine vs ``transformers.generate``, same run.

Scenarios (each at every ``--new-tokens`` value, sampling at temperature 1.0, no top-k/top-p,
EOS ignored so both engines produce exactly ``batch × new_tokens`` tokens):

- ``w1``: the reference workload's shape — ``batch / n`` distinct prompts × ``n`` samples
  (GRPO groups; the native engine prefills each prompt once and shares its KV);
- ``distinct``: ``batch`` distinct prompts.

Prompts are random byte-token ids of 24–40 tokens (seeded). Tokens/s counts generated tokens
only; each measurement is the best of ``--repeats`` after one warm-up. On a shared machine the
numbers are noisy: compare the ratio, which is measured back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import torch

__all__ = ["main", "run_bench"]


def _prompts(kind: str, batch: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    distinct = batch // n if kind == "w1" else batch
    base = [torch.randint(0, min(vocab, 256), (int(torch.randint(24, 41, (1,), generator=g)),), generator=g).tolist()
            for _ in range(distinct)]
    return [p for p in base for _ in range(batch // distinct)]


def _time_native(backend: Any, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    from postrl.rollout.types import SamplingParams

    async def once(n: int) -> int:
        outs = await asyncio.gather(*[
            backend.generate(p, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i), f"b{i}")
            for i, p in enumerate(prompts)])
        return sum(len(o.token_ids) for o in outs)

    asyncio.run(once(2))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ntok = asyncio.run(once(new_tokens))
        best = min(best, time.perf_counter() - t0)
    return ntok / best


def _time_hf(model: Any, prompts: list[list[int]], new_tokens: int, repeats: int, pad_id: int) -> float:
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1

    def once(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)

    once(2)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        once(new_tokens)
        best = min(best, time.perf_counter() - t0)
    return len(prompts) * new_tokens / best


def decode_path(backend: Any) -> str:
    """Which decode implementation a native backend runs: ``c-step`` (one C call per step),
    ``c-ops`` (per-op C kernels from Python) or ``torch``."""
    if backend.kernels is None:
        return "torch"
    return "c-step" if backend._decode_step() is not None else "c-ops"


def run_bench(model_dir: str, batch: int = 128, group: int = 8, new_tokens: tuple[int, ...] = (16, 128),
              scenarios: tuple[str, ...] = ("w1", "distinct"), repeats: int = 1, seed: int = 0,
              kernels: str = "auto", compare_torch: bool = False) -> list[dict]:
    """Measure and return rows ``{scenario, new_tokens, native_tok_s, hf_tok_s, ratio, path}``
    (+ ``torch_path_tok_s`` with ``compare_torch``: the native engine on torch ops, same run)."""
    from transformers import AutoModelForCausalLM

    from postrl.rollout.native.engine import NativeBackend

    native = NativeBackend(model_dir, max_num_seqs=batch, max_model_len=64 + max(new_tokens), kernels=kernels)
    plain = (NativeBackend(model_dir, max_num_seqs=batch, max_model_len=64 + max(new_tokens), kernels="torch")
             if compare_torch else None)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    rows = []
    for kind in scenarios:
        prompts = _prompts(kind, batch, group, native.cfg.vocab_size, seed)
        for n in new_tokens:
            a = _time_native(native, prompts, n, repeats)
            b = _time_hf(hf, prompts, n, repeats, pad)
            row = dict(scenario=kind, new_tokens=n, native_tok_s=a, hf_tok_s=b, ratio=a / b, path=decode_path(native))
            if plain is not None:
                row["torch_path_tok_s"] = _time_native(plain, prompts, n, repeats)
            rows.append(row)
    native.close()
    if plain is not None:
        plain.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``postrl bench rollout --model DIR [--batch 128] [--new-tokens 16,128]``."""
    p = argparse.ArgumentParser(prog="postrl bench rollout", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (e.g. from `postrl make-model`)")
    p.add_argument("--batch", type=int, default=128, help="sequences per measurement")
    p.add_argument("--group", type=int, default=8, help="samples per prompt in the w1 scenario")
    p.add_argument("--new-tokens", default="16,128", help="comma-separated completion lengths")
    p.add_argument("--scenarios", default="w1,distinct", help="comma-separated: w1, distinct")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats (best is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--kernels", default="auto", choices=["auto", "fused", "torch"],
                   help="native decode implementation (see NativeBackend)")
    p.add_argument("--compare-torch", action="store_true",
                   help="also time the native engine on torch ops (kernels=torch) in the same run")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = run_bench(a.model, a.batch, a.group, tuple(int(x) for x in a.new_tokens.split(",")),
                     tuple(a.scenarios.split(",")), a.repeats, kernels=a.kernels, compare_torch=a.compare_torch)
    out = sys.stdout
    out.write(f"rollout benchmark  model={a.model}  batch={a.batch}  threads={torch.get_num_threads()}  "
              f"decode={rows[0]['path'] if rows else '?'}\n")
    extra = f"{'torch-path tok/s':>18}{'kernels gain':>14}" if a.compare_torch else ""
    out.write(f"{'scenario':<10}{'new_tok':>8}{'native tok/s':>14}{'hf tok/s':>12}{'ratio':>8}{extra}\n")
    for r in rows:
        line = f"{r['scenario']:<10}{r['new_tokens']:>8}{r['native_tok_s']:>14.0f}{r['hf_tok_s']:>12.0f}{r['ratio']:>7.2f}x"
        if "torch_path_tok_s" in r:
            line += f"{r['torch_path_tok_s']:>18.0f}{r['native_tok_s'] / r['torch_path_tok_s']:>13.2f}x"
        out.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
