"""The mode planner's arithmetic (``postrl bench modes``): pure functions, hand-computed cases."""

from __future__ import annotations

import json

import pytest

from postrl.bench.modes import (
    Latency,
    Profile,
    contended_time,
    expected_max,
    extrapolate,
    fully_async_staleness,
    gen_overhead,
    kept_wait,
    lent_time,
    main,
    parse_latency,
    power_speedup,
    predict_fully_async,
    predict_one_step_off,
    predict_sync,
    profile_from_rows,
    stale_drop_fraction,
    validate_bench,
)

# G = 1 s of engine compute, U = 0.5 s after generation, 64 trajectories in groups of 8,
# each calls the tool once, measured on 2 threads
P = Profile(
    trajectories=64,
    group_size=8,
    gen_compute_s=1.0,
    gen_s=1.5,
    after_gen_s=0.5,
    calls_per_traj=1.0,
    threads=2,
)
HALF_S = Latency("const", 0.5)


def test_expected_max_hand_cases():
    assert expected_max(HALF_S, 5) == pytest.approx(0.5)
    assert expected_max(HALF_S, 2, p=0.5) == pytest.approx(0.5 * 0.75)  # P(any of 2 calls)
    assert expected_max(HALF_S, 0) == 0.0
    u = Latency("uniform", lo=0.0, hi=1.0)
    assert expected_max(u, 1) == pytest.approx(0.5, abs=1e-4)  # E[U]
    assert expected_max(u, 2) == pytest.approx(2 / 3, abs=1e-4)  # E[max of 2] = n/(n+1)
    assert expected_max(u, 3) == pytest.approx(3 / 4, abs=1e-4)
    # a log-normal without spread is its median; clipping bounds it
    assert expected_max(Latency("lognormal", 0.2, 0.0, 0.05, 2.0), 3) == pytest.approx(
        0.2, abs=1e-3
    )
    assert expected_max(Latency("lognormal", 0.2, 5.0, 0.05, 2.0), 10_000) == pytest.approx(
        2.0, abs=1e-3
    )


def test_parse_latency():
    assert parse_latency("none") == Latency("const", 0.0)
    assert parse_latency("const:100") == Latency("const", 0.1)
    assert parse_latency("uniform:20,300") == Latency("uniform", lo=0.02, hi=0.3)
    assert parse_latency("lognormal:200,1,50,2000") == Latency("lognormal", 0.2, 1.0, 0.05, 2.0)
    for bad in ("gamma:1", "uniform:300", "uniform:300,20", "const:x", "lognormal:0,1,5,6"):
        with pytest.raises(ValueError, match="--latency"):
            parse_latency(bad)


def test_the_generations_overhead_outside_the_engine_is_paid_in_process():
    # G 1 s, W 0.5 s, gen 1.8 s: O = 0.3 s of agent loops and scoring beside the engine
    p = Profile(**{**P.__dict__, "gen_s": 1.8})
    assert gen_overhead(p, 0.5) == pytest.approx(0.3) and gen_overhead(P, 0.5) == 0.0
    assert predict_sync(p, HALF_S).step_s == pytest.approx(2.3)
    assert predict_one_step_off(p, HALF_S).step_s == pytest.approx(1.8)  # G + O + U


def test_sync_and_one_step_off():
    s = predict_sync(P, HALF_S)  # 1 + 0.5 + 0.5
    assert (s.step_s, s.samples_per_s, s.staleness) == (pytest.approx(2.0), pytest.approx(32), 0)
    # admission order: two batches generate together for max(2 x 1, 1 + 0.5) = 2 s, then
    # train one after another: 0.5 + 2 / 2; the first trains at staleness 0, the second at 1
    o = predict_one_step_off(P, HALF_S)
    assert o.step_s == pytest.approx(1.5) and o.samples_per_s == pytest.approx(64 / 1.5)
    assert o.bound.startswith("compute") and o.staleness == pytest.approx(0.5)
    # a 3 s wait does not hide behind the two batches' 2 s of compute: 0.5 + (1 + 3) / 2
    o = predict_one_step_off(P, Latency("const", 3.0))
    assert o.step_s == pytest.approx(2.5) and o.bound.startswith("latency")
    # the buffer admits 2 + num_warmup_batches batches, within the cap of max_staleness + 1
    assert predict_one_step_off(P, Latency("const", 3.0), max_staleness=2).step_s == (
        pytest.approx(2.5)
    )
    o3 = predict_one_step_off(P, Latency("const", 3.0), max_staleness=2, batches_ahead=3)
    assert o3.step_s == pytest.approx(0.5 + 4 / 3) and o3.staleness == pytest.approx(1.0)
    with pytest.raises(ValueError, match="take_order"):
        predict_one_step_off(P, HALF_S, take_order="lifo")


