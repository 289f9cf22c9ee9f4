"""The native engine's shared-prefix trunk (``share_prefix``), on and off, measured side by side.

A step of the 3-digit recipe's generation, as the engine sees it: chat prompts (``What is
A+B?`` in the model's template — 14 of the ~35 positions are the same in every prompt), ``n``
samples each, admitted in a first wave and then in small refill waves (dynamic sampling tops the
batch up a few groups at a time), with a weight update before every step (so the trunk's K/V
are recomputed each step, as in training). Two engines, one with the trunk and one without,
take the same steps in turn; the script prints the median step time of each, their ratio, and
the prompt positions each prefilled.

    python benchmarks/prefix_share.py [--threads 2] [--steps 12] [--system-prompt-tokens 0]

``--system-prompt-tokens N`` prepends a system message of about N tokens (a tool schema, an
agent's instructions): the share the trunk saves grows with it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "w1" / "tiny-qwen2-sft"


def _prompts(tokenizer, count: int, system_tokens: int, seed: int) -> list[list[int]]:
    """``count`` 3-digit addition prompts in the chat template, token ids."""
    rng = random.Random(seed)
    system = []
    if system_tokens:
        words = "You are a careful calculator. Answer with the number only."
        text = (words + " ") * (system_tokens // len(tokenizer(words)["input_ids"]) + 1)
        system = [{"role": "system", "content": text.strip()}]
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        msgs = [*system, {"role": "user", "content": f"What is {a}+{b}?"}]
        out.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    return tokenizer(out, add_special_tokens=False)["input_ids"]  # as the dataset does


def _step(engine, prompts: list[list[int]], n: int, waves: list[int], tag: str) -> float:
    """Generate ``n`` samples of each prompt, admitted wave by wave; returns wall seconds."""
    from postrl.rollout import SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=16, logprobs=True)

    async def go() -> None:
        at = 0
        for size in waves:
            wave = prompts[at : at + size]
            at += size
            await asyncio.gather(
                *(
                    engine.generate(p, sp, f"{tag}-{at}-{i}-{j}")
                    for i, p in enumerate(wave)
                    for j in range(n)
                )
            )

    t0 = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Print the median step time with and without the trunk, the ratio and the prefill work."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="measured steps per engine")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--first", type=int, default=24, help="prompts in a step's first wave")
    ap.add_argument("--refills", type=int, default=12, help="refill waves per step")
    ap.add_argument("--refill-size", type=int, default=4, help="prompts per refill wave")
    ap.add_argument("--system-prompt-tokens", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from postrl.rollout import create_rollout_backend

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    params = [(k, p.detach().clone()) for k, p in model.named_parameters()]
    per_step = args.first + args.refills * args.refill_size
    waves = [args.first] + [args.refill_size] * args.refills
    sample = _prompts(tok, 64, args.system_prompt_tokens, 0)
    longest = max(len(p) for p in sample)
    engines = {
        share: create_rollout_backend(
            "native",
            args.model,
            max_num_seqs=256,
            max_model_len=longest + 32,
            share_prefix=share,
        )
        for share in (True, False)
    }
    if engines[True].kernels is None:
        print("the fused kernels are off on this machine: the trunk needs them", file=sys.stderr)
        return 1
    times: dict[bool, list[float]] = {True: [], False: []}
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps + 1):  # step 0 warms both engines up
        prompts = _prompts(tok, per_step, args.system_prompt_tokens, seed=step)
        # a new policy each step, the same for both engines: the trunk's K/V go stale
        update = [(k, p + 1e-3 * torch.randn(p.shape, generator=g)) for k, p in params]
        order = (True, False) if step % 2 else (False, True)  # interleaved, alternating first
        for share in order:
            engines[share].update_weights(iter(update))
            t = _step(engines[share], prompts, args.n, waves, f"s{step}")
            if step:
                times[share].append(t)
    plen = statistics.mean(len(p) for p in sample)
    print(
        f"{per_step} prompts × {args.n} a step ({args.first} + {args.refills} × "
        f"{args.refill_size}), prompts ≈ {plen:.0f} tokens, {args.threads} threads, "
        f"{args.steps} steps each, interleaved"
    )
    for share in (False, True):
        e = engines[share]
        print(
            f"  share_prefix={share!s:5}: step median {statistics.median(times[share]):.3f} s "
            f"(min {min(times[share]):.3f}); prompt positions prefilled {e.prefill_tokens}, "
            f"copied from the trunk {e.prefill_tokens_shared}"
        )
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    per = [a / b for a, b in zip(times[False], times[True], strict=True)]
    print(f"  without / with: {ratio:.2f}× (per step pair {min(per):.2f}–{max(per):.2f}×)")
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
