"""``benchmarks/async_modes.py`` (sync, one_step_off, fully_async): correctness, never timing.

* the latency tool is registered, waits within its range and answers exactly;
* the measured window skips the warm-up step (and the drain step from 3 steps on);
* a 2-step x 1-repeat run of both workloads on the tiny random model writes a JSON with both
  modes per workload and positive samples/s (slow: four short trainings).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("async_modes")


def test_latency_tool_is_registered_waits_and_answers_exactly(bench):
    from postrl.tools.config import load_tool_config

    tools = load_tool_config(
        [{"class_name": bench.TOOL_NAME, "config": {"min_latency_ms": 20, "max_latency_ms": 40}}]
    )
    tool = tools["calculator"]  # the function name the tool-arith model calls
    assert isinstance(tool, bench.LatencyCalculatorTool)

    async def call():
        iid = await tool.create("t0", expression="47 * 83")
        t0 = time.perf_counter()
        resp = await tool.execute(iid, {})
        return resp, time.perf_counter() - t0

    resp, dt = asyncio.run(call())
    assert resp.text == str(47 * 83)
    assert 0.02 <= resp.metrics["tool/latency_s"] <= 0.04
    assert dt >= resp.metrics["tool/latency_s"] - 1e-3


def test_window_skips_warm_up_and_drain(bench):
    def rows(n):
        return [
            {"step": i + 1, "timing_s/step": 1.0 + i, "groups": 2.0, "trajectories": 4.0}
            for i in range(n)
        ]

    assert [r["step"] for r in bench.window(rows(2))] == [2]
    assert [r["step"] for r in bench.window(rows(5))] == [2, 3, 4]
    s = bench.summarize_run(rows(4))  # steps 2, 3 measured: 8 trajectories in 2 s + 3 s
    assert s["measured_steps"] == [2, 3]
    assert s["samples_per_s"] == pytest.approx(8 / 5)
    assert s["whole_run_samples_per_s"] == pytest.approx(16 / 10)
    assert s["staleness_mean"] is None and s["drop_rate"] is None  # not logged: n/a


def test_the_switch_arm_is_fully_async_with_the_idle_switch(bench):
    base = bench.mode_overrides("fully_async", ["trainer.num_threads=2"])
    arm = bench.mode_overrides("fully_async_switch", ["trainer.num_threads=2"])
    assert arm == [*base, "trainer.async.idle_switch=auto"]
    assert "fully_async_switch" not in bench.parse_args([]).modes  # asked for by name
    assert "fully_async_switch" in bench.parse_args(["--modes=fully_async_switch"]).modes


def test_the_completion_arm_is_one_step_off_in_completion_order(bench):
    assert bench.mode_overrides("one_step_off_completion", ["trainer.num_threads=2"]) == [
        "trainer.async.take_order=completion"
    ]
    assert "one_step_off_completion" in bench.parse_args(["--modes=one_step_off_completion"]).modes


def test_the_admission_arm_is_fully_async_in_admission_order(bench):
    base = bench.mode_overrides("fully_async", ["trainer.num_threads=2"])
    arm = bench.mode_overrides("fully_async_admission", ["trainer.num_threads=2"])
    assert arm == [*base, "trainer.async.take_order=admission"]
    assert "fully_async_admission" in bench.parse_args(["--modes=fully_async_admission"]).modes
    wait = bench.mode_overrides("fully_async_wait", ["trainer.num_threads=2"])
    assert wait[-1] == "trainer.async.staleness_strategy=wait"
    assert "trainer.num_threads=1" in wait  # fully_async's own split still applies


@pytest.mark.slow
def test_benchmark_main_writes_every_mode_for_both_workloads(bench, tiny_model_dir, tmp_path):
    out = tmp_path / "results.json"
    rc = bench.main(
        [
            "--workload=both",
            "--steps=2",
            "--repeats=1",
            f"--w1-model={tiny_model_dir}",
            f"--tools-model={tiny_model_dir}",
            f"--work-dir={tmp_path / 'work'}",
            "--prompts=2",
            "--n=2",
            "--no-probes",  # the planner's machine probes: seconds each, not what this checks
            f"--out={out}",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["workloads"]) == {"w1", "tools"}
    for name, w in res["workloads"].items():
        assert [r["mode"] for r in w["runs"]] == ["sync", "one_step_off", "fully_async"], name
        for r in w["runs"]:
            assert len(r["steps"]) == 2
            assert r["summary"]["samples_per_s"] > 0
        for mode in ("sync", "one_step_off", "fully_async"):
            assert w["median"][mode]["samples_per_s"] > 0
        for mode in ("one_step_off", "fully_async"):
            assert w["ratios"][mode]["samples_per_s"] > 0
            assert w["verdicts"][mode]
        assert w["runs"][2]["summary"]["trainer_idle"] is not None  # fully_async's own metrics
        osoff = w["runs"][1]["summary"]
        assert osoff["staleness_max"] is not None  # one_step_off logs replay/* metrics
        assert osoff["drop_rate"] is not None
