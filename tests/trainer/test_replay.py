"""The replay buffer (``postrl/trainer/asynchronous/replay/``): decisions from tags only,
event-driven wake-ups, staleness counted in the tokens' policy versions, whole-group eviction with
exact refills, admission pacing, and a JSON checkpoint round trip.

The buffer never reads a payload, so most payloads here are poison objects that raise on any
access (the proof that sampling, staleness and eviction decide from tags), and the rollouts of
the property test are asyncio tasks whose "latency" is a random number of event-loop turns
(random completion orders without wall-clock sleeps). The last test runs a real native replica
with a weight update mid-generation and checks the buffer against the real token versions.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pytest

from postrl.trainer.asynchronous.replay import (
    SAMPLERS,
    AdmissionError,
    GroupTags,
    ReplayBuffer,
    ReplayTimeoutError,
    TrajectoryStatus,
    build_sampler,
    version_range,
)


class Poison:
    """A payload that raises on any access: attribute, len, bool, repr, eq, hash, iter."""

    def __init__(self, key: tuple[str, int]) -> None:
        object.__setattr__(self, "_key", key)

    def __getattribute__(self, name: str) -> Any:
        raise AssertionError(f"payload read: .{name}")

    def _boom(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("payload read")

    __len__ = __bool__ = __repr__ = __str__ = __eq__ = __hash__ = __iter__ = _boom  # type: ignore


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def finish_group(buf: ReplayBuffer, uid: str, version: int, *, lens=None, scores=None) -> list:
    """Finish every trajectory of ``uid`` with poison payloads generated at ``version``."""
    payloads = []
    for k in range(buf.group_size):
        p = Poison((uid, k))
        payloads.append(p)
        buf.finish(
            (uid, k),
            p,
            prompt_len=3,
            response_len=(lens[k] if lens else 5),
            versions=[(5, version)],
            score=None if scores is None else scores[k],
        )
    return payloads


# ---------------------------------------------------------------------------- tags


def test_version_range_ignores_empty_segments():
    # A trajectory resumed twice: 4 tokens on v2, 0 on v3 (aborted before a token), 6 on v4.
    assert version_range([(4, 2), (0, 3), (6, 4)]) == (2, 4)
    assert version_range([]) == (None, None)
    assert version_range([(0, 7)]) == (None, None)
    assert version_range([(3, -1), (2, 5)]) == (5, 5)  # -1: tool/observation tokens


def test_group_age_counts_from_the_oldest_token_not_the_dispatch_step():
    buf = ReplayBuffer(2, 1, max_staleness=5)
    buf.admit(["g"], dispatch_step=1, version=0)
    # Dispatched at step 1 on version 0, but generated (resumed) on versions 3 and 4:
    # verl's dispatch-step age at version 4 would be 4 − 0 = 4; the tokens say 4 − 3 = 1.
    buf.finish(("g", 0), Poison(("g", 0)), prompt_len=2, response_len=3, versions=[(3, 3)])
    g = buf.groups()[0]
    assert not g.complete and g.age(4) == 4  # incomplete: counted from admission (lower bound)
    buf.finish(("g", 1), Poison(("g", 1)), prompt_len=2, response_len=3, versions=[(1, 3), (2, 4)])
    g = buf.groups()[0]
    assert g.complete and (g.min_version, g.max_version) == (3, 4)
    assert g.age(4) == 1


# ---------------------------------------------------------------------------- data plane


class TagsOnlySampler:
    """Newest first; records what it was given (must be GroupTags, nothing else)."""

    seen: list[Any] = []

    def select(self, groups: Sequence[GroupTags], k: int, current_version: int) -> list[str]:
        TagsOnlySampler.seen.extend(groups)
        return [g.uid for g in sorted(groups, key=lambda g: -g.seq)[:k]]


def test_decisions_never_read_a_payload():
    """Admission, completion, failure, DAPO filtering, stale eviction, sampling (custom sampler
    by import path), metrics and the checkpoint state run over payloads that raise on any access;
    only ``assemble`` hands them back (the same objects)."""
    TagsOnlySampler.seen = []
    buf = ReplayBuffer(
        2,
        2,
        max_staleness=1,
        strategy="drop",
        sampler=f"{__name__}:TagsOnlySampler",
        filter_groups=True,
    )
    buf.admit(["a", "b", "c", "d"], dispatch_step=0)
    pa = finish_group(buf, "a", 0, scores=[0.0, 1.0])
    finish_group(buf, "b", 0, scores=[1.0, 1.0])  # uninformative → filtered
    buf.start(("c", 0))
    buf.fail(("c", 0), "reward timeout")
    buf.finish(("c", 1), Poison(("c", 1)), prompt_len=1, response_len=2, versions=[(2, 0)], score=1)
    pd = finish_group(buf, "d", 0, scores=[0.0, 1.0])
    assert [e.reason for e in buf.pop_refills()] == ["filtered", "failed"]
    json.dumps(buf.state_dict())
    buf.metrics()
    uids = run(buf.sample(2, current_version=1))
    assert sorted(uids) == ["a", "d"]
    assert TagsOnlySampler.seen and all(isinstance(g, GroupTags) for g in TagsOnlySampler.seen)
    # Stale eviction: admitted at version 1, trained at version 3 → age 2 > 1 → evicted unread.
    buf.set_version(2)
    buf.admit(["e", "f"], dispatch_step=1, version=1)
    finish_group(buf, "e", 1, scores=[0.0, 1.0])
    finish_group(buf, "f", 1, scores=[0.0, 1.0])
    with pytest.raises(ReplayTimeoutError):
        run(buf.sample(2, current_version=3, timeout_s=0.05))
    assert sorted(e.uid for e in buf.pop_refills()) == ["e", "f"]
    out = buf.assemble(uids)
    by_key = {tag.key: p for tag, p in out}
    assert by_key[("a", 0)] is pa[0] and by_key[("a", 1)] is pa[1] and by_key[("d", 1)] is pd[1]
    assert len(buf.store) == 0  # evicted payloads discarded, assembled ones released


# ---------------------------------------------------------------------------- event-driven


def test_sample_wakes_within_milliseconds_of_the_last_trajectory():
    """The sampler sleeps on an event the last finish sets; verl's buffer polls every 2 s, so a
    poll would wake ~1 s late on average. 7 trials; the median bound is 50 ms and no trial may
    come near a poll's period, even on a loaded 2-core machine."""

    async def trial(i: int) -> float:
        buf = ReplayBuffer(2, 1)
        uid = f"g{i}"
        buf.admit([uid], dispatch_step=0)
        task = asyncio.create_task(buf.sample(1, current_version=0, timeout_s=30))
        await asyncio.sleep(0.02)  # the sampler is now blocked
        assert not task.done()
        buf.finish((uid, 0), Poison((uid, 0)), prompt_len=1, response_len=1, versions=[(1, 0)])
        await asyncio.sleep(0.01)
        assert not task.done()  # half a group does not wake it
        t_last = time.perf_counter()
        buf.finish((uid, 1), Poison((uid, 1)), prompt_len=1, response_len=1, versions=[(1, 0)])
        assert await task == [uid]
        return time.perf_counter() - t_last

    latencies = [run(trial(i)) for i in range(7)]
    assert statistics.median(latencies) < 0.05, latencies
    assert max(latencies) < 1.0, latencies


