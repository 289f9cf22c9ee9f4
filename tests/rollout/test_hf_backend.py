"""The hf backend agrees with the native engine on greedy tokens and log-probs."""

from __future__ import annotations

import asyncio

import torch

from postrl.rollout import SamplingParams, create_rollout_backend


def test_hf_backend_greedy_matches_native(tiny_model_dir):
    hf = create_rollout_backend("hf", tiny_model_dir)
    nat = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=64)
    prompts = [[1, 2, 3, 4], [9, 8, 7], [100, 101, 102, 103, 104, 105]]
    sps = [SamplingParams(temperature=0, max_new_tokens=6 + i, ignore_eos=True) for i in range(3)]

    async def run(be):
        return await asyncio.gather(
            *[be.generate(p, s, str(i)) for i, (p, s) in enumerate(zip(prompts, sps))]
        )

    a, b = asyncio.run(run(hf)), asyncio.run(run(nat))
    for x, y, s in zip(a, b, sps):
        assert x.token_ids == y.token_ids and len(x.token_ids) == s.max_new_tokens
        torch.testing.assert_close(
            torch.tensor(x.log_probs), torch.tensor(y.log_probs), atol=1e-4, rtol=0
        )
    stop = a[0].token_ids[2]
    out = asyncio.run(
        hf.generate(
            prompts[0],
            SamplingParams(
                temperature=0, max_new_tokens=6, stop_token_ids=(stop,), ignore_eos=True
            ),
            "s",
        )
    )
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
