"""Actor update: micro-batch invariance, prefix sharing invariance, non-finite skip."""

from __future__ import annotations

import pytest
import torch

from postrl.engine.actor import Actor, PolicyLossSpec
from postrl.engine.model import ModelSpec, load_policy
from postrl.engine.optim import OptimSpec, build_scheduler
from postrl.engine.update import BatchSpec


def _actor(model_dir, sgd=True, share_prompt_prefix=True, **kw):
    """An actor; ``sgd`` swaps AdamW for SGD so weight deltas are lr × gradient.

    (Adam divides by sqrt(v): on parameters whose gradient is ~0 it turns float noise into
    ±lr steps, so "same update" is only testable tightly on the gradient itself.)
    """
    optim = OptimSpec(lr=1e-2, grad_clip=100.0)
    actor = Actor(
        load_policy(ModelSpec(path=str(model_dir))),
        batch=BatchSpec(ppo_mini_batch_size=2, **kw),
        loss=PolicyLossSpec(entropy_coeff=0.01),
        optim=optim,
        rollout_n=4,
        share_prefix=share_prompt_prefix,
    )
    if sgd:
        actor.loop.optimizer = torch.optim.SGD(actor.loop.params, lr=1e-2)
        actor.loop.scheduler = build_scheduler(actor.loop.optimizer, optim)
    return actor


def _prep(actor, batch):
    old = actor.compute_log_prob(batch)
    batch = batch.union(old)
    return batch


def _weights(actor):
    return {n: p.detach().clone() for n, p in actor.policy.module.named_parameters()}


@pytest.mark.parametrize(
    ("a_kw", "b_kw"),
    [
        (dict(ppo_max_token_len_per_gpu=64), dict(ppo_max_token_len_per_gpu=512)),
        (dict(share_prompt_prefix=False), dict(share_prompt_prefix=True)),
    ],
)
def test_update_invariance(tiny_model_dir, make_batch, a_kw, b_kw):
    """Token budget 64 vs 512 (many vs one micro-batch), and shared vs unshared prompts: same
    update."""
    batch = make_batch(num_prompts=4, n=4, seed=3)
    outs = []
    for kw in (a_kw, b_kw):
        actor = _actor(tiny_model_dir, **kw)
        b = _prep(actor, batch)
        b.batch["old_log_probs"] = (
            b.batch["old_log_probs"] + 0.05 * b.batch["response_mask"]
        )  # make ratios ≠ 1
        m = actor.update_policy(b).metrics
        outs.append((_weights(actor), m))
    (w1, m1), (w2, m2) = outs
    assert m1["actor/grad_norm"] > 0
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-7, rtol=1e-5)
    for k in (
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
    ):
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    w0 = dict(load_policy(ModelSpec(path=str(tiny_model_dir))).module.named_parameters())
    changed = [k for k in w1 if not torch.equal(w1[k], w0[k])]
    assert changed, "the update changed no parameter"


def test_nonfinite_grad_skips_step(tiny_model_dir, make_batch):
    actor = _actor(tiny_model_dir, sgd=False)
    batch = _prep(actor, make_batch(num_prompts=2, n=4, seed=4))
    batch.batch["advantages"] = torch.full_like(batch.batch["advantages"], float("nan"))
    before = _weights(actor)
    m = actor.update_policy(batch).metrics
    assert m["actor/grad_norm_nonfinite_skips"] == 1.0
    for k, v in _weights(actor).items():
        assert torch.equal(v, before[k]), k
    assert actor.loop.optimizer.state == {} or all(
        s["step"] == 0 for s in actor.loop.optimizer.state.values()
    )


def test_empty_rows_contribute_nothing(tiny_model_dir, make_batch):
    """Rows with an all-zero response_mask (failed samples) change neither loss nor update."""
    batch = make_batch(num_prompts=2, n=4, seed=5)
    a1, a2 = _actor(tiny_model_dir), _actor(tiny_model_dir)
    b1 = _prep(a1, batch)
    b2 = b1[list(range(len(b1)))]
    b2.batch = dict(b2.batch)
    b2.batch["response_mask"] = b2.batch["response_mask"].clone()
    b2.batch["response_mask"][-1] = 0  # sample 7 excluded in b2; drop it from b1 instead
    a1.update_policy(b1[list(range(len(b1) - 1))])
    a2.update_policy(b2)
    w1, w2 = _weights(a1), _weights(a2)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=2e-6, rtol=1e-5)