def test_a_sample_cancelled_as_its_batch_completes_takes_nothing():
    """The group completes and the sampler is cancelled in the same loop iteration (a take
    that gave up on a short batch): the sampler must stop and leave the group in the buffer.
    With ``asyncio.wait_for`` (Python < 3.12) the cancellation was swallowed, the sampler took
    the group anyway, and a later sampler waited for groups that were gone (a DAPO run hung at
    step 149 of the quickstart task)."""

    async def main() -> None:
        buf = ReplayBuffer(2, 1)
        buf.admit(["g"], dispatch_step=0)
        task = asyncio.create_task(buf.sample(1, current_version=0, timeout_s=30))
        await asyncio.sleep(0.02)  # blocked on its waiter
        finish_group(buf, "g", 0)  # resolves the waiter ...
        task.cancel()  # ... and the cancel lands before the sampler runs again
        await asyncio.wait({task})
        assert task.cancelled(), f"the cancelled sampler returned {task.result()}"
        assert [g.uid for g in buf.groups()] == ["g"], "a cancelled sampler took the group"
        assert await buf.sample(1, timeout_s=5) == ["g"]  # the next take gets it

    run(main())


def test_no_wakeups_without_state_changes():
    """While nothing changes, a waiting sampler evaluates its condition once: no timer loop."""

    async def main() -> int:
        buf = ReplayBuffer(1, 1)
        buf.admit(["g"], dispatch_step=0)
        calls = 0
        orig = buf._try_select

        def counting(k: int, v: int) -> list[str]:
            nonlocal calls
            calls += 1
            return orig(k, v)

        buf._try_select = counting  # type: ignore[method-assign]
        task = asyncio.create_task(buf.sample(1, timeout_s=30))
        await asyncio.sleep(0.3)
        idle_calls = calls
        buf.finish(("g", 0), Poison(("g", 0)), prompt_len=1, response_len=1, versions=[(1, 0)])
        await task
        return idle_calls

    assert run(main()) == 1


