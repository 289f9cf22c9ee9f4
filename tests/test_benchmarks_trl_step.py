"""``benchmarks/trl_step.py``: the postrl side of the W1-vs-TRL step benchmark runs real steps and
accounts for them (stages, packed tokens, GEMM work and rate); the report reads its rounds.
The TRL side needs ``trl``, which is not a dependency: it is not run here. Never timing."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("trl_step")


def test_gemm_work_counts_every_linear_layer(bench, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    peak = bench.gemm_peak(model, 64, repeats=1)
    assert peak["flop_per_token"] == 6 * sum(m.in_features * m.out_features for m in lin)
    assert peak["gflops"] > 0


def test_postrl_side_runs_and_accounts_for_its_step(bench, tiny_model_dir, tmp_path):
    from postrl.data import generate_addition, write_parquet

    train = write_parquet(generate_addition(64, seed=0), tmp_path / "train.parquet")
    out = tmp_path / "postrl.json"
    args = ["--side", "postrl", "--model", str(tiny_model_dir), "--train", str(train)]
    args += ["--work-dir", str(tmp_path), "--steps", "3", "--threads", "1", "--json", str(out)]
    assert bench.main(args) == 0
    r = json.loads(out.read_text())
    assert len(r["step_s"]) == 3 and r["step"] == r["step_s"][2]
    assert sum(r["stages"].values()) == pytest.approx(r["step"], rel=1e-6)  # "other" closes it
    assert r["stages"]["gen"] > 0 and r["stages"]["update_actor"] > 0
    # 16 prompts stored once plus every completion of 16 x 8: fewer than 128 unshared rows
    assert 0 < r["packed_tokens"] < 128 * (64 + 16)
    assert 0 < r["update_fraction_of_peak"] == pytest.approx(r["update_gflops"] / r["peak_gflops"])
    assert "timing_s/weight_sync_verify" in r["timings"]
    text = bench.report([{"postrl": r, "trl": {"step": 2 * r["step"], "step_s": [1.0] * 3}}])
    assert "2.00x" in text and "update_actor" in text
