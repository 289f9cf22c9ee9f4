"""``sum_pi_squared`` (Σ_v π(v|·)², the optimal token baseline's need) from the log-prob
pass."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from postrl.engine.logprob import chunked_token_logprobs, policy_logprobs
from postrl.engine.model import ModelSpec, load_policy


def test_sum_pi_squared_by_hand_and_chunking_invariant():
    # Row 0 logits [0, 0, 0]: π = 1/3 each, Σπ² = 3/9 = 1/3.
    # Row 1 logits [ln 2, 0, 0]: π = [1/2, 1/4, 1/4], Σπ² = 1/4 + 1/16 + 1/16 = 3/8.
    # At temperature 0.5 row 1's logits double: [2 ln 2, 0, 0] -> π = [4/6, 1/6, 1/6],
    # Σπ² = (16 + 1 + 1)/36 = 1/2.
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    h = torch.tensor([[0.0, 0.0], [torch.log(torch.tensor(2.0)), 0.0]])
    y = torch.tensor([1, 0])
    for chunk in (1, 8):  # chunked (checkpointed under grad) or not: same values
        lp, ent, sps = chunked_token_logprobs(
            h.requires_grad_(True), head, y, chunk_size=chunk, sum_pi_squared=True
        )
        torch.testing.assert_close(sps, torch.tensor([1 / 3, 3 / 8]))
        _, _, sps_t = chunked_token_logprobs(
            h, head, y, temperature=0.5, chunk_size=chunk, sum_pi_squared=True
        )
        torch.testing.assert_close(sps_t, torch.tensor([1 / 3, 1 / 2]))
    assert len(chunked_token_logprobs(h, head, y)) == 2  # not asked: not computed


@pytest.mark.parametrize("share", [False, True])
def test_packed_sum_pi_squared_equals_padded_softmax(tiny_model_factory, make_batch, share):
    d = tiny_model_factory(arch="qwen2")
    batch = make_batch(num_prompts=3, n=3, seed=3)
    ids, am = batch.batch["input_ids"], batch.batch["attention_mask"]
    r = batch.batch["responses"].shape[1]
    ref = AutoModelForCausalLM.from_pretrained(
        str(d), attn_implementation="sdpa", dtype=torch.float32
    )
    with torch.no_grad():
        logits = ref(
            input_ids=ids, attention_mask=am, position_ids=batch.batch["position_ids"]
        ).logits
    probs = torch.softmax(logits[:, -r - 1 : -1].float() / 0.7, -1)  # (B, R, V)
    want = (probs**2).sum(-1) * am[:, -r:].float()
    pol = load_policy(ModelSpec(path=str(d)))
    with torch.no_grad():
        lp, ent, sps = policy_logprobs(
            pol.decoder,
            pol.lm_head,
            ids,
            am,
            r,
            temperature=0.7,
            share_prefix=share,
            calculate_sum_pi_squared=True,
        )
        lp2, ent2 = policy_logprobs(
            pol.decoder, pol.lm_head, ids, am, r, temperature=0.7, share_prefix=share
        )
    torch.testing.assert_close(sps, want, atol=1e-6, rtol=0)
    assert ent is None and ent2 is None and torch.equal(lp, lp2)  # the flag changes nothing else
    assert bool(((sps > 0) == am[:, -r:].bool()).all())  # 0 exactly on padding, in (0, 1] elsewhere
    assert float(sps.max()) <= 1.0


def test_engine_returns_sum_pi_squared_only_when_asked(tiny_model_factory, make_batch):
    """``meta_info['calculate_sum_pi_squared']`` adds the field; the log-probs are unchanged."""
    from postrl.engine.actor import LogProbEngine
    from postrl.engine.update import BatchSpec

    d = tiny_model_factory(arch="qwen2")
    batch = make_batch(num_prompts=2, n=3, seed=5)
    pol = load_policy(ModelSpec(path=str(d)))
    # a small token budget: several micro-batches, results restored to row order
    eng = LogProbEngine(pol, BatchSpec(ppo_max_token_len_per_gpu=28))
    batch.meta_info["temperature"] = 0.9
    plain = eng.compute_log_prob(batch)
    assert "sum_pi_squared" not in plain.batch
    batch.meta_info["calculate_sum_pi_squared"] = True
    out = eng.compute_log_prob(batch)
    torch.testing.assert_close(
        out.batch["old_log_probs"], plain.batch["old_log_probs"], atol=0, rtol=0
    )
    r = batch.batch["responses"].shape[1]
    with torch.no_grad():
        _, _, want = policy_logprobs(
            pol.decoder,
            pol.lm_head,
            batch.batch["input_ids"],
            batch.batch["attention_mask"],
            r,
            temperature=0.9,
            calculate_sum_pi_squared=True,
        )
    torch.testing.assert_close(out.batch["sum_pi_squared"], want, atol=1e-6, rtol=0)
    assert len(eng.micro_batches(batch)) > 1
