"""A distillation teacher's top-k and a student's log-probs at given ids from the log-prob pass
(``distill.loss=gkd``): equal to a dense HF softmax, chunking- and micro-batch-invariant, and
differentiable for the student."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from postrl.engine.logprob import chunked_token_logprobs, policy_logprobs
from postrl.engine.model import ModelSpec, load_policy


def test_topk_and_logprobs_at_by_hand_and_chunking_invariant():
    # Row 0 logits [ln 2, 0, 0]: log π = [ln 1/2, ln 1/4, ln 1/4]; top-1 = id 0 at ln 1/2.
    # Row 1 logits [0, 0, ln 3]: log π = [ln 1/5, ln 1/5, ln 3/5]; top-1 = id 2 at ln 3/5.
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]))
    ln = torch.log
    h = torch.tensor([[float(ln(torch.tensor(2.0))), 0.0], [0.0, float(ln(torch.tensor(3.0)))]])
    y = torch.tensor([1, 0])
    at = torch.tensor([[2, 1], [2, 0]])  # (M, K) ids to read
    for chunk in (1, 8):
        hh = h.clone().requires_grad_(True)
        lp, ent, top_lp, top_id, at_lp = chunked_token_logprobs(
            hh, head, y, chunk_size=chunk, topk=1, logprobs_at=at
        )
        assert top_id.tolist() == [[0], [2]]
        torch.testing.assert_close(top_lp, torch.tensor([[0.5], [0.6]]).log())
        torch.testing.assert_close(at_lp, torch.tensor([[0.25, 0.25], [0.6, 0.2]]).log())
        at_lp.sum().backward()  # differentiable (checkpointed chunks included)
        assert hh.grad is not None and float(hh.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="topk=4"):
        chunked_token_logprobs(h, head, y, topk=4)


@pytest.mark.parametrize("share", [False, True])
def test_packed_topk_equals_the_dense_softmax(tiny_model_factory, make_batch, share):
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
    dense = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1)  # (B, R, V)
    valid = am[:, -r:].bool()
    k = 5
    want_lp, want_id = dense.topk(k, dim=-1)
    pol = load_policy(ModelSpec(path=str(d)))
    with torch.no_grad():
        lp, _, top_lp, top_id = policy_logprobs(
            pol.decoder, pol.lm_head, ids, am, r, share_prefix=share, topk=k
        )
        (lp_plain, _) = policy_logprobs(pol.decoder, pol.lm_head, ids, am, r, share_prefix=share)
        *_, at = policy_logprobs(  # the student reads its log-probs at the teacher's ids
            pol.decoder, pol.lm_head, ids, am, r, share_prefix=share, logprobs_at=want_id
        )
    assert torch.equal(lp, lp_plain)  # asking for the top-k changes nothing else
    torch.testing.assert_close(top_lp[valid], want_lp[valid], atol=1e-5, rtol=0)
    assert torch.equal(top_id[valid], want_id[valid])
    torch.testing.assert_close(at[valid], want_lp[valid], atol=1e-5, rtol=0)
    assert float(top_lp[~valid].abs().sum()) == 0.0 and int(top_id[~valid].abs().sum()) == 0


def test_engine_returns_topk_only_when_asked(tiny_model_factory, make_batch):
    """``meta_info['calculate_topk'] = K`` adds ``topk_log_probs`` / ``topk_ids`` (B, R, K),
    restored to row order over several micro-batches; the log-probs are unchanged."""
    from postrl.engine.actor import LogProbEngine
    from postrl.engine.update import BatchSpec

    d = tiny_model_factory(arch="qwen2")
    batch = make_batch(num_prompts=2, n=3, seed=5)
    pol = load_policy(ModelSpec(path=str(d)))
    eng = LogProbEngine(pol, BatchSpec(ppo_max_token_len_per_gpu=28))
    plain = eng.compute_log_prob(batch)
    assert "topk_ids" not in plain.batch
    batch.meta_info["calculate_topk"] = 3
    out = eng.compute_log_prob(batch)
    assert len(eng.micro_batches(batch)) > 1
    torch.testing.assert_close(
        out.batch["old_log_probs"], plain.batch["old_log_probs"], atol=0, rtol=0
    )
    r = batch.batch["responses"].shape[1]
    with torch.no_grad():
        _, _, want_lp, want_id = policy_logprobs(
            pol.decoder,
            pol.lm_head,
            batch.batch["input_ids"],
            batch.batch["attention_mask"],
            r,
            topk=3,
        )
    assert out.batch["topk_ids"].shape == (len(batch), r, 3)
    assert torch.equal(out.batch["topk_ids"], want_id)
    torch.testing.assert_close(out.batch["topk_log_probs"], want_lp, atol=1e-6, rtol=0)
