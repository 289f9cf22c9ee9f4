"""``postrl bench rollout --model DIR``: native engine vs ``transformers.generate``, same run;
with ``--backend native,hf,vllm`` the named rollout backends side by side instead.

Scenarios (each at every ``--new-tokens`` value, sampling at temperature 1.0, no top-k/top-p,
EOS ignored so both engines produce exactly ``batch × new_tokens`` tokens):

- ``w1``: the reference workload's shape — ``batch / n`` distinct prompts × ``n`` samples
  (GRPO groups; the native engine prefills each prompt once and shares its KV);
- ``distinct``: ``batch`` distinct prompts.

Prompts are random byte-token ids of 24–40 tokens (seeded). Tokens/s counts generated tokens
only; each measurement is the best of ``--repeats`` rounds after one warm-up, and each round times
the engines one after the other, so both sides of a ratio see the same machine conditions. On a
shared machine the absolute numbers drift: compare the ratio.

``--backend A,B,...`` (:func:`run_backends`) times postrl's rollout backends as training drives
them: each through its ``generate`` (every request sent at once, per-request seeds), an
in-process backend in this process, one that declares ``own_process`` (``vllm``) as a replica
process of its own with its venv's python (``spawn_replica``: requests cross 127.0.0.1, as in
training). Rounds are interleaved (each round times every backend once, in turn, after one
warm-up each) and the **median** of ``--repeats`` rounds is reported, with the ratio to the
first backend named.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["main", "run_backends", "run_bench"]


def _prompts(kind: str, batch: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    distinct = batch // n if kind == "w1" else batch
    base = [
        torch.randint(
            0, min(vocab, 256), (int(torch.randint(24, 41, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(distinct)
    ]
    return [p for p in base for _ in range(batch // distinct)]


def _hf_runner(model: Any, prompts: list[list[int]], pad_id: int) -> Callable[[int], int]:
    """``run(n)``: ``transformers.generate`` samples ``n`` tokens for the left-padded batch."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1

    def once(n: int) -> int:
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad_id,
            )
        return len(prompts) * n

    return once


def _time_interleaved(
    runners: list[Callable[[int], int]], new_tokens: int, repeats: int
) -> list[float]:
    """Best tokens/s of each runner over ``repeats`` rounds; each round times every runner once, in
    turn, so all of them are measured under the same machine conditions (on a shared VM the
    throughput of either side drifts by ~10% between minutes; timing one side's repeats after the
    other's would put that drift into the ratio)."""
    for run in runners:
        run(2)  # warm-up: allocations, first-call paths
    best = [0.0] * len(runners)
    for _ in range(max(1, repeats)):
        for i, run in enumerate(runners):
            t0 = time.perf_counter()
            ntok = run(new_tokens)
            best[i] = max(best[i], ntok / (time.perf_counter() - t0))
    return best


def _median_interleaved(
    runners: list[Callable[[int], int]], new_tokens: int, repeats: int
) -> list[float]:
    """Median tokens/s of each runner over ``repeats`` interleaved rounds (one warm-up each
    first; see :func:`_time_interleaved`)."""
    import statistics

    for run in runners:
        run(2)
    got: list[list[float]] = [[] for _ in runners]
    for _ in range(max(1, repeats)):
        for i, run in enumerate(runners):
            t0 = time.perf_counter()
            ntok = run(new_tokens)
            got[i].append(ntok / (time.perf_counter() - t0))
    return [statistics.median(g) for g in got]


def _backend_runner(
    backend: Any, prompts: list[list[int]], loop: asyncio.AbstractEventLoop | None = None
) -> Callable[[int], int]:
    """``run(n)``: a rollout backend (or replica handle) generates ``n`` tokens for every prompt,
    all requests at once, on ``loop`` kept for the whole bench (a replica handle keeps its
    connection), or on a fresh loop per call without one. Returns the token count."""
    from postrl.rollout.types import SamplingParams

    calls = [0]

    async def once(n: int) -> int:
        calls[0] += 1
        outs = await asyncio.gather(
            *[
                backend.generate(
                    p,
                    SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i),
                    f"b{calls[0]}-{i}",
                )
                for i, p in enumerate(prompts)
            ]
        )
        return sum(len(o.token_ids) for o in outs)

    if loop is None:
        return lambda n: asyncio.run(once(n))
    return lambda n: loop.run_until_complete(once(n))


