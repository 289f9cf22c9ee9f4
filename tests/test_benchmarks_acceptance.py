"""``benchmarks/acceptance.py``: issue 37's report reads each benchmark's own output format and
holds it to the issue's goals; the README's band and the script's agree. Never timing: the
stages' outputs are written here in their formats, and a stage whose output exists is read, not
run (so the whole report is built from them in a second)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def acc(load_benchmark):
    return load_benchmark("acceptance")


def test_cpu_kind_reads_the_flags_line(acc):
    line = "flags\t\t: fpu sse sse2 avx avx2 fma"
    assert acc.cpu_kind(f"processor\t: 0\n{line}\n") == "AVX2"
    assert acc.cpu_kind(f"{line} avx512f avx512bw\n") == "AVX-512"
    assert acc.cpu_kind("flags\t\t: fpu sse sse2\n") == "other"


def test_the_readme_states_the_band_the_check_holds_the_quickstart_to(acc):
    """The README's summary sentence of the band is the check's band, number for number."""
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"starts at (\S+)–(\S+) on either kind and gains \+(\S+) to \+(\S+) in", text)
    assert m, "README.md no longer says 'starts at A–B on either kind and gains +C to +D in'"
    start, gain = tuple(map(float, m.groups()[:2])), tuple(map(float, m.groups()[2:]))
    assert start == acc.QUICKSTART_START and gain == acc.QUICKSTART_GAIN


def test_each_verdict_can_miss(acc):
    rnd = lambda p, t, f: {"postrl": {"step": p, "update_fraction_of_peak": f}, "trl": {"step": t}}  # noqa: E731
    ok = acc.trl_rows([rnd(0.2, 1.2, 0.56), rnd(0.2, 1.0, 0.5), rnd(0.25, 1.3, 0.6)])
    assert [r.ok for r in ok] == [True, True]  # median 5.2x; median fraction 0.56
    assert "5.20x" in ok[0].measured
    miss = acc.trl_rows([rnd(0.2, 0.9, 0.4)] * 3)
    assert [r.verdict for r in miss] == ["MISS", "MISS"]

    metrics = [{"step": 0, "val/acc/mean": 0.33}, {"step": 1}, {"step": 150, "val/acc/mean": 0.62}]
    assert [r.ok for r in acc.quickstart_rows(metrics, "AVX-512")] == [True, True]
    metrics[0]["val/acc/mean"] = 0.10  # the old, bit-sensitive warm-up's start
    assert [r.ok for r in acc.quickstart_rows(metrics, "AVX2")] == [False, False]
    with pytest.raises(ValueError, match="val/acc/mean"):
        acc.quickstart_rows([{"step": 0}], "AVX2")

    curve = lambda a10: [[0.0, 0.05], [300.0, 0.15], [601.0, a10]]  # noqa: E731
    res = {"runs": {"recipe": {str(s): {"curve": curve(a), "steps": 1800} for s, a in
                               enumerate([0.24, 0.38, 0.30])}}}  # fmt: skip
    (avx512,) = acc.recipe_rows(res, "AVX-512")
    assert avx512.ok and avx512.measured.startswith("30.7%")  # the first point at/after 600 s
    assert acc.recipe_rows(res, "AVX2")[0].goal == ">= 20%"
    res["runs"]["recipe"]["0"]["curve"] = curve(0.10)
    assert acc.recipe_rows(res, "AVX-512")[0].verdict == "MISS"
    assert acc.recipe_rows(res, "other")[0].ok is None  # measured, no goal for the kind


def test_learning_per_sample_against_sync_at_the_last_step(acc):
    def runs(*finals, early=0.7):
        return {str(i): {"acc": {"0": 0.2, "15": early, "30": f}} for i, f in enumerate(finals)}

    res = {"args": {"set": ["actor.optim.lr=1e-4"]},
           "runs": {"sync": runs(0.88, 0.86), "one_step_off": runs(0.87, 0.84, early=0.6),
                    "fully_async": runs(0.0, 0.84)}}  # fmt: skip
    rows = acc.learning_rows(res)
    assert [r.ok for r in rows] == [None, True, False]  # fa's collapsed seed: mean 0.42
    assert rows[1].what == "tail learning (actor.optim.lr=1e-4): one_step_off held-out at step 30"
    assert rows[1].measured == "0.855 (0.87, 0.84); worst step's mean -0.100 against sync"
    assert "worst step's mean -0.450" in rows[2].measured
    res["args"]["set"] = []
    assert "(the defaults)" in acc.learning_rows(res)[0].what


def _bench_output(workload: str, sync: float, osoff: float, fa: float) -> dict:
    """An ``async_modes.py --out`` in its format: the planner's inputs (one sync step row,
    the speed-up probe) and the medians and per-repeat ratios of each mode."""
    row = {"timing_s/step": 2.0, "timing_s/gen": 1.5, "timing_s/gen_engine": 1.0,
           "agent/num_tool_calls": 1.0, "trajectories": 64.0, "groups": 8.0}  # fmt: skip
    med = {"sync": sync, "one_step_off": osoff, "fully_async": fa}
    return {
        "settings": {
            "threads": 2,
            "fa_threads": None,
            "tail_latency": [500, 0.0, 50, 2000],
            "latency_ms": [20.0, 300.0],
        },  # fmt: skip
        "workloads": {
            workload: {
                "runs": [{"mode": "sync", "steps": [row] * 4}],
                "speedup": [2.0],
                "median": {m: {"samples_per_s": v, "staleness_mean": None} for m, v in med.items()},
                "ratios": {
                    m: {"samples_per_s": med[m] / sync, "samples_per_s_per_repeat": [med[m] / sync]}
                    for m in ("one_step_off", "fully_async")
                },
            }
        },
    }


def _quickstart_metrics(work: Path) -> None:
    """The quickstart stage's output, in its place under ``work``: 0.30 → 0.60."""
    qs = work / "quickstart" / "grpo"
    qs.mkdir(parents=True)
    qs.joinpath("metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "val/acc/mean": a}) for s, a in [(0, 0.3), (150, 0.6)])
    )


