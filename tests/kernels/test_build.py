"""``postrl/kernels/build.py``: ``POSTRL_KERNELS_MARCH`` builds the kernels for a named ISA level
instead of the host's, so an AVX-512 machine can run an AVX2-only CPU's code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from postrl.kernels import build


def test_variants_follow_the_environment(monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    assert build.variants() == build.VARIANTS
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
    got = build.variants()
    assert got[0] == ("-march=x86-64-v3", "-fopenmp")
    assert all("-march=native" not in v and "-mcpu=native" not in v for v in got)
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3; rm -rf /")
    with pytest.raises(ValueError, match="POSTRL_KERNELS_MARCH"):
        build.variants()


_PROBE = """
import json, torch
from postrl.kernels import train as T
from postrl.rollout.native import kernels as R
k, dec = T.load(), R.load()
g = torch.Generator().manual_seed(0)
x, w = torch.randn(111, 256, generator=g), torch.randn(256, generator=g)
out = T.rms_norm(x, w, 1e-6) if k is not None else None
info = {"path": None, "flags": None, "err": T.build_error(), "out": None,
        "decode": str(dec.path) if dec is not None else None}
if k is not None:
    info.update(path=str(k.path), flags=k.flags, out=out.flatten()[:64].tolist())
print(json.dumps(info))
"""


def _probe(tmp_path: Path, march: str | None) -> dict:
    env = {**os.environ, "POSTRL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(build.MARCH_ENV, None)
    if march:
        env[build.MARCH_ENV] = march
    res = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    "avx512f" not in Path("/proc/cpuinfo").read_text() or shutil.which("objdump") is None,
    reason="needs an AVX-512 host and objdump",
)
def test_an_avx2_build_on_an_avx512_host_has_no_avx512_code_and_agrees(tmp_path):
    native, avx2 = _probe(tmp_path, None), _probe(tmp_path, "x86-64-v3")
    if native["path"] is None:
        pytest.skip(f"training kernels unavailable: {native['err']}")
    assert "-march=x86-64-v3" in avx2["flags"] and avx2["path"] != native["path"]

    def evex(path: str) -> int:  # operands only AVX-512 has: zmm, ymm16-31, mask registers
        dis = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, timeout=120)
        return len(re.findall(r"%zmm|%[xy]mm(?:1[6-9]|2\d|3[01])\b|%k[1-7]\b", dis.stdout))

    assert evex(avx2["path"]) == 0 < evex(native["path"])
    diff = max(abs(a - b) for a, b in zip(avx2["out"], native["out"]))
    assert diff <= 1e-5 * max(abs(v) for v in native["out"])


def _functions(path: str, prefixes: tuple[str, ...]) -> dict[str, str]:
    """The disassembly of each function of the library whose name starts with one of
    ``prefixes`` (OpenMP outlines a parallel loop into ``<name>._omp_fn.N``)."""
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True, timeout=120
    ).stdout
    out = {}
    for block in dis.split("\n\n"):
        m = re.search(r"^[0-9a-f]+ <([^>]+)>:", block, re.M)
        if m and m.group(1).startswith(prefixes):
            out[m.group(1)] = block
    return out


@pytest.mark.skipif(
    "avx2" not in Path("/proc/cpuinfo").read_text() or shutil.which("objdump") is None,
    reason="needs an AVX2 host and objdump",
)
def test_an_avx2_build_vectorises_the_exp_loops(tmp_path):
    """The loops around the polynomial ``exp`` (SwiGLU forward and backward, the engine's
    SwiGLU and sampling softmax) carry a compare-and-select; without ``-fno-trapping-math`` gcc
    if-converts them only with AVX-512's mask registers, so an AVX2 build ran them one float at
    a time (silu_mul 7-11x slower). Each must use packed 256-bit arithmetic there."""
    avx2 = _probe(tmp_path, "x86-64-v3")
    if avx2["path"] is None or avx2["decode"] is None:
        pytest.skip(f"kernels unavailable: {avx2['err']}")
    packed = re.compile(r"\bv(?:fn?madd\d*|mul|div|add|sub)ps\s.*%ymm")
    for path, names in (
        (avx2["path"], ("postrl_t_swiglu_fwd", "postrl_t_swiglu_bwd")),
        (avx2["decode"], ("postrl_silu_mul", "postrl_sample")),
    ):
        funcs = _functions(path, names)
        for name in names:
            body = "".join(v for k, v in funcs.items() if k.split(".")[0] == name)
            assert body, f"{name} not found in {path}"
            assert packed.search(body), f"{name}: no packed ymm arithmetic in the AVX2 build"
    # decode attention's 16-wide variants overflow AVX2's 16 ymm registers (4x slower there):
    # only an AVX-512 build compiles them
    assert not _functions(avx2["decode"], ("scores_g16", "pv_g16"))