def _start_backend(name: str, model_dir: str, options: dict[str, Any], log_dir: str) -> Any:
    """Backend ``name`` as training runs it: in this process, or (its registry entry declares
    ``own_process``) as a replica process of its own, with its venv's python."""
    from postrl.rollout.base import create_rollout_backend, replica_python, runs_in_own_process

    if not runs_in_own_process(name):
        return create_rollout_backend(name, model_dir, **options)
    from pathlib import Path

    from postrl.rollout.replica_process import spawn_replica

    return spawn_replica(
        model_dir,
        backend=name,
        options=options,
        threads=torch.get_num_threads(),
        python=replica_python(name),
        log_path=Path(log_dir) / f"bench_rollout_{name}.log",
        startup_timeout_s=900.0,
        control_timeout_s=300.0,
    )


def run_backends(
    model_dir: str,
    backends: tuple[str, ...] = ("native", "hf", "vllm"),
    batch: int = 128,
    group: int = 8,
    new_tokens: tuple[int, ...] = (16, 128),
    scenarios: tuple[str, ...] = ("w1", "distinct"),
    repeats: int = 3,
    seed: int = 0,
    log_dir: str = "",
) -> list[dict]:
    """Rollout backends side by side (module docstring): rows ``{scenario, new_tokens,
    tok_s: {backend: median tokens/s}, ratio: {backend: tok/s ÷ the first backend's}}``.

    Raises:
        ValueError: ``backends`` is empty or names one twice (the registry names unknown ones).
    """
    from transformers import AutoConfig

    from postrl.rollout.base import ROLLOUT_BACKENDS

    if not backends or len(set(backends)) != len(backends):
        raise ValueError(
            f"--backend {','.join(backends)!r}: name each rollout backend once, e.g. native,hf,vllm"
        )
    for b in backends:
        ROLLOUT_BACKENDS.get(b)  # an unknown name fails before any engine starts
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    opts = dict(
        max_num_seqs=batch, max_model_len=64 + max(new_tokens), device="cpu", dtype="float32"
    )
    loop = asyncio.new_event_loop()
    engines: list[Any] = []
    try:
        for b in backends:
            engines.append(_start_backend(b, model_dir, opts, log_dir or tempfile.gettempdir()))
        rows = []
        for kind in scenarios:
            prompts = _prompts(kind, batch, group, vocab, seed)
            runners = [_backend_runner(e, prompts, loop) for e in engines]
            for n in new_tokens:
                tok_s = _median_interleaved(runners, n, repeats)
                rows.append(
                    dict(
                        scenario=kind,
                        new_tokens=n,
                        tok_s=dict(zip(backends, tok_s, strict=True)),
                        ratio={b: t / tok_s[0] for b, t in zip(backends, tok_s, strict=True)},
                    )
                )
        return rows
    finally:
        for e in engines:
            if callable(getattr(e, "close", None)):
                e.close()
        left = asyncio.all_tasks(loop)  # a replica handle's stream reader: let it end
        for t in left:
            t.cancel()

        async def settle() -> None:
            await asyncio.gather(*left, return_exceptions=True)

        loop.run_until_complete(settle())
        loop.close()


def decode_path(backend: Any) -> str:
    """Which decode implementation a native backend runs: ``c-step`` (one C call per step),
    ``c-ops`` (per-op C kernels from Python) or ``torch``."""
    if backend.kernels is None:
        return "torch"
    return "c-step" if backend._decode_step() is not None else "c-ops"