def test_waits_have_deadlines_and_name_what_they_waited_for():
    buf = ReplayBuffer(2, 2, max_staleness=0)
    buf.admit(["a", "b"], dispatch_step=0)
    finish_group(buf, "a", 0)
    t0 = time.perf_counter()
    with pytest.raises(ReplayTimeoutError, match=r"2 complete groups .* 1 complete, 1 in flight"):
        run(buf.sample(timeout_s=0.1))
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(ReplayTimeoutError, match="room to admit 1 groups"):
        run(buf.wait_admit(1, timeout_s=0.05))


# ---------------------------------------------------------------------------- pacing & refill


def test_admission_pacing_cap_and_release_on_new_version():
    buf = ReplayBuffer(1, 2, max_staleness=1)  # cap (1 + 1) × 2 = 4
    assert buf.capacity == 4 and buf.can_admit() == 4
    buf.admit(["a", "b", "c"], dispatch_step=0)
    with pytest.raises(AdmissionError, match="only 1 may be admitted"):
        buf.admit(["d", "e"], dispatch_step=0)
    with pytest.raises(AdmissionError, match="twice"):
        buf.admit(["a"], dispatch_step=0)
    for u in "abc":
        finish_group(buf, u, 0)
    run(buf.sample(2, current_version=0))
    # Sampled at version 0 still counts until the update lands (its successors would be
    # generated on version 0 and must be trainable by version 1).
    assert buf.can_admit() == 1
    buf.set_version(1)
    assert buf.can_admit() == 3


def test_failed_and_filtered_groups_are_refilled_exactly_with_metrics():
    buf = ReplayBuffer(2, 2, filter_groups=True, max_failure_ratio=0.5, max_staleness=1)
    buf.admit(["a", "b", "c", "d"], dispatch_step=0)
    finish_group(buf, "a", 0, lens=[4, 6], scores=[1.0, 1.0])  # filtered
    buf.fail(("b", 0), "x")
    buf.fail(("b", 1), "y")  # 2/2 failed > 0.5 → failed
    buf.fail(("c", 0), "x")  # 1/2 failed: kept (c has 1 valid... and distinct scores? no)
    buf.finish(("c", 1), Poison(("c", 1)), prompt_len=1, response_len=8, versions=[(8, 0)], score=0)
    # c: one valid score → fewer than 2 distinct → filtered as DAPO does (count > 1 & std > 0).
    finish_group(buf, "d", 0, lens=[10, 20], scores=[0.0, 1.0])
    refills = buf.pop_refills()
    assert [(e.uid, e.reason) for e in refills] == [
        ("a", "filtered"),
        ("b", "failed"),
        ("c", "filtered"),
    ]
    assert buf.pop_refills() == []  # reported once
    assert buf.can_admit() == 4 - 1  # only d holds a slot
    buf.admit(["a2", "b2", "c2"], dispatch_step=0)
    finish_group(buf, "a2", 0, lens=[2, 2], scores=[0.0, 1.0])
    uids = run(buf.sample(2, current_version=0, timeout_s=5))
    assert uids == ["d", "a2"]
    m = buf.metrics()
    assert m["replay/evicted/filtered"] == 2 and m["replay/evicted/failed"] == 1
    assert m["replay/evicted/stale"] == 0
    assert m["replay/dropped_len_mean"] == pytest.approx((4 + 6 + 8) / 3)
    assert m["replay/kept_len_mean"] == pytest.approx((10 + 20 + 2 + 2) / 4)
    assert m["replay/staleness/max"] == 0 and m["replay/occupancy"] == pytest.approx(4 / 4)
    assert len(buf.assemble(uids)) == 4


def test_finish_with_filtering_needs_a_score():
    buf = ReplayBuffer(2, 1, filter_groups=True)
    buf.admit(["a"], dispatch_step=0)
    with pytest.raises(ValueError, match="pass score="):
        buf.finish(("a", 0), object(), prompt_len=1, response_len=1, versions=[(1, 0)])


