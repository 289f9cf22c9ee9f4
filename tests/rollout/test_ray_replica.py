"""The Ray replica serves the same tokens as the in-process one and takes bucketed weights."""

from __future__ import annotations

import asyncio
import os

import pytest

from postrl.rollout import RolloutClient, RolloutReplica, SamplingParams, create_rollout_backend

ray = pytest.importorskip("ray")


@pytest.mark.skipif(os.environ.get("POSTRL_SKIP_RAY") == "1", reason="POSTRL_SKIP_RAY=1")
def test_ray_replica_matches_local(tiny_model_factory):
    from safetensors.torch import load_file

    from postrl.rollout.ray_replica import RayRolloutReplica

    d0, d1 = tiny_model_factory("qwen2"), tiny_model_factory("qwen2", seed=1)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        remote = RayRolloutReplica.create("native", str(d0), max_num_seqs=4, max_model_len=64)
        local = RolloutReplica(
            create_rollout_backend("native", d1, max_num_seqs=4, max_model_len=64)
        )
        sp = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=2)
        remote.update_weights(
            load_file(str(d1 / "model.safetensors")).items(), version=3, bucket_bytes=200_000
        )
        assert remote.policy_version == 3

        async def both():
            return (
                await RolloutClient(remote).generate([1, 2, 3], sp, "a"),
                await RolloutClient(local).generate([1, 2, 3], sp, "b"),
            )

        a, b = asyncio.run(both())
        assert a.token_ids == b.token_ids and a.versions == [(6, 3)]
    finally:
        ray.shutdown()


@pytest.mark.skipif(os.environ.get("POSTRL_SKIP_RAY") == "1", reason="POSTRL_SKIP_RAY=1")
def test_a_hung_ray_replica_is_declared_dead_and_its_requests_reissued(tiny_model_factory):
    """A SIGSTOPped replica actor misses its health pings: the watchdog declares it dead within
    its timeout, the requests waiting on it finish on the other replica, and ``kill`` frees its
    CPU for a replacement on the same resources."""
    import signal

    from postrl.rollout import LoadBalancer, ReplicaDeadError
    from postrl.rollout.ray_replica import RayRolloutReplica
    from postrl.rollout.watchdog import ReplicaWatchdog

    d0 = tiny_model_factory("qwen2")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        reps = [
            RayRolloutReplica.create(
                "native", str(d0), i, threads=1, max_num_seqs=4, max_model_len=96
            )
            for i in range(2)
        ]
        hung, alive = reps
        client = RolloutClient(LoadBalancer(reps))
        sp = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=3)
        dog = ReplicaWatchdog(reps, interval_s=0.2, timeout_s=3)

        async def run():
            watch = asyncio.ensure_future(dog.run())
            await dog.check()
            assert hung.busy_s >= 0 and not hung.dead
            os.kill(hung.pid, signal.SIGSTOP)
            tasks = [
                asyncio.ensure_future(client.generate([1, 2, 3], sp, f"h{i}", trajectory_id="t"))
                for i in range(3)
            ]  # sticky: all routed to the first pick, the hung replica (least loaded, index 0)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            watch.cancel()
            return outs

        outs = asyncio.run(run())
        assert hung.dead and "/health" in hung.dead_reason, hung.dead_reason
        assert all(len(o.token_ids) == 64 for o in outs)
        assert client.reissued >= 1 and not alive.dead and dog.failures == 1
        with pytest.raises(ReplicaDeadError):
            hung.pause()
        hung.kill()
        again = RayRolloutReplica.create(
            "native", str(d0), 0, threads=1, startup_timeout_s=60, max_num_seqs=4, max_model_len=96
        )  # the killed actor's CPU is free again
        assert again.pid != hung.pid and not again.dead
    finally:
        ray.shutdown()
