"""Smoke test of ``postrl bench step`` at a tiny size: the harness runs both sides and reports
consistent numbers. Correctness only — no timing assertions (the machine is shared)."""

from __future__ import annotations

import json
import math

import torch

from postrl.bench.step import W1, completion_mask, format_report, main, prepare_w1


def test_completion_mask_keeps_tokens_through_first_eos():
    eos = 7
    comp = torch.tensor(
        [
            [1, 2, 7, 7, 7],  # finished at t=2, then generate's padding (= eos)
            [7, 3, 3, 3, 3],  # eos first
            [1, 2, 3, 4, 5],
        ]
    )  # never finished: all valid
    assert completion_mask(comp, eos).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ]


def test_bench_step_tiny_runs_both_sides_and_caches_warm_model(tmp_path, capsys):
    w = W1(num_prompts=2, n=2, new_tokens=4, sft_steps=1)
    work = tmp_path / "work"
    out = tmp_path / "res.json"
    argv = [
        "--steps",
        "1",
        "--work-dir",
        str(work),
        "--prompts",
        "2",
        "--n",
        "2",
        "--new-tokens",
        "4",
        "--sft-steps",
        "1",
        "--json",
        str(out),
    ]
    # warm once; main() with the same warm-up settings must reuse it
    model_dir, _ = prepare_w1(work, w)
    weights = model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert main(argv) == 0
    assert weights.stat().st_mtime_ns == mtime, "the cached warmed model was trained again"

    res = json.loads(out.read_text())
    p, q, r = res["postrl"], res["plain"], res["ratio"]
    B, T = 2 * 2, 4
    for side in (p, q):
        assert (
            B <= side["completion_tokens"] <= B * T
        )  # every sample has >= 1 token, <= max new tokens
        assert 1 <= side["response_length/mean"] <= T
        assert all(math.isfinite(v) and v >= 0 for v in side.values())
    for stage in ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync_weights", "step"):
        assert 0 <= p[stage] <= p["step"] + 1e-6, stage
    assert q["gen"] + q["reward"] + q["update"] <= q["step"] + 1e-6
    assert set(r) == {"step", "gen", "update", "train", "step_best"} and all(
        v > 0 and math.isfinite(v) for v in r.values()
    )
    assert math.isclose(r["step"], q["step"] / p["step"])
    assert len(res["steps"]["postrl"]) == len(res["steps"]["plain"]) == 1
    printed = capsys.readouterr().out
    assert "ratio plain/postrl" in printed and printed.strip() == format_report(res)