def test_wait_strategy_waits_for_the_group_that_would_go_stale():
    """s=2, B=1. g1, g2 admitted at v0 stay in flight; g4 (v1) is ready. Taking g4 at v1 would
    leave two groups due by v2 with one update left → the wait strategy waits for g1; drop takes
    g4 at once."""
    for strategy, expect in (("wait", "g1"), ("drop", "g4")):

        async def main(strategy: str = strategy) -> list[str]:
            buf = ReplayBuffer(1, 1, max_staleness=2, strategy=strategy)
            buf.admit(["g1", "g2", "g3"], dispatch_step=0, version=0)
            finish_group(buf, "g3", 0)
            assert await buf.sample(1, current_version=0) == ["g3"]
            buf.set_version(1)
            buf.admit(["g4"], dispatch_step=1)
            finish_group(buf, "g4", 1)
            task = asyncio.create_task(buf.sample(1, current_version=1, timeout_s=10))
            await asyncio.sleep(0.02)
            finish_group(buf, "g1", 1)
            return await task

        assert run(main()) == [expect], strategy


# ---------------------------------------------------------------------------- property test


async def simulate(rng: random.Random, strategy: str) -> dict[str, Any]:
    """A producer admits prompts under the pacing cap (one refill per eviction on top of the
    base budget); each trajectory is a task generating chunks over random event-loop turns,
    each chunk on the version current at that moment (partial rollout across updates); the
    trainer samples, checks every invariant against the simulation's own record, and advances
    the version."""
    n, B, s = rng.randint(1, 4), rng.randint(1, 3), rng.randint(0, 3)
    steps = rng.randint(3, 8)
    p_fail = rng.choice([0.0, 0.1])
    filt = n > 1 and rng.random() < 0.5
    buf = ReplayBuffer(
        n,
        B,
        max_staleness=s,
        strategy=strategy,
        filter_groups=filt,
        max_failure_ratio=0.5 if n > 1 else 0.0,
        timeout_s=20,
    )
    version = 0
    truth: dict[tuple[str, int], list[int]] = {}  # versions of every chunk, per trajectory
    admitted: list[str] = []
    sampled: list[str] = []
    evicted: list[str] = []
    trained_before_version = 0
    stop = asyncio.Event()

    async def trajectory(key: tuple[str, int]) -> None:
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        buf.start(key)
        chunks = [version]
        for _ in range(rng.randint(1, 4)):
            for _ in range(rng.choice([0, 1, 2, 8, 30])):  # long tails
                await asyncio.sleep(0)
            chunks.append(version)
        truth[key] = chunks
        if rng.random() < p_fail:
            buf.fail(key, "injected")
        else:
            buf.finish(
                key,
                Poison(key),
                prompt_len=2,
                response_len=len(chunks),
                versions=[(1, v) for v in chunks],
                score=float(rng.random() < 0.5),
            )

    tasks: list[asyncio.Task] = []

    async def producer() -> None:
        i = 0
        while not stop.is_set():
            if buf.can_admit() == 0:
                waiter = asyncio.ensure_future(buf.wait_admit(1, timeout_s=30))
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                continue
            evicted.extend(e.uid for e in buf.pop_refills())  # the refill requests
            uid = f"p{i}"
            i += 1
            keys = buf.admit([uid], dispatch_step=version)
            admitted.append(uid)
            # Pacing: untrained groups (incl. those sampled at this version) within the cap.
            untrained = len(admitted) - len(evicted) - trained_before_version
            assert untrained <= (s + 1) * B
            tasks.extend(asyncio.create_task(trajectory(k)) for k in keys)
            await asyncio.sleep(0)

    evicted_by_metric = dict.fromkeys(("stale", "filtered", "failed"), 0)
    prod = asyncio.create_task(producer())
    for _ in range(steps):
        task = asyncio.ensure_future(buf.sample(B, current_version=version))
        await asyncio.wait({task, prod}, return_when=asyncio.FIRST_COMPLETED)
        if prod.done():  # the producer's own assertion failed
            task.cancel()
            prod.result()
        uids = task.result()
        m = buf.metrics()
        for r in evicted_by_metric:
            evicted_by_metric[r] += int(m[f"replay/evicted/{r}"])
        out = buf.assemble(uids)
        assert len(uids) == B
        finished = {t.key for t, _ in out}
        assert {key[0] for key in finished} == set(uids)
        for uid in uids:
            assert all((uid, k) in truth for k in range(n)), "partial group sampled"
            age = version - min(truth[key][0] for key in finished if key[0] == uid)
            assert age <= s, (uid, age, s)
        assert m["replay/staleness/max"] <= s
        sampled += uids
        for _ in range(rng.randint(0, 5)):  # training time: the rollout keeps going
            await asyncio.sleep(0)
        trained_before_version = len(sampled)
        version += 1
        buf.set_version(version)
    stop.set()
    await prod
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    evicted += [e.uid for e in buf.pop_refills()]
    m = buf.metrics()
    for r in evicted_by_metric:
        evicted_by_metric[r] += int(m[f"replay/evicted/{r}"])
    return dict(
        admitted=admitted,
        sampled=sampled,
        evicted=evicted,
        left=[g.uid for g in buf.groups()],
        evicted_by_metric=evicted_by_metric,
    )


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_property_random_completion_orders(strategy):
    """80 seeded trials per strategy: every sampled group is complete and within max_staleness
    (its age recomputed from the simulated token versions); every admitted group ends sampled,
    evicted (exactly one refill each, never also sampled) or still in the buffer; ``wait`` never
    drops for staleness; ``drop`` does drop (the bound is exercised)."""
    totals = dict.fromkeys(("stale", "filtered", "failed"), 0)
    for seed in range(80):
        rng = random.Random(1000 * (strategy == "wait") + seed)
        r = asyncio.run(simulate(rng, strategy))
        adm, smp, evi, left = r["admitted"], r["sampled"], r["evicted"], r["left"]
        assert len(set(evi)) == len(evi), "a group was reported for refill twice"
        assert sorted(adm) == sorted(smp + evi + left)  # each admitted group in exactly one
        assert sum(r["evicted_by_metric"].values()) == len(evi)  # one refill per eviction
        for k, v in r["evicted_by_metric"].items():
            totals[k] += v
    assert totals["filtered"] > 0 and totals["failed"] > 0, totals
    if strategy == "wait":
        assert totals["stale"] == 0, totals
    else:
        assert totals["stale"] > 0, totals  # the long tails do outrun the bound under drop


