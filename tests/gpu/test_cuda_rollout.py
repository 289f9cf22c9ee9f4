"""Rollout on CUDA: the native engine (torch-op path) and the ``hf`` backend against plain
transformers on the same GPU, and weight sync into a CUDA engine against a reload."""

from __future__ import annotations

import asyncio

import pytest
import torch

from postrl.rollout import SamplingParams, create_rollout_backend
from postrl.weights import FrameStream, create_weight_sync, encode_frame, pack_buckets

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 20, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lens]


def _gen(be, prompts, sps):
    async def run():
        return await asyncio.gather(
            *[be.generate(p, s, f"r{i}") for i, (p, s) in enumerate(zip(prompts, sps))]
        )

    return asyncio.run(run())


def _hf_greedy(model, prompt: list[int], device: str, n: int = 12) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_native_greedy_equals_transformers(device, tiny_model_factory, arch):
    """Token for token, fp32 on both sides, on the same device (the native engine decodes with
    torch ops there: its fused C kernels are CPU-only)."""
    from transformers import AutoModelForCausalLM

    d = tiny_model_factory(arch)
    be = create_rollout_backend(
        "native", d, max_num_seqs=8, max_model_len=128, device=device, kernels="torch"
    )
    try:
        assert be.kernels is None and be.device.type == device
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()
        prompts = _prompts(6, seed=1)
        outs = _gen(be, prompts, [GREEDY] * len(prompts))
        for p, o in zip(prompts, outs):
            assert o.token_ids == _hf_greedy(model, p, device), f"{arch}: prompt {p}"
            assert o.finish_reason == "length" and len(o.log_probs) == 12
    finally:
        be.close()


def test_hf_backend_on_device(device, tiny_model_dir):
    """The ``hf`` backend runs ``generate`` on the device and agrees with the native engine
    there: greedy tokens equal, log-probs within 1e-4, stop tokens honoured."""
    hf = create_rollout_backend("hf", tiny_model_dir, device=device)
    nat = create_rollout_backend(
        "native", tiny_model_dir, max_num_seqs=4, max_model_len=64, device=device
    )
    try:
        assert next(hf.model.parameters()).device.type == device
        prompts = [[1, 2, 3, 4], [9, 8, 7], [100, 101, 102, 103, 104, 105]]
        sps = [
            SamplingParams(temperature=0, max_new_tokens=6 + i, ignore_eos=True) for i in range(3)
        ]
        a, b = _gen(hf, prompts, sps), _gen(nat, prompts, sps)
        for x, y, s in zip(a, b, sps):
            assert x.token_ids == y.token_ids and len(x.token_ids) == s.max_new_tokens
            torch.testing.assert_close(
                torch.tensor(x.log_probs), torch.tensor(y.log_probs), atol=1e-4, rtol=0
            )
        stop = a[0].token_ids[2]
        sp = SamplingParams(
            temperature=0, max_new_tokens=6, stop_token_ids=(stop,), ignore_eos=True
        )
        out = asyncio.run(hf.generate(prompts[0], sp, "s"))
        assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    finally:
        nat.close()


@pytest.mark.parametrize("frames", [False, True], ids=["tensors", "frames"])
@pytest.mark.parametrize("name", ["naive", "bucketed"])
def test_weight_sync_into_device_engine_equals_reload(device, tiny_model_factory, name, frames):
    """CPU tensors (or encoded bucket frames, the Ray actor's stream) synced into an engine on
    the device leave exactly the weights a fresh engine loads from disk — every tensor equal and
    still on the device — and the two sample the same tokens with the same seed."""
    from safetensors.torch import load_file

    d0, d1 = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    kw = dict(max_num_seqs=4, max_model_len=64, device=device)
    be = create_rollout_backend("native", d0, **kw)
    fresh = create_rollout_backend("native", d1, **kw)
    try:
        new = load_file(str(d1 / "model.safetensors"))  # CPU tensors, as the actor yields them
        sync = create_weight_sync(name, **({"bucket_bytes": 100_000} if name == "bucketed" else {}))
        source = iter(sorted(new.items()))
        if frames:
            source = FrameStream(encode_frame(b) for b in pack_buckets(source, 100_000, version=3))
        stats = sync.sync_weights(source, [be], version=3)
        assert stats.num_tensors == len(new) and be.weight_version == 3
        views, ref = be.weights.views, fresh.weights.views
        assert set(views) == set(ref)
        for k in ref:
            assert views[k].device.type == device and torch.equal(views[k], ref[k]), k
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)
        a, b = _gen(be, [[5, 6, 7]], [sp])[0], _gen(fresh, [[5, 6, 7]], [sp])[0]
        assert a.token_ids == b.token_ids and a.log_probs == b.log_probs
    finally:
        be.close()
        fresh.close()
