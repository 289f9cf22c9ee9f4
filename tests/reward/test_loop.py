"""Reward-loop isolation: every misbehaviour is caught, counted by reason, and never scored.

The misbehaving user function lives in a tmp ``.py`` file loaded by path (the custom-function
route), so it runs in spawned, killable worker processes exactly as a user's would.
"""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest
import torch

from postrl.reward import (
    REWARD_FNS,
    RewardError,
    RewardFailureError,
    RewardLoop,
    RewardRequest,
    register_reward_fn,
)

USER_FN = textwrap.dedent(
    """
    import math, os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        kind = solution_str
        if kind == "raise":
            raise ValueError("boom from user code")
        if kind == "hang":
            time.sleep(600)
        if kind == "nan":
            return float("nan")
        if kind == "inf":
            return {"score": math.inf}
        if kind == "none":
            return None
        if kind == "str":
            return "1.0"
        if kind == "nokey":
            return {"acc": 1.0}
        if kind == "crash":
            os._exit(3)
        if kind == "dict":
            return {"score": 0.5, "acc": 1.0, "len": len(str(ground_truth))}
        return float(kind)

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0] * (len(solution_strs) - 1)  # one short: a contract error

    def batch_ok(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s) for s in solution_strs]
    """
)

REASONS = ("exception", "timeout", "nan", "none", "bad_type", "crash")


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(USER_FN)
    return path


@pytest.fixture(scope="module")
def loop(user_file):
    lp = RewardLoop(timeout_s=1.0, num_workers=2, custom_fn_path=str(user_file))
    lp.start()
    yield lp
    lp.close()


def _reqs(kinds):
    return [RewardRequest("anything", k, "gt", {"i": i}, uid=i) for i, k in enumerate(kinds)]


def _check_invariant(result):
    m = result.metrics
    assert m["reward/generated"] == len(result)
    assert m["reward/generated"] == m["reward/scored"] + m["reward/failed/total"]
    assert m["reward/failed/total"] == sum(m[f"reward/failed/{r}"] for r in REASONS)
    assert int(result.valid.sum()) == m["reward/scored"]


def test_isolation_counts_every_sample(loop, caplog):
    kinds = ["1.0", "raise", "hang", "nan", "inf", "none", "str", "nokey", "dict", "0.25", "raise"]
    pids_before = loop._pool.pids
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        res = loop.score(_reqs(kinds))
    elapsed = time.monotonic() - t0
    # the hang is killed at timeout_s=1.0, never waited on (plus a replacement spawn)
    assert elapsed < 8.0, elapsed
    assert res.failure_reason == [
        None,
        "exception",
        "timeout",
        "nan",
        "nan",
        "none",
        "bad_type",
        "bad_type",
        None,
        None,
        "exception",
    ]
    assert res.valid.tolist() == [r is None for r in res.failure_reason]
    # valid scores are the values returned; failed samples hold a 0.0 placeholder only
    torch.testing.assert_close(
        res.scores, torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0.5, 0.25, 0]), rtol=0, atol=0
    )
    m = res.metrics
    assert (m["reward/failed/exception"], m["reward/failed/timeout"], m["reward/failed/nan"]) == (
        2,
        1,
        2,
    )
    assert (m["reward/failed/none"], m["reward/failed/bad_type"], m["reward/failed/crash"]) == (
        1,
        2,
        0,
    )
    assert (m["reward/scored"], m["reward/failed/total"], m["reward/generated"]) == (3, 8, 11)
    _check_invariant(res)
    # extras from dict returns, None where absent (the "inf" dict had no extra keys)
    assert res.extra == {"acc": [None] * 8 + [1.0, None, None], "len": [None] * 8 + [2, None, None]}
    assert res.uids == list(range(11))
    assert "boom from user code" in res.failure_detail[1]
    # first traceback of each reason logged once (2 exceptions -> 1 log line)
    exc_logs = [r for r in caplog.records if "reward failed (exception)" in r.getMessage()]
    assert len(exc_logs) == 1 and "ValueError: boom" in exc_logs[0].getMessage()
    # the hung worker was killed and replaced
    assert loop.pool_stats["killed_timeout"] >= 1
    assert loop._pool.pids != pids_before