# ---------------------------------------------------------------------------- samplers


class LongestFirst:
    """A custom sampler loaded by import path."""

    def select(self, groups: Sequence[GroupTags], k: int, current_version: int) -> list[str]:
        return [g.uid for g in sorted(groups, key=lambda g: -sum(g.response_lens))[:k]]


class Broken:
    def select(self, groups: Sequence[GroupTags], k: int, current_version: int) -> list[str]:
        return [groups[0].uid] * k


def test_samplers_registry_and_import_path():
    assert "oldest_first" in SAMPLERS
    with pytest.raises(KeyError, match="did you mean 'oldest_first'"):
        build_sampler("oldest_frist")
    with pytest.raises(ValueError, match="cannot import"):
        build_sampler("no_such_module_xyz:Cls")
    buf = ReplayBuffer(1, 1, max_staleness=1, sampler=f"{__name__}:LongestFirst")
    buf.admit(["short", "long"], dispatch_step=0)
    finish_group(buf, "short", 0, lens=[3])
    finish_group(buf, "long", 0, lens=[9])
    assert run(buf.sample(1)) == ["long"]
    bad = ReplayBuffer(1, 2, sampler=f"{__name__}:Broken")
    bad.admit(["a", "b"], dispatch_step=0)
    finish_group(bad, "a", 0)
    finish_group(bad, "b", 0)
    with pytest.raises(ValueError, match=r"sampler '.*Broken' returned 2 uids \(1 distinct"):
        run(bad.sample(2))


def test_oldest_first_orders_by_token_version_then_dispatch():
    buf = ReplayBuffer(1, 3, max_staleness=3)
    buf.set_version(3)
    buf.admit(["new", "old", "mid"], dispatch_step=0, version=0)
    finish_group(buf, "new", 3)
    finish_group(buf, "old", 1)
    finish_group(buf, "mid", 2)
    assert run(buf.sample(3)) == ["old", "mid", "new"]


def test_bad_settings_name_every_field():
    with pytest.raises(ValueError) as e:
        ReplayBuffer(0, 0, max_staleness=-1, strategy="drp", max_failure_ratio=2)
    for field in ("group_size", "batch_groups", "max_staleness", "staleness_strategy", "ratio"):
        assert field in str(e.value)