def test_admission_order_hides_the_later_batches_extra_wait_behind_the_updates():
    """The first of a pair waits for its own slowest call (W_B); the second's longer wait
    (W_2B) runs on while the first trains: a paused fleet stops decoding, not the calls."""
    u4 = Latency("uniform", lo=0.0, hi=4.0)  # E[max of n] = 4n / (n + 1)
    w_b, w_2b = 4 * 4 / 5, 4 * 8 / 9
    p = Profile(**{**P.__dict__, "trajectories": 4, "gen_s": 1.0 + w_b})  # G 1 s, O 0
    o = predict_one_step_off(p, u4)
    assert o.parts["W"] == pytest.approx(w_b, rel=1e-3)
    assert o.parts["W_kB"] == pytest.approx(w_2b, rel=1e-3)
    # W_2B − W_B = 0.36 s < U = 0.5 s: hidden; (G + W_B + 2U) / 2
    assert o.step_s == pytest.approx((1 + w_b + 2 * 0.5) / 2, rel=1e-3)
    assert o.bound.startswith("latency")
    # a shorter update hides only 0.1 s of it; the rest is waited for
    short = Profile(**{**p.__dict__, "after_gen_s": 0.1})
    late = w_2b - w_b - 0.1
    assert predict_one_step_off(short, u4).step_s == pytest.approx(
        (1 + w_b + late + 2 * 0.1) / 2, rel=1e-3
    )


def test_completion_order_holds_a_slot_for_the_groups_own_wait_and_drops_stragglers():
    # every call waits 3 s; Little's law over the two batches' slots: (1 + 3 + 0.5) / 2 = 2.25
    # s a step, and a group admitted as an update ends is complete 4 s later, just by the take
    # before the second push after it (2 x 2.25 - 0.5): none is dropped
    three = Latency("const", 3.0)
    assert stale_drop_fraction(P, three, gen_s=1.0, deadline_s=4.0) == 0.0
    assert stale_drop_fraction(P, three, gen_s=1.0, deadline_s=3.9) == 1.0
    o = predict_one_step_off(P, three, take_order="completion")
    assert o.step_s == pytest.approx(2.25) and o.parts["drop"] == 0.0
    assert o.bound.startswith("latency")
    # uniform waits on [0, 2] s: a group outlasts a deadline 1 s after its generation unless
    # all 8 of its calls return within 1 s
    u = Latency("uniform", lo=0.0, hi=2.0)
    assert stale_drop_fraction(P, u, gen_s=0.5, deadline_s=1.5) == pytest.approx(1 - 0.5**8)
    assert stale_drop_fraction(P, u, gen_s=0.5, deadline_s=0.4) == 1.0
    # the kept groups' mean max wait: E[max of 8 uniforms on [0, 1]] = 8/9
    assert kept_wait(P, u, 1.0) == pytest.approx(8 / 9, abs=1e-4)
    assert kept_wait(P, u, 5.0) == pytest.approx(2 * 8 / 9, abs=1e-4)
    # drops repeat the generation; the step is consistent with its own drop fraction
    o = predict_one_step_off(P, u, take_order="completion")
    d = o.parts["drop"]
    assert 0 < d < 0.9
    assert d == pytest.approx(stale_drop_fraction(P, u, 1.0, 2 * o.step_s - 0.5), abs=1e-6)
    life = (1.0 + expected_max(u, 8) + 0.5) / 2
    assert o.step_s == pytest.approx(max(1.0 / (1 - d) + 0.5, life / (1 - d)), rel=1e-6)
    # and fewer groups are dropped with a looser staleness bound
    o2 = predict_one_step_off(P, u, max_staleness=2, batches_ahead=3, take_order="completion")
    assert o2.parts["drop"] < d and o2.step_s < o.step_s


