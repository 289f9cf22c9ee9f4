"""engine/fused.py: a model whose norms, MLPs and attention run the fused training kernels
computes what the same model computes on torch's ops; ``model.kernels`` chooses, and says why
when the kernels cannot run."""

from __future__ import annotations

import pytest
import torch

from postrl.config.schema import ModelConfig
from postrl.engine import fused
from postrl.engine.logprob import policy_logprobs
from postrl.engine.model import load_policy
from postrl.engine.varlen import FUSED_ATTENTION
from postrl.kernels import train as T


def _logprobs(pol, batch, **kw):
    """The packed, prefix-shared log-probs (and entropy) of ``batch``'s 6 response tokens."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    return policy_logprobs(pol.decoder, pol.lm_head, ids, mask, 6, share_prefix=True, **kw)


def _close(a, b, rel):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a - b).abs().max().item() <= rel * scale, ((a - b).abs().max().item(), scale)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.skipif(T.load() is None, reason="the training kernels did not build")
def test_a_fused_model_computes_what_torch_ops_compute(tiny_model_factory, make_batch, arch):
    """load_policy with model.kernels=auto fuses every norm, MLP and attention of the tiny model;
    its packed log-probs and the gradient of a loss on them equal those of kernels=torch."""
    d = tiny_model_factory(arch=arch)
    batch = make_batch(num_prompts=3, n=3, seed=1)
    results = {}
    for mode in ("torch", "auto"):
        pol = load_policy(ModelConfig(path=str(d), kernels=mode))
        attn = [m for m in pol.decoder.modules() if getattr(m, FUSED_ATTENTION, False)]
        names = {type(m).__name__ for m in pol.decoder.modules()}
        fused_mods = [m for m in pol.decoder.modules() if type(m) in fused._subclasses.values()]
        if mode == "auto":
            layers = pol.causal_lm.config.num_hidden_layers
            assert len(attn) == layers
            assert len(fused_mods) == 2 * layers + 1 + layers + layers  # norms, MLPs, attention
        else:
            assert not attn and not fused_mods
        lp, ent = _logprobs(pol, batch, temperature=0.7, calculate_entropy=True)
        (lp.sum() + ent.sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in pol.causal_lm.parameters()])
        results[mode] = (lp.detach(), ent.detach(), grads, names)
    (lp0, ent0, g0, n0), (lp1, ent1, g1, n1) = results["torch"], results["auto"]
    assert n0 == n1  # the fused classes keep their names
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    _close(g1, g0, rel=1e-4)


@pytest.mark.skipif(T.load() is None, reason="the training kernels did not build")
def test_rope_is_fused_only_inside_fused_attention(tiny_model_dir, make_batch, monkeypatch):
    """The wrapped ``apply_rotary_pos_emb`` is module-global; a ``kernels=torch`` model loaded
    after a fused one still runs torch's RoPE."""
    calls = []
    real = T.rope
    monkeypatch.setattr(T, "rope", lambda *a: calls.append(1) or real(*a))
    batch = make_batch(num_prompts=2, n=2, seed=0)
    for mode, fused_calls in (("auto", True), ("torch", False)):
        pol = load_policy(ModelConfig(path=str(tiny_model_dir), kernels=mode))
        calls.clear()
        with torch.no_grad():
            _logprobs(pol, batch)
        assert bool(calls) == fused_calls, mode


def test_kernels_fused_says_why_it_cannot_run(monkeypatch, tiny_model_dir):
    once = T._ONCE
    monkeypatch.setattr(T, "_ONCE", type(once)(once.src, once.prefix, once.wrap, once.what))
    monkeypatch.setenv("POSTRL_KERNELS", "0")
    with pytest.raises(RuntimeError, match="POSTRL_KERNELS=0.*model.kernels=auto or torch"):
        load_policy(ModelConfig(path=str(tiny_model_dir), kernels="fused"))
    pol = load_policy(ModelConfig(path=str(tiny_model_dir), kernels="auto"))  # falls back
    assert not any(getattr(m, FUSED_ATTENTION, False) for m in pol.decoder.modules())


def test_bf16_compute_keeps_torch_ops(tiny_model_dir, make_batch):
    """Under bf16 autocast the fused modules call their original forward (no dtype error)."""
    batch = make_batch(num_prompts=2, n=2, seed=0)
    pol = load_policy(ModelConfig(path=str(tiny_model_dir), compute_dtype="bfloat16"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = _logprobs(pol, batch)
    assert torch.isfinite(lp).all()