def test_the_report_from_existing_outputs_without_running_a_stage(acc, tmp_path, capsys):
    """Every stage's output is in the work dir: main reads them all (no stage runs: a run
    would fail here, TRL's python does not exist), prints the table and writes the report."""
    (tmp_path / "async_tail.json").write_text(json.dumps(_bench_output("tail", 32.0, 40.0, 52.0)))
    (tmp_path / "async_w1.json").write_text(json.dumps(_bench_output("w1", 32.0, 31.0, 29.0)))
    _quickstart_metrics(tmp_path)
    rc = acc.main(["--only", "async-tail,async-w1,planner,quickstart", "--work-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    verdicts = {(r["item"], r["what"]): r["verdict"] for r in report["rows"]}
    assert verdicts[("2", "tail: fully_async / sync samples/s (sync 32.0/s)")] == "ok"  # 1.62x
    assert verdicts[("2", "tail: one_step_off / sync samples/s (sync 32.0/s)")] == "MISS"  # 1.25x
    assert verdicts[("2", "w1: fully_async / sync samples/s (sync 32.0/s)")] == "MISS"  # 0.91x
    # repeats that disagree (another process took the cores during one): not judged ok
    noisy = _bench_output("w1", 32.0, 32.0, 32.0)
    noisy["workloads"]["w1"]["ratios"]["one_step_off"]["samples_per_s_per_repeat"] = [0.8, 2.5, 1]
    (row, _) = acc.async_rows(noisy, "w1")
    assert row.verdict == "MISS" and "NOISY" in row.measured and "--only async-w1" in row.measured
    planner = [r for r in report["rows"] if r["item"] == "3"]
    assert {r["what"].split(":")[0] for r in planner} == {"planner, tail", "planner, w1"}
    assert len(planner) == 6  # three modes on each workload
    out = capsys.readouterr().out
    assert "| item | what | measured | goal | verdict |" in out
    assert (tmp_path / "report.md").read_text() in out
    assert "run now: none (0 min); the others read from" in out
    # the machine's GEMM path is on record (MKL picks kernels by CPU vendor as well as ISA)
    assert "CPU vendor and torch's GEMM path: " in out


def test_a_stage_that_needs_a_missing_output_or_tool_says_which(acc, tmp_path):
    _quickstart_metrics(tmp_path)
    assert acc.main(["--only", "planner,quickstart", "--work-dir", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert rows[0]["what"] == "stage planner" and rows[0]["verdict"] == "MISS"
    assert "async_tail.json is missing: run the async-tail stage" in rows[0]["measured"]
    # the quickstart stage still ran after it (here: it read the metrics already there)
    assert [r["item"] for r in rows[1:]] == ["4", "4"]
    with pytest.raises(SystemExit):  # argparse: TRL's python named, and how to make it
        acc.main(["--only", "trl", "--trl-python", str(tmp_path / "nope"), "--work-dir", "x"])
    with pytest.raises(SystemExit):
        acc.main(["--only", "speed", "--work-dir", str(tmp_path)])