def test_fully_async_pipelines():
    lin = power_speedup(2.0)  # linear: s(n) = n
    assert lin(4) == pytest.approx(4)
    f = predict_fully_async(P, HALF_S, lin, trainer_threads=1, rollout_threads=1, lend_cores=False)
    # trainer 0.5 s x 2 = 1; rollout 1 s x 2 = 2; latency (2 + 0.5 + 1) / 2 = 1.75: generation,
    # the batch's slowest wait and the update that frees its slots, over two batches of cap
    assert f.parts["trainer"] == pytest.approx(1.0)
    assert f.parts["rollout"] == pytest.approx(2.0)
    assert f.parts["latency"] == pytest.approx(1.75)
    assert f.step_s == pytest.approx(2.0) and f.bound == "rollout compute"
    assert f.staleness == pytest.approx(1.0)  # lifetime 2.5 s / 2 s step, capped at 1
    # no thread gain (s(2) = 1): the trainer's 0.5 s and the rollout's 1 s run side by side;
    # latency (1 + 0.5 + 0.5) / 2 = 1.0: a tie with the rollout, which is named
    flat = predict_fully_async(P, HALF_S, power_speedup(1.0), lend_cores=False)
    assert flat.step_s == pytest.approx(1.0) and flat.bound == "rollout compute"
    assert flat.parts["latency"] == pytest.approx(1.0)
    slow = predict_fully_async(P, Latency("const", 3.5), power_speedup(1.0), lend_cores=False)
    assert slow.step_s == pytest.approx(2.5) and slow.bound == "latency (in-flight cap)"
    # Little's law: a group holds its slot for its generation (2 s), its own slowest wait (the
    # max of 8 uniform waits on [0, 2] s: 16/9) and the update (1 s), over two batches of
    # slots; some groups outlast the staleness bound, and their refills hold slots again
    u = predict_fully_async(P, Latency("uniform", lo=0.0, hi=2.0), lin, lend_cores=False)
    assert u.parts["latency"] == pytest.approx((2 + 16 / 9 + 1) / 2, abs=1e-3)
    assert 0 < u.parts["drop"] < 0.9 and u.bound == "latency (in-flight cap)"
    assert u.step_s == pytest.approx(u.parts["latency"] / (1 - u.parts["drop"]), rel=1e-6)
    # the trainer 1.5x slower beside its replica (measured contention): 0.5 x 2 x 1.5 = 1.5
    busy = predict_fully_async(P, HALF_S, lin, contention=1.5, lend_cores=False)
    assert busy.parts["trainer"] == pytest.approx(1.5) and busy.step_s == pytest.approx(2.0)
    # contention only while the replica computes: work 1, push 0, replica busy 0.5 s per
    # step, c = 2: T = 1 + 0.5/T  ->  T = (1 + sqrt(3)) / 2
    assert contended_time(1.0, 0.0, 0.5, 2.0) == pytest.approx((1 + 3**0.5) / 2)
    assert contended_time(1.0, 0.2, 0.5, 1.0) == pytest.approx(1.2)
    assert fully_async_staleness(0.3, 1.0, 2) == pytest.approx(0.3)
    assert fully_async_staleness(5.0, 1.0, 2) == 2.0


