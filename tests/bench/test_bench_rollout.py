"""Smoke test of ``postrl bench rollout``: it runs both engines and reports consistent rows."""

from __future__ import annotations

import torch

from postrl.bench.rollout import main, run_bench


def test_bench_rollout_rows_are_consistent(tiny_model_dir):
    threads = torch.get_num_threads()
    try:
        rows = run_bench(
            str(tiny_model_dir),
            batch=8,
            group=4,
            new_tokens=(3,),
            scenarios=("w1", "distinct"),
            compare_torch=True,
        )
    finally:
        torch.set_num_threads(threads)
    assert [(r["scenario"], r["new_tokens"]) for r in rows] == [("w1", 3), ("distinct", 3)]
    for r in rows:
        assert r["native_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["torch_path_tok_s"] > 0
        assert abs(r["ratio"] - r["native_tok_s"] / r["hf_tok_s"]) < 1e-9
        assert r["path"] in ("c-step", "c-ops", "torch")


def test_bench_rollout_cli_prints_a_table(tiny_model_dir, capsys):
    threads = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "--model",
                    str(tiny_model_dir),
                    "--batch",
                    "4",
                    "--group",
                    "2",
                    "--new-tokens",
                    "2",
                    "--scenarios",
                    "w1",
                    "--kernels",
                    "torch",
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "decode=torch" in out
    assert out.splitlines()[-1].startswith("w1") and out.rstrip().endswith("x")