def test_crashed_worker_is_replaced(loop):
    res = loop.score(_reqs(["crash", "2.0", "3.0"]))
    assert res.failure_reason == ["crash", None, None]
    assert res.scores.tolist() == [0.0, 2.0, 3.0]
    _check_invariant(res)
    # the pool still works afterwards
    assert loop.score(_reqs(["4.0"] * 4)).scores.tolist() == [4.0] * 4


def test_submit_gather_and_ascore(loop):
    futs = [loop.submit(r) for r in _reqs(["1.0", "raise", "0.5"])]
    res = loop.gather(futs, uids=[7, 8, 9])
    assert res.failure_reason == [None, "exception", None]
    assert res.uids == [7, 8, 9]
    res2 = asyncio.run(loop.ascore(_reqs(["none", "0.75"])))
    assert res2.failure_reason == ["none", None] and res2.scores.tolist() == [0.0, 0.75]


def test_max_failure_ratio(user_file):
    with RewardLoop(timeout_s=1.0, num_workers=1, max_failure_ratio=0.25) as lp:
        lp._custom = None  # route by data_source (inline built-in, no processes needed)
        ok = lp.score([RewardRequest("addition", "5", "5"), RewardRequest("addition", "x", "5")])
        lp.check_failures(ok)  # wrong answers are scores, not failures
    with RewardLoop(
        timeout_s=1.0, num_workers=1, custom_fn_path=str(user_file), max_failure_ratio=0.25
    ) as lp:
        res = lp.score(_reqs(["1.0", "raise", "nan", "2.0"]))
        with pytest.raises(
            RewardFailureError, match=r"(?s)2/4 .*exception=1, nan=1.*boom from user code"
        ):
            lp.check_failures(res)
        lp.max_failure_ratio = 0.5
        lp.check_failures(res)  # exactly at the ratio: allowed


def test_batch_function_wrong_length_names_fn_and_lengths(user_file):
    with RewardLoop(
        timeout_s=2.0,
        num_workers=1,
        custom_fn_path=str(user_file),
        custom_fn_name="batch_fn",
        custom_fn_batch=True,
    ) as lp:
        with pytest.raises(RewardError, match=r"'batch_fn'.*returned 2 scores for 3 samples"):
            lp.score(_reqs(["1", "2", "3"]))
        with pytest.raises(RewardError, match="batch-level"):
            lp.submit(_reqs(["1"])[0])
    with RewardLoop(
        timeout_s=2.0,
        num_workers=1,
        custom_fn_path=str(user_file),
        custom_fn_name="batch_ok",
        custom_fn_batch=True,
    ) as lp:
        res = lp.score(_reqs(["1", "nan", "3"]))
        assert res.failure_reason == [None, "nan", None] and res.scores.tolist() == [1.0, 0.0, 3.0]


def test_inline_registered_functions_are_isolated_too():
    calls = {"n": 0}

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        calls["n"] += 1
        return {"raise": lambda: 1 / 0, "nan": lambda: float("nan"), "none": lambda: None}.get(
            solution_str, lambda: 1.0
        )()

    def inline_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return torch.tensor([1.0, 2.0])  # tensors are accepted as the list of scores

    register_reward_fn("_test_flaky", inline=True)(flaky)
    register_reward_fn("_test_batch", inline=True, batch=True)(inline_batch)
    register_reward_fn("_test_lambda")(lambda *a: 1.0)  # not inline: must be importable
    try:
        with RewardLoop(num_workers=1) as lp:
            reqs = [RewardRequest("_test_flaky", s, None) for s in ("ok", "raise", "nan", "none")]
            reqs += [
                RewardRequest("_test_batch", "a", None),
                RewardRequest("_test_batch", "b", None),
            ]
            res = lp.score(reqs)
            assert res.failure_reason == [None, "exception", "nan", "none", None, None]
            assert res.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 2.0]
            _check_invariant(res)
            assert lp._pool._thread is None  # inline only: no process was ever started
            with pytest.raises(RewardError, match="not importable by name"):
                lp.score([RewardRequest("_test_lambda", "x", None)])
            with pytest.raises(KeyError, match="unknown reward function"):
                lp.score([RewardRequest("nope", "x", None)])
    finally:
        for name in ("_test_flaky", "_test_batch", "_test_lambda"):
            REWARD_FNS._eager.pop(name, None)
            REWARD_FNS._meta.pop(name, None)


