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


def test_bench_rollout_backends_side_by_side(tiny_model_dir, capsys):
    """``--backend native,hf``: both rollout backends timed through their ``generate`` (median
    of interleaved rounds), ratios to the first named; a repeated name is an error naming the
    flag. (``vllm`` joins the same way, as a replica process; run by hand: docs/benchmarks.md.)"""
    import pytest

    from postrl.bench.rollout import run_backends

    threads = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "--model",
                    str(tiny_model_dir),
                    "--backend",
                    "native,hf",
                    "--batch",
                    "4",
                    "--group",
                    "2",
                    "--new-tokens",
                    "2",
                    "--repeats",
                    "2",
                ]
            )
            == 0
        )
        with pytest.raises(ValueError, match="--backend 'native,native'"):
            run_backends(str(tiny_model_dir), ("native", "native"))
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert "median of 2 interleaved rounds" in lines[-4]
    assert lines[-3].split() == [
        "scenario",
        "new_tok",
        "native",
        "tok/s",
        "hf",
        "tok/s",
        "hf/native",
    ]
    for line, kind in zip(lines[-2:], ("w1", "distinct")):
        cells = line.split()
        assert cells[:2] == [kind, "2"] and float(cells[2]) > 0 and float(cells[3]) > 0
        assert cells[4].endswith("x")