def test_fully_async_on_lent_cores():
    """The trainer runs on its own thread while the replica computes, on both threads (the
    replica's lent) while it idles."""
    lin = power_speedup(2.0)
    assert lent_time(1.0, 0.5, 0.4, 1.0) == pytest.approx(0.4 + 0.6 * 0.5)
    assert lent_time(1.0, 0.5, 0.4, 2.0) == pytest.approx(0.4 + 0.8 * 0.5)  # slowed beside it
    assert lent_time(1.0, 0.5, 3.0, 1.5) == pytest.approx(1.5)  # the replica never rests
    # the replica computes 0.4 s a step (G 0.2 s on 2 threads, no overhead outside the engine)
    light = Profile(**{**P.__dict__, "gen_compute_s": 0.2, "gen_s": 0.2})
    f = predict_fully_async(light, Latency("const", 0.0), lin)
    own = predict_fully_async(light, Latency("const", 0.0), lin, lend_cores=False)
    assert own.parts["trainer"] == pytest.approx(1.0)  # 0.5 s on 2 threads = 1 s on 1
    assert f.parts["trainer"] == pytest.approx(0.4 + 0.6 * 0.5)
    assert f.step_s < own.step_s and f.bound == own.bound == "trainer"
    # a busy replica lends nothing: the same as its own cores
    busy = predict_fully_async(P, HALF_S, lin)
    assert busy.parts["trainer"] == pytest.approx(1.0)
    # the generation's overhead outside the engine keeps the replica busy too (O = 0.3 s)
    slow = Profile(**{**light.__dict__, "gen_s": 0.5})
    f = predict_fully_async(slow, Latency("const", 0.0), lin)
    assert f.parts["trainer"] == pytest.approx(0.7 + 0.3 * 0.5)
    # latency-bound (every call waits 3.5 s): the update that frees a slot runs on both
    # threads, 0.5 s, since nothing new generates until it ends (the replicas' own pipeline
    # still pays the contended 1 s, as a trainer bound would)
    waits = predict_fully_async(P, Latency("const", 3.5), lin)
    assert waits.bound == "latency (in-flight cap)" and waits.parts["trainer"] == pytest.approx(1.0)
    assert waits.parts["latency"] == pytest.approx((2.0 + 3.5 + 0.5) / 2)
    # on its own cores it lends nothing, and the slot holds the 1 s update
    alone = predict_fully_async(P, Latency("const", 3.5), lin, lend_cores=False)
    assert alone.parts["latency"] == pytest.approx((2.0 + 3.5 + 1.0) / 2)


def test_the_trainer_converts_threads_with_the_updates_own_speedup():
    """The update and the generation scale differently across threads: the trainer's time on
    lent cores uses ``update_speedup``, the replica's busy time ``speedup``."""
    gen_s, upd = power_speedup(1.5), power_speedup(2.0)
    light = Profile(**{**P.__dict__, "gen_compute_s": 0.2, "gen_s": 0.2})
    f = predict_fully_async(light, Latency("const", 0.0), gen_s, update_speedup=upd)
    # the replica busy 0.2 × 1.5 = 0.3 s; the update 0.5 s × 2 = 1 s on its own thread, 0.5 s
    # on both
    assert f.parts["rollout"] == pytest.approx(0.3)
    assert f.parts["trainer"] == pytest.approx(0.3 + (1 - 0.3 / 1.0) * 0.5)
    same = predict_fully_async(light, Latency("const", 0.0), gen_s, update_speedup=gen_s)
    assert same.parts == predict_fully_async(light, Latency("const", 0.0), gen_s).parts
    # an update that scales better loses more while it runs on one thread
    assert f.parts["trainer"] > same.parts["trainer"]


def test_the_updates_speedup_is_timed_on_the_engines_training_pass(tiny_model_dir):
    """``kind="update"`` times the engine's packed forward and backward (its own loader, so
    the fused kernels where they build); an unknown kind is refused by name."""
    from postrl.bench import modes

    t = modes.measure_work_time(1, str(tiny_model_dir), reps=1, kind="update")
    assert t > 0
    work = modes._WORK[(str(tiny_model_dir), "update")]
    assert work is not modes._work_of(str(tiny_model_dir), "generation")
    assert modes.measure_speedup(2, str(tiny_model_dir), reps=1, kind="update") > 0
    with pytest.raises(ValueError, match="work kind 'decode'"):
        modes.measure_speedup(2, str(tiny_model_dir), kind="decode")


def test_extrapolate_splits_workers():
    e = extrapolate(P, HALF_S, rollout_workers=3, trainer_workers=1)
    assert e["sync"].step_s == pytest.approx(1 / 4 + 0.5 + 0.5 / 4)  # G, U over 4 workers
    # fully_async: trainer 0.5, rollout 1/3, latency (1/3 + 0.5 + 0.5) / 2: two batches of
    # cap are not enough to hide a 0.5 s wait behind a 0.5 s update; three are
    fa = e["fully_async"]
    assert fa.step_s == pytest.approx((1 / 3 + 1) / 2) and fa.bound == "latency (in-flight cap)"
    e3 = extrapolate(P, HALF_S, rollout_workers=3, trainer_workers=1, max_staleness=2)
    assert e3["fully_async"].step_s == pytest.approx(0.5) and e3["fully_async"].bound == "trainer"