def test_fused_old_log_prob_equals_separate_pass(tiny_model_dir, make_batch):
    """On-policy update without old_log_probs (fused) == the update after a separate
    old-log-prob pass."""
    batch = make_batch(
        num_prompts=2, n=4, seed=5
    )  # 8 rows = ppo_mini_batch_size 2 × n 4: one mini-batch
    sep = _actor(tiny_model_dir)
    b = _prep(sep, batch)
    u_sep = sep.update_policy(b)
    fused = _actor(tiny_model_dir)
    u_fused = fused.update_policy(batch)
    torch.testing.assert_close(u_fused.old_log_probs, b.batch["old_log_probs"], atol=1e-5, rtol=0)
    assert u_sep.old_log_probs is None
    m_sep, m_fused = u_sep.metrics, u_fused.metrics
    w_sep, w_fused = _weights(sep), _weights(fused)
    for k in w_sep:
        torch.testing.assert_close(w_fused[k], w_sep[k], atol=1e-7, rtol=1e-5)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m_fused[k] == pytest.approx(m_sep[k], rel=1e-4, abs=1e-6), k
    assert m_fused["actor/ppo_kl"] == 0.0 and m_fused["actor/pg_clipfrac"] == 0.0  # ratio exactly 1


def _skipping(model_dir, skip: bool, sgd: bool = True, **kw) -> Actor:
    """``_actor`` without an entropy bonus, leaving zero-advantage rows out or not."""
    actor = _actor(model_dir, sgd=sgd, **kw)
    actor.loss = PolicyLossSpec(entropy_coeff=0.0, skip_zero_advantage=skip)
    actor.entropy_coeff = 0.0
    return actor


def _zero_some(batch, rows: list[int]):
    """``batch`` with the advantages of ``rows`` set to 0 (a filtered group, PSR's negatives)."""
    b = batch[list(range(len(batch)))]
    b.batch = dict(b.batch)
    b.batch["advantages"] = b.batch["advantages"].clone()
    b.batch["advantages"][rows] = 0.0
    return b


@pytest.mark.parametrize("fused", [False, True])
def test_skipping_zero_advantage_rows_is_the_same_update(tiny_model_dir, make_batch, fused):
    """``skip_zero_advantage``: the rows with zero advantages leave the forward and backward,
    the update (weights, policy loss, gradient norm) is the one over every row — over two
    mini-batches, one of which trains a single row — and the skipped share is reported. Fused,
    the old log-probs of the rows it ran are the full update's, the others 0."""
    n_prompts = 2 if fused else 4  # fused: one mini-batch (ppo_mini_batch_size 2 prompts)
    batch = make_batch(num_prompts=n_prompts, n=4, seed=7)
    zero = [0, 1, 2, 5, 6] if fused else [0, 1, 2, 5, 6, 8, 9, 10, 12, 13, 14, 15]
    outs = []
    for skip in (False, True):
        actor = _skipping(tiny_model_dir, skip)
        b = _zero_some(batch if fused else _prep(actor, batch), zero)
        outs.append((actor.update_policy(b), _weights(actor)))
    (full, w_full), (part, w_part) = outs
    for k in w_full:
        torch.testing.assert_close(w_part[k], w_full[k], atol=1e-7, rtol=1e-5)
    for k in ("actor/pg_loss", "actor/grad_norm"):
        assert part.metrics[k] == pytest.approx(full.metrics[k], rel=1e-4, abs=1e-7), k
    assert full.metrics["actor/grad_norm"] > 0
    assert "actor/zero_adv_skipped_frac" not in full.metrics and full.trained is None
    assert part.metrics["actor/zero_adv_skipped_frac"] == pytest.approx(len(zero) / len(batch))
    assert part.trained.tolist() == [i not in zero for i in range(len(batch))]
    if fused:
        ran = part.trained
        torch.testing.assert_close(
            part.old_log_probs[ran], full.old_log_probs[ran], atol=1e-6, rtol=0
        )
        assert not part.old_log_probs[~ran].any()


def test_a_mini_batch_with_no_row_to_train_still_steps(tiny_model_dir, make_batch):
    """All of a mini-batch's advantages 0: nothing runs, yet AdamW steps on zero gradients as
    the full update does (its momentum still moves the weights) — bit for bit."""
    first = make_batch(num_prompts=2, n=4, seed=8)
    outs = []
    for skip in (False, True):
        actor = _skipping(tiny_model_dir, skip, sgd=False)
        actor.update_policy(_prep(actor, first))
        before = _weights(actor)
        b = _prep(actor, first)
        b.batch["advantages"] = torch.zeros_like(b.batch["advantages"])
        m = actor.update_policy(b).metrics
        outs.append((_weights(actor), m, before))
    (w_full, m_full, before), (w_part, m_part, _) = outs
    assert m_part["actor/zero_adv_skipped_frac"] == 1.0 and m_full["actor/grad_norm"] == 0.0
    assert any(not torch.equal(w_full[k], before[k]) for k in w_full)  # momentum moved them
    for k in w_full:
        assert torch.equal(w_part[k], w_full[k]), k