# ---------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_through_json():
    buf = ReplayBuffer(2, 2, max_staleness=1, strategy="drop", filter_groups=True)
    buf.set_version(2)
    buf.admit(["a", "b", "c", "d"], dispatch_step=4)
    finish_group(buf, "a", 2, scores=[0.0, 1.0])  # ready
    finish_group(buf, "b", 2, scores=[1.0, 1.0])  # filtered: pending refill
    buf.start(("c", 0))  # running
    buf.finish(("c", 1), {"row": 1}, prompt_len=1, response_len=2, versions=[(2, 2)], score=0.0)
    # d: both pending
    payloads = {k: {"tokens": list(k)} for k in buf.payloads()}  # persisted as rows
    state = json.loads(json.dumps(buf.state_dict()))
    new = ReplayBuffer(2, 2, max_staleness=1, strategy="drop", filter_groups=True)
    new.load_state_dict(state, payloads)
    assert new.version == 2 and new.can_admit() == buf.can_admit()
    assert [e.uid for e in new.pop_refills()] == ["b"]
    assert sorted(new.pending_keys()) == [("c", 0), ("d", 0), ("d", 1)]  # running → pending
    assert [g.uid for g in new.ready()] == ["a"]
    tags = {t.key: t for g in new.groups() for t in g.tags}
    assert tags[("c", 1)].status is TrajectoryStatus.FINISHED and tags[("c", 1)].min_version == 2
    with pytest.raises(AdmissionError):
        new.admit(["b"], dispatch_step=5)  # an evicted uid is not re-admitted
    for key in new.pending_keys():
        new.finish(key, {"row": 2}, prompt_len=1, response_len=2, versions=[(2, 2)], score=1.0)
    uids = run(new.sample(2, current_version=2))
    assert uids == ["a", "c"]
    assert [t.key for t, _ in new.assemble(uids)] == [("a", 0), ("a", 1), ("c", 0), ("c", 1)]
    with pytest.raises(ValueError, match="group_size"):
        ReplayBuffer(3, 2).load_state_dict(state, payloads)
    with pytest.raises(KeyError, match="no payload"):
        ReplayBuffer(2, 2).load_state_dict(state, {})


# ---------------------------------------------------------------------------- real rollout