def test_builtin_hot_path_is_fast():
    with RewardLoop() as lp:
        reqs = [RewardRequest("addition", f"the sum is {i}", str(i)) for i in range(2000)]
        lp.score(reqs[:10])
        t0 = time.perf_counter()
        res = lp.score(reqs)
        per_sample = (time.perf_counter() - t0) / len(reqs)
    assert res.scores.sum().item() == 2000
    # measured ~10 us idle (~40 us under load); the bound only catches per-sample process or
    # thread spawning (>= 1 ms), not scheduler noise on a loaded 2-core box
    assert per_sample < 1e-3, per_sample


def test_isolate_builtin_runs_registered_fn_in_workers_and_close_reaps(user_file):
    lp = RewardLoop(timeout_s=5.0, num_workers=2, isolate_builtin=True)
    reqs = [RewardRequest("addition", str(i), str(i if i % 2 else -1)) for i in range(6)]
    res = lp.score(reqs)
    assert res.scores.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert res.valid.all() and res.extra["acc"] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    procs = [s.proc for s in lp._pool._slots]
    assert all(p.is_alive() for p in procs)  # the function ran in these worker processes
    lp.close()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RewardError, match="closed"):
        lp.score(reqs)


def test_batch_function_timeout_fails_whole_call(tmp_path):
    f = tmp_path / "b.py"
    f.write_text("import time\ndef slow(ds, ss, gts, eis):\n    time.sleep(600)\n")
    with RewardLoop(
        timeout_s=0.5,
        num_workers=1,
        custom_fn_path=str(f),
        custom_fn_name="slow",
        custom_fn_batch=True,
    ) as lp:
        t0 = time.monotonic()
        res = lp.score(_reqs(["1", "2"]))
        assert time.monotonic() - t0 < 8.0
    assert res.failure_reason == ["timeout", "timeout"]
    _check_invariant(res)


@pytest.mark.slow
def test_math_scored_in_worker_process():
    pytest.importorskip("math_verify")
    with RewardLoop(timeout_s=30.0, num_workers=1) as lp:
        res = lp.score(
            [
                RewardRequest("math", "so $\\boxed{\\frac{1}{2}}$", "0.5"),
                RewardRequest("lighteval/MATH", "so $\\boxed{3}$", "4"),
            ]
        )
    assert res.scores.tolist() == [1.0, 0.0] and res.valid.all()


KIND_VALUES = {
    "ok": 1.0,
    "int": 3,
    "bool": True,
    "dict": {"score": 0.5, "acc": 1.0},
    "nan": float("nan"),
    "inf": float("-inf"),
    "none": None,
    "str": "x",
    "nokey": {"acc": 1.0},
    "dictnone": {"score": None},
}
KIND_REASON = {
    "nan": "nan",
    "inf": "nan",
    "none": "none",
    "dictnone": "none",
    "str": "bad_type",
    "nokey": "bad_type",
    "raise": "exception",
}


def _kind_fn(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("x")
    return KIND_VALUES[solution_str]


def test_accounting_invariant_on_random_mixes():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    register_reward_fn("_test_kinds", inline=True)(_kind_fn)
    try:
        lp = RewardLoop(num_workers=1)

        @hypothesis.settings(max_examples=60, deadline=None)
        @hypothesis.given(st.lists(st.sampled_from([*KIND_VALUES, "raise"]), max_size=40))
        def check(kinds):
            res = lp.score([RewardRequest("_test_kinds", k, None) for k in kinds])
            _check_invariant(res)
            assert res.failure_reason == [KIND_REASON.get(k) for k in kinds]
            for k, s, v in zip(kinds, res.scores.tolist(), res.valid.tolist()):
                assert v == (k not in KIND_REASON)
                expected = {"ok": 1.0, "int": 3.0, "bool": 1.0, "dict": 0.5}.get(k, 0.0)
                assert s == expected

        check()
    finally:
        REWARD_FNS._eager.pop("_test_kinds", None)
        REWARD_FNS._meta.pop("_test_kinds", None)
