"""postrl's C kernels built for this CPU and for an AVX2-only CPU, side by side on one machine.

The fused kernels (the native engine's ``rollout/native/kernels.c``, the training kernels'
``kernels/train.c``) are built with ``-march=native``, so an AVX2-only CPU (AMD EPYC Zen 3, say)
runs different code from an AVX-512 one. ``POSTRL_KERNELS_MARCH=x86-64-v3`` builds that code on
any x86-64 host (``postrl/kernels/build.py``). This script times the kernels of both builds at the
3-digit recipe's shapes (tiny-qwen2: 4 heads, 2 KV heads, head_dim 64, intermediate 512), one
build per subprocess, the two builds alternating for ``--rounds`` rounds, and prints each
kernel's best time per build and the ratio AVX2 / native. Only the kernels' own code is held to
AVX2 here; torch's and MKL's kernels run as the host's.

    python benchmarks/kernel_isa.py [--rounds 3] [--threads 2]

A ratio near 1 means the AVX2 build's loops vectorise as the native ones do; before the kernels
built with ``-fno-trapping-math`` and kept decode attention's 16-wide variants to AVX-512, the
ratios were 4.8-6.2x (attention) and 7.5-10.7x (SwiGLU) on an AVX-512 Xeon (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from postrl.rollout.native import kernels as R
from postrl.kernels import train as T
torch.set_num_threads(int(sys.argv[2]))
torch.manual_seed(0)
dec, tr = R.load(), T.load()
if dec is None or tr is None:
    print(json.dumps({"error": f"decode: {R.build_error()}; train: {T.build_error()}"}))
    raise SystemExit(0)
H, Hkv, D, I, V, threads = 4, 2, 64, 512, 259, torch.get_num_threads()


def best(fn, reps=100):
    fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ts.append((time.perf_counter() - t0) / reps)
    return min(ts)


res = {}
for B, plen_v, own in ((256, 35, 5), (64, 280, 20)):
    P, T_ = 64, max(64, plen_v)
    qkv = torch.randn(B, (H + 2 * Hkv) * D)
    pk, pv = torch.randn(P, Hkv, T_, D), torch.randn(P, Hkv, T_, D)
    kc, vc = torch.randn(B, Hkv, 64, D), torch.randn(B, Hkv, 64, D)
    pid, plen = torch.randint(0, P, (B,)), torch.full((B,), plen_v)
    pos = plen + own - 1
    args = (qkv, H, Hkv, D, pk, pv, kc, vc, pid, plen, pos, D**-0.5, threads)
    res[f"decode attention, {B} rows, prompt {plen_v} + {own}"] = best(
        lambda: dec.decode_attention(*args)
    )
gu = torch.randn(256, 2 * I) * 3
res["engine SwiGLU (silu_mul), 256 rows"] = best(lambda: dec.silu_mul(gu))
logits, temp = torch.randn(256, V) * 3, torch.ones(256)
seeds, ctr = torch.arange(256), torch.zeros(256, dtype=torch.int64)
res["engine sampling softmax, 256 rows"] = best(lambda: dec.sample(logits, temp, seeds, ctr))
a, u = torch.randn(2048, I, requires_grad=True), torch.randn(2048, I, requires_grad=True)
res["training SwiGLU forward, 2048 x 512"] = best(lambda: T.swiglu(a, u))
h = T.swiglu(a, u)
dh = torch.randn_like(h)
res["training SwiGLU forward + backward"] = best(
    lambda: torch.autograd.grad(T.swiglu(a, u), (a, u), dh), reps=30
)
print(json.dumps({"times": res, "decode": dec.path.name, "train": tr.path.name}))
"""


def _run(march: str | None, threads: int) -> dict:
    env = dict(os.environ)
    env.pop("POSTRL_KERNELS_MARCH", None)
    if march:
        env["POSTRL_KERNELS_MARCH"] = march
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"kernel benchmark ({march or 'native'}) failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in got:
        raise RuntimeError(f"kernels unavailable ({march or 'native'}): {got['error']}")
    return got


def mkl_dispatch() -> str:
    """Which code path torch's MKL takes on this CPU, from MKL's own verbose line (a child process
    with ``MKL_VERBOSE=1`` runs one small matmul), with the CPU's vendor. MKL picks its GEMM
    kernels by vendor as well as ISA: on a CPU that is not "GenuineIntel" it reports "Intel(R)
    Architecture processors" and takes a generic (SSE) path, or a Zen kernel where it recognises
    AMD Zen (on this Xeon, made to look non-Intel, the recipe's step ran 1.99x slower on the
    generic path; docs/benchmarks.md). "unknown" when torch's BLAS is not MKL."""
    code = "import torch; torch.ones(64, 64) @ torch.ones(64, 64)"
    env = {**os.environ, "MKL_VERBOSE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    ).stdout
    vendor = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("vendor_id")
        ),
        "?",
    )
    line = next((ln for ln in out.splitlines() if ln.startswith("MKL_VERBOSE oneMKL")), "")
    path = line.split(" architecture ", 1)[1].split(", Lnx")[0] if " architecture " in line else ""
    return f"{vendor}; MKL: {path or 'unknown (not MKL, or no verbose line)'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (native, AVX2), alternating")
    ap.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    args = ap.parse_args(argv)
    from postrl.kernels.build import cpu_flags

    if "avx2" not in cpu_flags().split():
        print("this CPU has no AVX2: nothing to compare")
        return 1
    best: dict[str, dict[str, float]] = {"native": {}, "x86-64-v3": {}}
    for r in range(args.rounds):
        for build in ("native", "x86-64-v3") if r % 2 == 0 else ("x86-64-v3", "native"):
            got = _run(None if build == "native" else build, args.threads)
            for k, v in got["times"].items():
                best[build][k] = min(v, best[build].get(k, float("inf")))
    print(f"CPU vendor {mkl_dispatch()}")
    print(f"{'kernel':46s} {'native':>10s} {'AVX2':>10s} {'AVX2/native':>12s}")
    for k, t in best["native"].items():
        a = best["x86-64-v3"][k]
        print(f"{k:46s} {t * 1e6:8.1f}us {a * 1e6:8.1f}us {a / t:11.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
