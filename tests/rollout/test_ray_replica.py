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
