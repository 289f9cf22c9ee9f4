"""Resuming client, replica pause/update, and load balancing."""

from __future__ import annotations

import asyncio

from postrl.rollout import (
    LoadBalancer,
    RolloutClient,
    RolloutReplica,
    SamplingParams,
    create_rollout_backend,
)


def test_client_resumes_across_weight_update(tiny_model_factory):
    from safetensors.torch import load_file

    d = tiny_model_factory("qwen2")
    be = create_rollout_backend("native", d, max_num_seqs=4, max_model_len=512)
    replica = RolloutReplica(be)
    client = RolloutClient(replica)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sp = SamplingParams(temperature=0, max_new_tokens=120, ignore_eos=True)
    ref = asyncio.run(client.generate(prompt, sp, "ref"))
    weights = load_file(str(d / "model.safetensors"))

    async def run():
        task = asyncio.create_task(client.generate(prompt, sp, "r1"))
        while be.num_running == 0 or int(be.s_ngen[0]) < 5:
            await asyncio.sleep(0.002)
        replica.pause()  # aborts the in-flight segment; the client re-sends after resume
        await asyncio.sleep(0.05)
        replica.update_weights(weights.items())  # same values: greedy continuation must match
        replica.resume()
        return await asyncio.wait_for(task, 300)

    out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.token_ids) == 120 == len(out.log_probs)
    assert out.token_ids == ref.token_ids
    assert [v for _, v in out.versions] == [0, 1] and sum(n for n, _ in out.versions) == 120
    assert out.versions[0][0] >= 5


def test_versions_stay_exact_when_the_update_follows_pause_at_once(tiny_model_factory):
    """Tokens sampled before a pause keep the version they were sampled with even when the
    weight update runs right after ``pause()``, before the aborted call has returned."""
    from safetensors.torch import load_file

    d = tiny_model_factory("qwen2")
    be = create_rollout_backend("native", d, max_num_seqs=4, max_model_len=512)
    replica = RolloutReplica(be)
    client = RolloutClient(replica)
    sp = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    weights = load_file(str(d / "model.safetensors"))

    async def run():
        task = asyncio.create_task(client.generate([3, 1, 4, 1, 5], sp, "r1"))
        while be.num_running == 0 or int(be.s_ngen[0]) < 5:
            await asyncio.sleep(0.002)
        replica.pause()
        replica.update_weights(weights.items())  # no yield between pause and update
        replica.resume()
        return await asyncio.wait_for(task, 300)

    out = asyncio.run(run())
    assert [v for _, v in out.versions] == [0, 1] and out.versions[0][0] >= 5
    assert sum(n for n, _ in out.versions) == 60


def test_client_abort_is_final(tiny_model_dir):
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=1024)
    client = RolloutClient(be)

    async def run():
        task = asyncio.create_task(
            client.generate(
                [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True), "x"
            )
        )
        while be.num_running == 0 or int(be.s_ngen[0]) < 3:
            await asyncio.sleep(0.002)
        client.abort("x")
        return await asyncio.wait_for(task, 30)

    out = asyncio.run(run())
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 1000


def test_load_balancer_least_loaded_and_sticky(tiny_model_dir):
    reps = [
        RolloutReplica(
            create_rollout_backend("native", tiny_model_dir, max_num_seqs=8, max_model_len=64), i
        )
        for i in range(2)
    ]
    lb = LoadBalancer(reps)
    client = RolloutClient(lb)
    sp = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    seen: list[int] = []
    orig = [r.generate for r in reps]
    for i, r in enumerate(reps):

        async def wrapped(*a, _i=i, **k):
            seen.append(_i)
            return await orig[_i](*a, **k)

        r.generate = wrapped

    async def run():
        return await asyncio.gather(*[client.generate([5, 6, i], sp, f"q{i}") for i in range(8)])

    asyncio.run(run())
    assert sorted(seen) == [0] * 4 + [1] * 4  # least loaded alternates
    seen.clear()

    async def turns():
        for t in range(
            3
        ):  # the same trajectory's turns go to one replica even when others are idle
            await client.generate([7, t], sp, f"turn{t}", trajectory_id="traj-A")

    asyncio.run(turns())
    assert len(set(seen)) == 1