def test_real_rollout_feeds_tags_and_assembles_the_same_batch(tiny_model_factory):
    """A real native replica, the resuming client and the agent manager: trajectories enter the
    buffer from ``on_sample_end`` as they finish; a weight update lands mid-generation (pause,
    update, resume), so tokens carry versions 0 and 1. The buffer's ages are exactly
    ``1 − oldest token version`` of each group (from ``response_versions``); with
    ``max_staleness=0`` and ``drop`` exactly the groups holding version-0 tokens are evicted;
    and the payloads the buffer hands back assemble into the manager's own batch."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from postrl.agent import AgentLoopManager
    from postrl.config.schema import AgentConfig
    from postrl.protocol import DataProto
    from postrl.rollout import RolloutClient, RolloutReplica, SamplingParams, create_rollout_backend
    from postrl.testing import make_tokenizer

    d = tiny_model_factory("qwen2")
    be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=256)
    replica = RolloutReplica(be)
    mgr = AgentLoopManager(
        RolloutClient(replica), make_tokenizer(), AgentConfig(default_agent_loop="single_turn")
    )
    prompts = DataProto.from_dict(
        {"dummy": torch.zeros(3, 1)},
        {
            "raw_prompt_ids": np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9]], dtype=object),
            "index": np.array([0, 1, 2]),
        },
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
    buf = ReplayBuffer(2, 3, max_staleness=1, strategy="wait", timeout_s=300)
    buf.admit(["0-0", "0-1", "0-2"], dispatch_step=0, version=0)
    outputs: dict[tuple[str, int], Any] = {}

    def on_end(i: int, out: Any, row: dict[str, Any]) -> None:
        key = (row["uid"], int(row["sample_index"]))
        outputs[key] = (out, row)
        buf.finish(
            key,
            (out, row),
            prompt_len=len(out.prompt_ids),
            response_len=len(out.response_ids),
            versions=out.response_versions,
        )

    async def main() -> tuple[DataProto, dict[str, int], list[str]]:
        task = asyncio.create_task(
            mgr.generate(prompts, sp, 2, seed=0, step=0, on_sample_end=on_end)
        )
        while be.num_running == 0 or int(be.s_ngen[0]) < 5:
            await asyncio.sleep(0.002)
        replica.pause()
        await asyncio.sleep(0.05)  # the aborted partials return (stamped v0) before the update
        replica.update_weights(load_file(str(d / "model.safetensors")).items())  # v0 -> v1
        replica.resume()
        batch = await asyncio.wait_for(task, 300)
        buf.set_version(1)
        truth = {
            uid: 1 - min(version_range(outputs[(uid, k)][0].response_versions)[0] for k in (0, 1))
            for uid in ("0-0", "0-1", "0-2")
        }
        assert {g.uid: g.age(1) for g in buf.groups()} == truth
        assert 1 in truth.values()  # the update did cut at least one group
        return batch, truth, await buf.sample(3, current_version=1)

    batch, truth, uids = run(main())
    rows = buf.assemble(uids)
    rebuilt = mgr.assemble([p[0] for _, p in rows], [p[1] for _, p in rows])
    order = sorted(
        range(len(batch)),
        key=lambda i: (batch.non_tensor_batch["uid"][i], batch.non_tensor_batch["sample_index"][i]),
    )
    mine = sorted(
        range(len(rebuilt)),
        key=lambda i: (
            rebuilt.non_tensor_batch["uid"][i],
            rebuilt.non_tensor_batch["sample_index"][i],
        ),
    )
    for name in ("responses", "response_mask", "rollout_log_probs", "rollout_policy_version"):
        assert torch.equal(batch.batch[name][order], rebuilt.batch[name][mine]), name

    # The same trajectories through a buffer with max_staleness=0 and drop: exactly the groups
    # holding version-0 tokens are evicted at version 1, one refill each; the rest stay ready.
    strict = ReplayBuffer(2, 3, max_staleness=0, strategy="drop")
    strict.set_version(1)
    strict.admit(["0-0", "0-1", "0-2"], dispatch_step=0, version=0)
    for key, (out, row) in outputs.items():
        strict.finish(key, (out, row), prompt_len=1, response_len=1, versions=out.response_versions)
    with pytest.raises(ReplayTimeoutError):
        run(strict.sample(3, current_version=1, timeout_s=0.2))
    stale = {uid for uid, age in truth.items() if age == 1}
    refills = strict.pop_refills()
    assert {e.uid for e in refills} == stale and len(refills) == len(stale)
    assert {e.reason for e in refills} == {"stale"}
    assert {g.uid for g in strict.ready()} == set(truth) - stale


def test_a_group_scored_as_a_whole_owns_its_payloads_through_generated_and_a_checkpoint():
    """``generated``: tokens done, payload stored, the group's score to come (not complete, not
    sampled); ``finish`` replaces the payload, ``fail`` with a payload keeps the tokens (a
    reward failure trains masked); the group's dataset index and epoch travel with it, through
    ``state_dict`` / ``payloads`` and into an eviction (a stale group is refilled with itself)."""
    buf = ReplayBuffer(2, 1, max_staleness=1, max_failure_ratio=0.5, strategy="drop")
    buf.admit(["a", "b"], dispatch_step=3, indices=[7, 9], epoch=2)
    for k in range(2):
        buf.start(("a", k))
        buf.generated(("a", k), f"raw{k}", prompt_len=3, response_len=4 + k, versions=[(4, 0)])
    snap = buf.group("a")
    assert snap.generated and not snap.complete and (snap.index, snap.epoch) == (7, 2)
    assert buf.scoring_payloads("a") == ["raw0", "raw1"]
    assert buf.ready() == []
    buf.finish(("a", 0), "scored0", prompt_len=3, response_len=4, versions=[(4, 0)], score=1.0)
    buf.fail(("a", 1), "reward", payload="scored1")  # 1 of 2 failed: within the ratio, kept
    assert buf.group("a").complete and buf.group("a").tags[1].min_version is None

    state = json.loads(json.dumps(buf.state_dict()))
    payloads = buf.payloads()
    assert payloads == {("a", 0): "scored0", ("a", 1): "scored1"}
    new = ReplayBuffer(2, 1, max_staleness=1, max_failure_ratio=0.5, strategy="drop")
    new.load_state_dict(state, payloads)
    assert (new.group("b").index, new.group("b").epoch) == (9, 2)
    uids = asyncio.run(new.sample(1))
    assert uids == ["a"]
    assert [p for _, p in new.assemble(uids)] == ["scored0", "scored1"]

    evicted = []
    new.on_evict = evicted.append
    new.set_version(3)
    for k in range(2):
        new.start(("b", k))
        new.finish(("b", k), k, prompt_len=1, response_len=1, versions=[(1, 0)])
    with pytest.raises(ReplayTimeoutError):
        asyncio.run(new.sample(1, timeout_s=0.01))
    assert [(e.uid, e.reason, e.index, e.epoch) for e in evicted] == [("b", "stale", 9, 2)]


def test_a_stale_complete_group_does_not_count_as_ready_for_a_take():
    """A complete group older than ``max_staleness`` is evicted by the take, so it must not count
    towards the batch: deterministic ``one_step_off`` pauses the fleet when ``on_ready`` reports
    a full batch, and a count with a stale group in it paused the fleet one group short of the
    batch (the take then waited for paused trajectories until its deadline)."""
    from types import SimpleNamespace

    from postrl.trainer.asynchronous.stream import GroupStream

    buf = ReplayBuffer(2, 2, max_staleness=1, strategy="drop")
    buf.admit(["old"], dispatch_step=0, version=0)
    buf.admit(["new"], dispatch_step=1, version=1)
    for uid, v in (("old", 0), ("new", 1)):
        for k in range(2):
            buf.finish((uid, k), f"{uid}{k}", prompt_len=1, response_len=1, versions=[(1, v)])
    buf.set_version(2)  # "old" is now 2 versions old: past the bound
    assert [g.uid for g in buf.ready()] == ["old", "new"]
    assert [g.uid for g in buf.takeable()] == ["new"]

    ctx = SimpleNamespace(runner=SimpleNamespace(scores_groups=False), sampling_params=dict)
    stream = GroupStream(ctx, buf, score_on_completion=False)
    counts: list[int] = []
    stream.on_ready = counts.append
    stream._ready_check()
    assert counts == [1]  # one takeable group: a batch of 2 is not complete
    with pytest.raises(ReplayTimeoutError):  # the take evicts "old" and waits for a second
        asyncio.run(buf.sample(2, timeout_s=0.05))
    assert [e.uid for e in buf.pop_refills()] == ["old"]


@pytest.mark.parametrize("order", ["completion", "admission"])
def test_take_order_admission_never_lets_a_fast_group_overtake_a_slow_one(order):
    """``take_order=admission`` takes the groups admitted first once all of them are complete
    (verl's one-step-off batches), whatever finished first; ``completion`` takes what is
    complete. Stale heads are still evicted, and the next admitted group moves up."""
    buf = ReplayBuffer(1, 2, max_staleness=1, strategy="drop", take_order=order, capacity=8)
    buf.admit(["slow", "fast1", "fast2"], dispatch_step=0, version=0)
    for uid in ("fast1", "fast2"):
        buf.finish((uid, 0), uid, prompt_len=1, response_len=1, versions=[(1, 0)])
    if order == "completion":
        assert [g.uid for g in buf.takeable()] == ["fast1", "fast2"]
        assert asyncio.run(buf.sample(2, timeout_s=0.05)) == ["fast1", "fast2"]
        return
    assert buf.takeable() == []  # "slow" is ahead and still generating
    with pytest.raises(ReplayTimeoutError):
        asyncio.run(buf.sample(2, timeout_s=0.05))
    buf.finish(("slow", 0), "slow", prompt_len=1, response_len=9, versions=[(9, 0)])
    assert [g.uid for g in buf.takeable()] == ["slow", "fast1", "fast2"]
    assert asyncio.run(buf.sample(2, current_version=1)) == ["slow", "fast1"]

    # a head that completes too old is evicted (refilled behind the others), not waited for
    buf.admit(["late", "next"], dispatch_step=1, version=1)
    buf.finish(("next", 0), "next", prompt_len=1, response_len=1, versions=[(1, 2)])
    assert asyncio.run(buf.sample(1, current_version=1)) == ["fast2"]  # admitted before both
    buf.finish(("late", 0), "late", prompt_len=1, response_len=1, versions=[(1, 1)])
    assert asyncio.run(buf.sample(1, current_version=3)) == ["next"]
    assert [e.uid for e in buf.pop_refills()] == ["late"]


def test_take_order_is_checked():
    with pytest.raises(ValueError, match="take_order='newest'"):
        ReplayBuffer(1, 1, take_order="newest")
