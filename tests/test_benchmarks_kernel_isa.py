"""``benchmarks/kernel_isa.py``: both builds of the C kernels (this CPU's and AVX2's) load, run at
the recipe's shapes and are reported side by side. Never timing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


@pytest.mark.skipif(
    "avx2" not in Path("/proc/cpuinfo").read_text(), reason="needs an x86-64 CPU with AVX2"
)
def test_both_builds_run_and_every_kernel_is_reported(load_benchmark, capsys):
    bench = load_benchmark("kernel_isa")
    assert bench.main(["--rounds", "1", "--threads", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.endswith("x")]
    names = [re.split(r"\s{2,}", ln)[0] for ln in rows]
    assert len(names) == 6 and any("attention" in n for n in names), rows
    for ln in rows:
        native, avx2, ratio = (float(v) for v in re.findall(r"([\d.]+)(?:us|x)", ln))
        assert native > 0 and avx2 > 0
        assert ratio == pytest.approx(avx2 / native, rel=0.02, abs=0.01)