def test_profile_and_cli_from_metrics(tmp_path, capsys):
    rows = [
        {"timing_s/step": 9.0, "timing_s/gen": 9.0, "timing_s/gen_engine": 9.0},  # warm-up
        {
            "timing_s/step": 2.0,
            "timing_s/gen": 1.5,
            "timing_s/gen_engine": 1.0,
            "agent/num_tool_calls": 1.0,
        },
        {
            "timing_s/step": 2.0,
            "timing_s/gen": 1.5,
            "timing_s/gen_engine": 1.0,
            "agent/num_tool_calls": 1.0,
        },
    ]
    prof = profile_from_rows(rows[1:], 64, 8, 2)
    assert (prof.gen_compute_s, prof.after_gen_s, prof.calls_per_traj) == (1.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="timing_s/gen_engine"):
        profile_from_rows([{"timing_s/step": 1.0, "timing_s/gen": 0.5}], 64, 8, 2)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "plan.json"
    argv = ["--metrics", str(path), "--latency", "const:500", "--trajectories", "64"]
    main(
        [
            *argv,
            "--group-size",
            "8",
            "--speedup",
            "2",
            "--contention",
            "1",
            "--workers",
            "3,1",
            "--out",
            str(out),
        ]
    )
    plan = json.loads(out.read_text())
    assert plan["predicted"]["sync"]["samples_per_s"] == pytest.approx(32)
    # trainer 0.5; latency (1/3 + 0.5 + 0.5) / 2: see test_extrapolate_splits_workers
    assert plan["extrapolated"]["3,1"]["fully_async"]["step_s"] == pytest.approx((1 / 3 + 1) / 2)
    assert "one_step_off" in capsys.readouterr().out


def test_validate_against_a_benchmark_output():
    """The sync runs of an async_modes.py output give the profile; each mode's measured median
    sits next to its prediction (the tail workload's log-normal latency from its settings)."""
    row = {
        "timing_s/step": 2.0,
        "timing_s/gen": 1.5,
        "timing_s/gen_engine": 1.0,
        "agent/num_tool_calls": 1.0,
        "trajectories": 64.0,
        "groups": 8.0,
    }
    results = {
        "settings": {"threads": 2, "fa_threads": None, "tail_latency": [500, 0.0, 50, 2000]},
        "workloads": {
            "tail": {
                "runs": [{"mode": "sync", "steps": [row] * 4}],
                "speedup": [2.0, 2.0],
                "median": {
                    "sync": {"samples_per_s": 32.0, "staleness_mean": None},
                    "fully_async": {"samples_per_s": 40.0, "staleness_mean": 1.0},
                },
            }
        },
    }
    v = validate_bench(results, "tail", None)
    assert v["latency"]["a"] == pytest.approx(0.5)  # sigma 0: every call waits the median
    assert v["predicted"]["sync"]["samples_per_s"] == pytest.approx(32, rel=1e-3)
    assert v["error"]["sync"] == pytest.approx(0.0, abs=1e-3)
    # trainer 1 s, rollout 2 s (linear speed-up, 1 + 1 threads): 32/s against 40 measured
    assert v["error"]["fully_async"] == pytest.approx(32 / 40 - 1, abs=1e-3)
    assert v["update_speedup_measured"] is None  # an older output: `speedup` for both
    # the update's own speed-up, where the benchmark measured it, sets the trainer's time
    results["workloads"]["tail"]["update_speedup"] = [1.5]
    u = validate_bench(results, "tail", None)
    assert u["update_speedup_measured"] == pytest.approx(1.5)
    # U 0.5 s on 2 threads is 0.75 s on the trainer's one (the replica never rests to lend)
    assert u["predicted"]["fully_async"]["parts"]["trainer"] == pytest.approx(0.75)
    assert u["predicted"]["fully_async"]["parts"]["rollout"] == pytest.approx(2.0)
