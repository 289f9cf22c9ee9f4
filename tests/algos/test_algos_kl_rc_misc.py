"""KL estimators/controllers, rollout correction, value loss, entropy, DAPO pieces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import postrl.algos as A


# ------------------------------------------------------------------ KL
def test_kl_estimators_hand():
    # d = log pi - log ref = log 2 ; rho = ref/pi = 1/2
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    d = math.log(2)
    assert A.kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert A.kl_penalty(lp, ref, "kl").item() == pytest.approx(d)
    assert A.kl_penalty(ref, lp, "abs").item() == pytest.approx(d)
    assert A.kl_penalty(lp, ref, "mse").item() == pytest.approx(d * d / 2)
    assert A.kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d)  # rho-1-log rho
    # clamp: huge gap -> k3 <= 10
    assert A.kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3").item() == 10.0


def test_k3_plus_value_of_k3_gradient_of_k2():
    lp = torch.tensor([[-0.2, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.7, -0.4]], dtype=torch.float64)
    v = A.kl_penalty(lp, ref, "k3+")
    assert torch.allclose(v, A.kl_penalty(lp, ref, "k3"))
    v.sum().backward()
    assert torch.allclose(lp.grad, (lp - ref).detach())  # d/dlp (d^2/2) = d


def test_apply_kl_penalty_and_kl_loss():
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    lp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # k1 = [[.5, 0], [-1, (masked)]] ; rewards = scores - .1 * k1
    r, met = A.apply_kl_penalty(scores, lp, ref, mask, kl_coef=0.1, kl_penalty="kl")
    assert torch.allclose(r, torch.tensor([[-0.05, 1.0], [2.1, 0.0]]))
    # per-seq token mean [.25, -1] -> mean -.375
    assert met["actor/reward_kl_penalty"].item() == pytest.approx(-0.375)
    assert torch.allclose(A.compute_rewards(scores, lp, ref, 0.1)[0], r[0])
    loss, m = A.compute_kl_loss(lp, ref, mask, kl_loss_type="k1", loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx((0.5 + 0 - 1) / 3) and "kl_loss" in m


def test_kl_controllers():
    c = A.AdaptiveKLController(init_kl_coef=0.2, target_kl=1.0, horizon=100)
    c.update(current_kl=3.0, n_steps=10)  # err clipped to .2 -> 0.2 * (1 + .2 * 10 / 100)
    assert c.value == pytest.approx(0.2 * 1.02)
    c.update(current_kl=0.9, n_steps=50)  # err -.1 -> * (1 - .05)
    assert c.value == pytest.approx(0.2 * 1.02 * 0.95)
    c2 = A.AdaptiveKLController(1.0, 1.0, 1)
    c2.load_state_dict(c.state_dict())
    assert c2.value == c.value and c2.horizon == 100
    f = A.FixedKLController(0.3)
    f.update(5.0, 100)
    assert f.value == 0.3 and f.state_dict() == {"value": 0.3}
    with pytest.raises(ValueError, match="horizon"):
        A.AdaptiveKLController(0.1, 1.0, 0)


# ------------------------------------------------------------------ rollout correction
def test_identical_logprobs_are_healthy():
    lp = -torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 6)
    mask[3] = 0  # a zero-length response
    for mode in (None, "token", "sequence"):
        w, m, met = A.compute_rollout_correction(
            lp, lp.clone(), mask, rollout_is=mode, rollout_rs="geometric"
        )
        assert met["rollout_corr/ess"].item() == pytest.approx(1.0)
        assert abs(met["rollout_corr/chi2"].item()) < 1e-6
        assert met["rollout_corr/kl_k1"].item() == 0 and met["rollout_corr/kl_k3"].item() == 0
        assert met["rollout_corr/rejection_rate"].item() == 0
        assert met["rollout_corr/ppl_rollout"].item() == pytest.approx(
            met["rollout_corr/ppl_train"].item()
        )
        assert torch.equal(m, mask)
        if w is not None:
            assert torch.allclose(w, mask)
        assert all(torch.isfinite(v) and v.dim() == 0 for v in met.values())


def test_mismatch_hand_values():
    # 2 sequences x 2 tokens, train - rollout log-ratio: seq0 [log 2, 0], seq1 [0, 0]
    old = torch.tensor([[math.log(2) - 1.0, -1.0], [-1.0, -1.0]])
    roll = torch.full((2, 2), -1.0)
    mask = torch.ones(2, 2)
    w, m, met = A.compute_rollout_correction(
        old, roll, mask, rollout_is="sequence", rollout_is_threshold=1.5
    )
    # sequence weights [2, 1]: ESS = 9 / (2 * 5) = .9 ; chi2 = (4 + 1) / 2 - 1 = 1.5
    assert met["rollout_corr/ess"].item() == pytest.approx(0.9, abs=1e-6)
    assert met["rollout_corr/chi2"].item() == pytest.approx(1.5, abs=1e-5)
    assert w[0].tolist() == pytest.approx([1.5, 1.5]) and w[1].tolist() == pytest.approx([1, 1])
    assert met["rollout_corr/is_clip_frac"].item() == pytest.approx(0.5)
    # k1 = mean(rollout - train) = -log2 / 4 ; k3 = mean(e^l - 1 - l) = (1 - log 2) / 4
    assert met["rollout_corr/kl_k1"].item() == pytest.approx(-math.log(2) / 4, abs=1e-6)
    assert met["rollout_corr/kl_k3"].item() == pytest.approx((1 - math.log(2)) / 4, abs=1e-6)
    # token IS: weights [2 -> 1.5, 1, 1, 1]; token ESS = (5)^2 / (4 * 7) = 25/28
    w, _, met = A.compute_rollout_correction(
        old, roll, mask, rollout_is="token", rollout_is_threshold=1.5
    )
    assert w.flatten().tolist() == pytest.approx([1.5, 1.0, 1.0, 1.0])
    assert met["rollout_corr/ess"].item() == pytest.approx(25 / 28, abs=1e-6)
    assert met["rollout_corr/ess"].item() < 1


def test_rejection_sampling():
    old = torch.tensor([[math.log(4.0), 0.0], [0.1, 0.1]])
    roll = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    # sequence ratio [4, e^.2]; upper 2 -> reject seq 0 ; geometric [2, e^.1] -> keep both (<= 2)
    _, m, met = A.compute_rollout_correction(
        old, roll, mask, rollout_rs="sequence", rollout_rs_threshold=2.0
    )
    assert m.tolist() == [[0, 0], [1, 1]] and met["rollout_corr/rejection_rate"].item() == 0.5
    _, m, met = A.compute_rollout_correction(
        old, roll, mask, rollout_rs="geometric", rollout_rs_threshold=2.0
    )
    assert m.tolist() == [[1, 1], [1, 1]]
    # lower bound 1.5 rejects seq 1 (ratio e^.1 = 1.105)
    _, m, _ = A.compute_rollout_correction(
        old,
        roll,
        mask,
        rollout_rs="geometric",
        rollout_rs_threshold=2.0,
        rollout_rs_threshold_lower=1.5,
    )
    assert m.tolist() == [[1, 1], [0, 0]]
    with pytest.raises(ValueError, match="rollout_is"):
        A.compute_rollout_correction(old, roll, mask, rollout_is="tokens")


def test_ess_decreases_with_mismatch():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(16, 8, generator=g)
    mask = torch.ones(16, 8)
    prev = 1.0
    for scale in (0.05, 0.3, 1.0):
        roll = lp + torch.randn(16, 8, generator=g) * scale
        _, _, met = A.compute_rollout_correction(lp, roll, mask)
        assert met["rollout_corr/ess"].item() < prev
        prev = met["rollout_corr/ess"].item()


# ------------------------------------------------------------------ value loss, entropy
def test_value_loss_hand():
    # values .0, returns 1., clip .2. tok0 vpred .5: l1=.25, vclip=.2 -> l2=.64 -> .64 (clipped)
    # tok1 vpred .1: l1 = .81, vclip = .1 -> l2 = .81 -> .81 (not clipped, equal)
    v = torch.zeros(1, 2)
    loss, met = A.compute_value_loss(
        torch.tensor([[0.5, 0.1]]), torch.ones(1, 2), v, torch.ones(1, 2), cliprange_value=0.2
    )
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert met["vf_clipfrac"].item() == pytest.approx(0.5)


def test_entropy_matches_reference_and_is_stable():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 4
    ref = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    out = A.entropy_from_logits(logits, chunk_size=4)
    assert out.shape == (3, 5) and torch.allclose(out.double(), ref, atol=1e-5)
    big = torch.tensor([[1e4, 1e4, -1e4, float("-inf")]])
    assert A.entropy_from_logits(big).item() == pytest.approx(math.log(2), abs=1e-5)
    # gradient through chunks (checkpointed) equals the unchunked one
    x = logits.float().clone().requires_grad_(True)
    A.entropy_from_logits(x, chunk_size=2).sum().backward()
    y = logits.float().clone().requires_grad_(True)
    (-(torch.softmax(y, -1) * torch.log_softmax(y, -1)).sum(-1)).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-5)
    bf = A.entropy_from_logits(logits.bfloat16())
    assert bf.dtype == torch.float32 and torch.isfinite(bf).all()


# ------------------------------------------------------------------ DAPO
def test_overlong_penalty_hand():
    # L_max 20, buffer 4 -> L_exp 16.
    # lengths 10 -> 0, 16 -> 0, 18 -> -2/4*.5 = -.25, 20 -> -.5, 25 -> -.5
    p = A.overlong_reward_penalty(torch.tensor([10, 16, 18, 20, 25]), 20, 4, 0.5)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        A.overlong_reward_penalty(torch.tensor([1]), 20, 0, 1.0)


def test_filter_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 2.0, float("nan"), 2.0, 3.0])
    idx = np.array(["a", "a", "b", "b", "c", "d", "d", "e", "e"], dtype=object)
    sm = [True] * 8 + [False]
    keep, met = A.filter_groups(scores, idx, sample_mask=sm)
    # a: all equal -> drop ; b: differ -> keep ; c: single -> drop ; d: one valid (NaN) -> drop
    # e: one valid after the mask -> drop
    assert keep.tolist() == [False, False, True, True, False, False, False, False, False]
    assert met == {
        "num_groups": 5,
        "num_kept_groups": 1,
        "num_dropped_groups": 4,
        "num_kept_samples": 2,
        "num_dropped_samples": 7,
    }