def run_bench(
    model_dir: str,
    batch: int = 128,
    group: int = 8,
    new_tokens: tuple[int, ...] = (16, 128),
    scenarios: tuple[str, ...] = ("w1", "distinct"),
    repeats: int = 1,
    seed: int = 0,
    kernels: str = "auto",
    compare_torch: bool = False,
) -> list[dict]:
    """Measure and return rows ``{scenario, new_tokens, native_tok_s, hf_tok_s, ratio, path}``
    (+ ``torch_path_tok_s`` with ``compare_torch``: the native engine on torch ops, same run)."""
    from transformers import AutoModelForCausalLM

    from postrl.rollout.native.engine import NativeBackend

    native = NativeBackend(
        model_dir, max_num_seqs=batch, max_model_len=64 + max(new_tokens), kernels=kernels
    )
    plain = (
        NativeBackend(
            model_dir, max_num_seqs=batch, max_model_len=64 + max(new_tokens), kernels="torch"
        )
        if compare_torch
        else None
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    rows = []
    for kind in scenarios:
        prompts = _prompts(kind, batch, group, native.cfg.vocab_size, seed)
        runners = [_backend_runner(native, prompts), _hf_runner(hf, prompts, pad)]
        if plain is not None:
            runners.append(_backend_runner(plain, prompts))
        for n in new_tokens:
            tok_s = _time_interleaved(runners, n, repeats)
            row = dict(
                scenario=kind,
                new_tokens=n,
                native_tok_s=tok_s[0],
                hf_tok_s=tok_s[1],
                ratio=tok_s[0] / tok_s[1],
                path=decode_path(native),
            )
            if plain is not None:
                row["torch_path_tok_s"] = tok_s[2]
            rows.append(row)
    native.close()
    if plain is not None:
        plain.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``postrl bench rollout --model DIR [--batch 128] [--new-tokens 16,128]
    [--backend native,hf,vllm]``."""
    p = argparse.ArgumentParser(prog="postrl bench rollout", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", required=True, help="HF model directory (e.g. from `postrl make-model`)"
    )
    p.add_argument(
        "--backend",
        default="",
        help="comma-separated rollout backends to time side by side (e.g. native,hf,vllm; "
        "median of --repeats interleaved rounds); default: native vs transformers.generate",
    )
    p.add_argument("--batch", type=int, default=128, help="sequences per measurement")
    p.add_argument("--group", type=int, default=8, help="samples per prompt in the w1 scenario")
    p.add_argument("--new-tokens", default="16,128", help="comma-separated completion lengths")
    p.add_argument("--scenarios", default="w1,distinct", help="comma-separated: w1, distinct")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds; each round times every engine once, in turn (default 1, best "
        "reported; with --backend default 3, median reported)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "fused", "torch"],
        help="native decode implementation (see NativeBackend)",
    )
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="also time the native engine on torch ops (kernels=torch) in the same run",
    )
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    new_tokens = tuple(int(x) for x in a.new_tokens.split(","))
    scenarios = tuple(a.scenarios.split(","))
    out = sys.stdout
    if a.backend:
        backends = tuple(b.strip() for b in a.backend.split(",") if b.strip())
        repeats = 3 if a.repeats is None else a.repeats
        brows = run_backends(a.model, backends, a.batch, a.group, new_tokens, scenarios, repeats)
        out.write(
            f"rollout backends  model={a.model}  batch={a.batch}  group={a.group}  "
            f"threads={torch.get_num_threads()}  median of {repeats} interleaved rounds\n"
        )
        head = "".join(f"{b + ' tok/s':>14}" for b in backends)
        head += "".join(f"{b + '/' + backends[0]:>14}" for b in backends[1:])
        out.write(f"{'scenario':<10}{'new_tok':>8}{head}\n")
        for r in brows:
            line = f"{r['scenario']:<10}{r['new_tokens']:>8}"
            line += "".join(f"{r['tok_s'][b]:>14.0f}" for b in backends)
            line += "".join(f"{r['ratio'][b]:>13.2f}x" for b in backends[1:])
            out.write(line + "\n")
        return 0
    rows = run_bench(
        a.model,
        a.batch,
        a.group,
        new_tokens,
        scenarios,
        1 if a.repeats is None else a.repeats,
        kernels=a.kernels,
        compare_torch=a.compare_torch,
    )
    out.write(
        f"rollout benchmark  model={a.model}  batch={a.batch}  threads={torch.get_num_threads()}  "
        f"decode={rows[0]['path'] if rows else '?'}\n"
    )
    extra = f"{'torch-path tok/s':>18}{'kernels gain':>14}" if a.compare_torch else ""
    out.write(
        f"{'scenario':<10}{'new_tok':>8}{'native tok/s':>14}{'hf tok/s':>12}{'ratio':>8}{extra}\n"
    )
    for r in rows:
        line = (
            f"{r['scenario']:<10}{r['new_tokens']:>8}{r['native_tok_s']:>14.0f}"
            f"{r['hf_tok_s']:>12.0f}{r['ratio']:>7.2f}x"
        )
        if "torch_path_tok_s" in r:
            line += (
                f"{r['torch_path_tok_s']:>18.0f}{r['native_tok_s'] / r['torch_path_tok_s']:>13.2f}x"
            )
        out.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
