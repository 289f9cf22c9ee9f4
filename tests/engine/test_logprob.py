"""Padding-free log-probs equal the padded HF computation; entropy matches its definition."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from postrl.config.schema import ModelConfig
from postrl.engine.logprob import chunked_token_logprobs, policy_logprobs
from postrl.engine.model import load_policy


def _padded_reference(model_dir, batch, temperature):
    """Plain HF forward on the padded batch (sdpa + 2D mask), log-softmax over the full vocab."""
    ref = AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation="sdpa", dtype=torch.float32
    )
    ids, am = batch.batch["input_ids"], batch.batch["attention_mask"]
    r = batch.batch["responses"].shape[1]
    with torch.no_grad():
        logits = ref(
            input_ids=ids, attention_mask=am, position_ids=batch.batch["position_ids"]
        ).logits
    logits = logits[:, -r - 1 : -1].float() / temperature  # (B, R, V): state t-1 predicts token t
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, ids[:, -r:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    m = am[:, -r:].float()
    return lp * m, ent * m


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("share", [False, True])
def test_packed_equals_padded(tiny_model_factory, make_batch, arch, share):
    d = tiny_model_factory(arch=arch)
    batch = make_batch(num_prompts=3, n=3, seed=1)
    pol = load_policy(ModelConfig(path=str(d)))
    ref_lp, ref_ent = _padded_reference(d, batch, 0.7)
    with torch.no_grad():
        lp, ent = policy_logprobs(
            pol.decoder,
            pol.lm_head,
            batch.batch["input_ids"],
            batch.batch["attention_mask"],
            6,
            temperature=0.7,
            calculate_entropy=True,
            share_prefix=share,
        )
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


def test_chunked_logprobs_and_entropy_by_hand():
    # Two tokens, vocab 3. Row 0 logits [0, 0, 0]: log p = -log 3 for every y, H = log 3.
    # Row 1 logits [ln 2, 0, 0] / T with T = 1: p = [1/2, 1/4, 1/4]; H = 1.5 ln 2.
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    h = torch.tensor([[0.0, 0.0], [torch.log(torch.tensor(2.0)), 0.0]])
    y = torch.tensor([1, 0])
    for chunk in (1, 8):  # chunking (with checkpoint under grad) must not change values
        lp, ent = chunked_token_logprobs(
            h.requires_grad_(True), head, y, temperature=1.0, chunk_size=chunk
        )
        ln2, ln3 = torch.log(torch.tensor(2.0)), torch.log(torch.tensor(3.0))
        torch.testing.assert_close(lp, torch.stack([-ln3, -ln2]))
        torch.testing.assert_close(ent, torch.stack([ln3, 1.5 * ln2]))


@pytest.mark.parametrize("empty", ["some", "all"])
def test_shared_prefix_with_empty_responses(tiny_model_factory, make_batch, empty):
    """Rows without response tokens (failed or masked samples), even a micro-batch of only those."""
    d = tiny_model_factory(arch="qwen3")
    batch = make_batch(num_prompts=3, n=3, seed=2)
    am = batch.batch["attention_mask"].clone()
    rows = [0, 4, 5] if empty == "some" else list(range(len(batch)))
    am[rows, -6:] = 0
    batch.batch["attention_mask"] = am
    pol = load_policy(ModelConfig(path=str(d)))
    ref_lp, _ = _padded_reference(d, batch, 1.0)
    with torch.no_grad():
        lp, _ = policy_logprobs(
            pol.decoder, pol.lm_head, batch.batch["input_ids"], am, 6, share_prefix=True
        )
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    assert bool((lp[rows] == 0).all())


def test_padded_fallback_when_model_cannot_run_varlen(tiny_model_factory, make_batch, monkeypatch):
    """A model whose attention never reaches postrl's varlen function is detected at load time and
    trains with the padded forward — same log-probs, entropy and values; never silently wrong."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import postrl.engine.model as model_mod
    from postrl.engine.model import load_critic
    from postrl.engine.varlen import ATTN_NAME, register_varlen_attention

    d = tiny_model_factory(arch="llama")
    batch = make_batch(num_prompts=2, n=3, seed=4)
    ids, am = batch.batch["input_ids"], batch.batch["attention_mask"]
    ref_lp, ref_ent = _padded_reference(d, batch, 0.9)
    good_critic = load_critic(ModelConfig(path=str(d)))
    assert good_critic.packed
    head = torch.nn.Linear(
        good_critic.value_head.in_features, 1
    )  # a non-zero head: values worth comparing
    good_critic.value_head.load_state_dict(head.state_dict())
    with torch.no_grad():
        ref_v = good_critic(ids, am, 6)
    assert bool((ref_v != 0).any())
    # the "model" routes attention_implementation='postrl_varlen' to plain sdpa: our function
    # never runs
    monkeypatch.setattr(
        model_mod,
        "register_varlen_attention",
        lambda: AttentionInterface.register(ATTN_NAME, sdpa_attention_forward),
    )
    try:
        pol = load_policy(ModelConfig(path=str(d)))
        critic = load_critic(ModelConfig(path=str(d)))
        critic.value_head.load_state_dict(head.state_dict())
        assert not pol.packed and not critic.packed
        assert pol.causal_lm.config._attn_implementation == "sdpa"
        with torch.no_grad():
            lp, ent = pol.logprobs(
                ids, am, 6, temperature=0.9, calculate_entropy=True, share_prefix=True
            )
            v = critic(ids, am, 6)
    finally:
        register_varlen_attention()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2)])
def test_small_masked_attention_equals_sdpa(heads, monkeypatch):
    """The responses' pass of a prefix-shared batch runs as batched matmuls below
    ``SMALL_SCORES`` elements: output and input gradients equal SDPA's (fp32 rounding), with
    grouped-query heads, and above the threshold SDPA itself runs."""
    import torch.nn.functional as F

    from postrl.engine import varlen

    torch.manual_seed(0)
    h, hk = heads
    s, lq, lk, d = 5, 7, 11, 16
    q, k, v = torch.randn(s, h, lq, d), torch.randn(s, hk, lk, d), torch.randn(s, hk, lk, d)
    mask = torch.rand(s, 1, lq, lk) < 0.6
    mask[..., 0] = True  # every query attends somewhere (a prompt's first token)

    def grads(fn):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), qq.grad, kk.grad, vv.grad

    def ref(qq, kk, vv):
        out = F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=mask, scale=0.3, enable_gqa=h != hk
        )
        return out.transpose(1, 2).reshape(-1, h, d)

    want = grads(ref)
    calls = []
    real = varlen._matmul_attention
    monkeypatch.setattr(varlen, "_matmul_attention", lambda *a: calls.append(1) or real(*a))
    got = grads(lambda qq, kk, vv: varlen._sdpa(qq, kk, vv, scaling=0.3, mask=mask))
    assert calls, "the small pass did not take the matmul path"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(varlen, "SMALL_SCORES", 0)
    calls.clear()
    big = grads(lambda qq, kk, vv: varlen._sdpa(qq, kk, vv, scaling=0.3, mask=mask))
    assert not calls
    for a, b in zip(big, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