@pytest.mark.parametrize(
    ("kw", "rows", "match"),
    [
        (dict(ppo_epochs=2), 8, "ppo_epochs=1"),
        (dict(), 16, "one mini-batch"),
    ],
)
def test_fused_old_log_prob_refuses_off_policy(tiny_model_dir, make_batch, kw, rows, match):
    """Without old_log_probs an off-policy update (2 epochs, 2 mini-batches) is an error, not a
    silent ratio of 1."""
    actor = _actor(tiny_model_dir, **kw)
    batch = make_batch(num_prompts=4, n=4, seed=5)[list(range(rows))]
    with pytest.raises(ValueError, match=match):
        actor.update_policy(batch)


def test_adapt_entropy_coeff_moves_towards_the_target_within_bounds():
    """Skywork-OR1's controller: up by ``step`` below the target, down above it, clamped."""
    from postrl.algos import adapt_entropy_coeff

    kw = dict(target=0.5, step=0.01, max_coeff=0.03)
    assert adapt_entropy_coeff(0.0, 0.2, **kw) == pytest.approx(0.01)
    assert adapt_entropy_coeff(0.02, 0.9, **kw) == pytest.approx(0.01)
    assert adapt_entropy_coeff(0.0, 0.9, **kw) == 0.0  # never negative
    assert adapt_entropy_coeff(0.025, 0.1, **kw) == 0.03  # never above max_coeff
    assert adapt_entropy_coeff(0.02, 0.5, **kw) == pytest.approx(0.01)  # at the target: down
    assert adapt_entropy_coeff(0.012, 0.9, **kw, min_coeff=0.01) == 0.01  # never below the floor
    with pytest.raises(ValueError, match="target=0"):
        adapt_entropy_coeff(0.0, 0.1, target=0.0, step=0.01, max_coeff=0.1)
    with pytest.raises(ValueError, match="min_coeff=0.2"):
        adapt_entropy_coeff(0.0, 0.1, target=0.5, step=0.01, max_coeff=0.1, min_coeff=0.2)


@pytest.mark.parametrize(("target", "sign"), [(100.0, 1), (1e-6, -1)])
def test_adaptive_entropy_coeff_is_used_and_moves_each_update(
    tiny_model_dir, make_batch, target, sign
):
    """With ``entropy_target`` the bonus's weight is the actor's state: the update uses it
    (reported as ``actor/entropy_coeff``) and then steps it towards the target."""
    batch = make_batch(num_prompts=2, n=4, seed=6)
    start, step = 0.02, 0.005
    spec = PolicyLossSpec(
        entropy_coeff=start, entropy_target=target, entropy_coeff_step=step, entropy_coeff_max=1
    )
    actor = Actor(
        load_policy(ModelSpec(path=str(tiny_model_dir))),
        batch=BatchSpec(ppo_mini_batch_size=2),
        loss=spec,
        optim=OptimSpec(lr=1e-3),
        rollout_n=4,
    )
    seen = [actor.update_policy(_prep(actor, batch)).metrics["actor/entropy_coeff"]]
    first = _weights(actor)
    seen.append(actor.update_policy(_prep(actor, batch)).metrics["actor/entropy_coeff"])
    assert seen == pytest.approx([start, start + sign * step])
    assert actor.entropy_coeff == pytest.approx(start + 2 * sign * step)

    def fixed(coeff):
        a = Actor(
            load_policy(ModelSpec(path=str(tiny_model_dir))),
            batch=BatchSpec(ppo_mini_batch_size=2),
            loss=PolicyLossSpec(entropy_coeff=coeff),
            optim=OptimSpec(lr=1e-3),
            rollout_n=4,
        )
        m = a.update_policy(_prep(a, batch)).metrics
        assert "actor/entropy_coeff" not in m  # a fixed weight reports no controller
        return _weights(a)

    # the weight really enters the loss: the first update equals a fixed bonus of `start`'s
    same, zero = fixed(start), fixed(0.0)
    for k in first:
        torch.testing.assert_close(first[k], same[k])
    assert any(not torch.equal(first[k], zero[k]) for k in first)
