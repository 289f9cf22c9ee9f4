"""Decoupled PPO: hand-derived values, equivalence to vanilla when mu == pi_prox, loop oracle."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algos import POLICY_LOSS_INPUTS, LossInputs, get_policy_loss
from postrl.algos.policy_losses_decoupled import proximal_is_weights

F64 = torch.float64


def _call(fn, old, new, adv, mask, **kw):
    """``fn(LossInputs(old, new, adv, mask, <input fields of kw>), <the rest of kw>)``."""
    fields = {k: kw.pop(k) for k in list(kw) if k in POLICY_LOSS_INPUTS}
    return fn(LossInputs(old, new, adv, mask, **fields), **kw)


def _hand_inputs():
    """One row, two tokens, built so every ratio is exact.

    log mu = 0; log pi_prox = log(1.5), log(3.0) -> pi_prox/mu = 1.5, 3.0
    log pi = log pi_prox + log(1.1), log pi_prox + log(0.5) -> r = pi/pi_prox = 1.1, 0.5
    """
    mu = torch.zeros(1, 2, dtype=F64)
    prox = torch.tensor([[math.log(1.5), math.log(3.0)]], dtype=F64)
    new = prox + torch.tensor([[math.log(1.1), math.log(0.5)]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    return prox, new, adv, torch.ones_like(adv), mu


def test_decoupled_hand_token_level():
    # eps = 0.2, C = 2, token level:
    # tok0: A=+1, r=1.1 inside the clip -> max(-1.1, -1.1) = -1.1; w = min(1.5, 2) = 1.5 -> -1.65
    # tok1: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (lower clip active); w = min(3, 2) = 2 -> 1.6
    # token-mean: (-1.65 + 1.6) / 2 = -0.025
    prox, new, adv, mask, mu = _hand_inputs()
    new = new.clone().requires_grad_(True)
    mu = mu.clone().requires_grad_(True)
    loss, met = _call(
        get_policy_loss("decoupled"),
        prox,
        new,
        adv,
        mask,
        rollout_log_prob=mu,
        rollout_is="token",
        rollout_is_threshold=2.0,
    )
    assert loss.item() == pytest.approx(-0.025, abs=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(0.5)  # tok1
    assert met["decoupled_is_mean"].item() == pytest.approx((1.5 + 2.0) / 2)
    assert met["decoupled_is_clipfrac"].item() == pytest.approx(0.5)  # tok1: 3 > 2
    # KL(mu || pi_prox) k1 = mean(log mu - log pi_prox) = -(log 1.5 + log 3) / 2
    assert met["decoupled_kl_behav"].item() == pytest.approx(-(math.log(1.5) + math.log(3)) / 2)
    # ppo_kl is measured against pi_prox: mean(log pi_prox - log pi) = -(log 1.1 + log 0.5) / 2
    assert met["ppo_kl"].item() == pytest.approx(-(math.log(1.1) + math.log(0.5)) / 2)
    loss.backward()
    # d/d log pi of w * (-A r) / 2 at tok0 = -1.5 * 1.1 / 2 = -0.825; tok1 is clipped -> 0
    assert new.grad[0].tolist() == pytest.approx([-0.825, 0.0], abs=1e-12)
    assert mu.grad is None  # the weight carries no gradient


def test_decoupled_hand_sequence_level():
    # sequence weight = min(1.5 * 3.0, C) on both tokens; per-token PPO terms -1.1 and 0.8.
    # C = 2:  w = 2   -> (2 * -1.1 + 2 * 0.8) / 2 = -0.3
    # C = 5:  w = 4.5 -> (4.5 * -1.1 + 4.5 * 0.8) / 2 = -0.675
    prox, new, adv, mask, mu = _hand_inputs()
    fn = get_policy_loss("decoupled")
    kw = dict(rollout_log_prob=mu, rollout_is="sequence")
    assert _call(fn, prox, new, adv, mask, rollout_is_threshold=2.0, **kw)[
        0
    ].item() == pytest.approx(-0.3, abs=1e-12)
    loss5, met5 = _call(fn, prox, new, adv, mask, rollout_is_threshold=5.0, **kw)
    assert loss5.item() == pytest.approx(-0.675, abs=1e-12)
    assert met5["decoupled_is_clipfrac"].item() == 0.0


def test_weights_masked_and_validated():
    prox, _, _, _, mu = _hand_inputs()
    w, _ = proximal_is_weights(prox, mu, torch.tensor([[1.0, 0.0]]), threshold=10.0)
    assert w[0].tolist() == pytest.approx([1.5, 0.0])
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        proximal_is_weights(prox, mu, torch.ones(1, 2), level="geometric")
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0"):
        proximal_is_weights(prox, mu, torch.ones(1, 2), threshold=0.0)


def test_decoupled_refuses_missing_mu_and_double_weights():
    prox, new, adv, mask, mu = _hand_inputs()
    fn = get_policy_loss("decoupled")
    with pytest.raises(ValueError, match="needs rollout_log_prob"):
        _call(fn, prox, new, adv, mask)
    with pytest.raises(ValueError, match="unset algorithm.rollout_correction.rollout_is"):
        _call(fn, prox, new, adv, mask, rollout_log_prob=mu, rollout_is_weights=torch.ones_like(mu))


def _rand(seed, b=5, t=7):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b, t, generator=g, dtype=F64) * 2
    new = prox + 0.4 * (torch.rand(b, t, generator=g, dtype=F64) - 0.5)
    mu = prox + 0.8 * (torch.rand(b, t, generator=g, dtype=F64) - 0.5)
    adv = torch.randn(b, t, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) > 0.25).to(F64)
    mask[0] = 0.0  # an empty response
    return prox, new, adv, mask, mu


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equals_vanilla_when_mu_is_pi_prox(seed, mode, level):
    """mu == pi_prox -> every weight is exp(0) = 1: loss and gradient are vanilla PPO's."""
    prox, new, adv, mask, _ = _rand(seed)
    kw = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    n1 = new.clone().requires_grad_(True)
    n2 = new.clone().requires_grad_(True)
    d, dm = _call(
        get_policy_loss("decoupled"),
        prox,
        n1,
        adv,
        mask,
        rollout_log_prob=prox.clone(),
        rollout_is=level,
        **kw,
    )
    v, vm = _call(get_policy_loss("vanilla"), prox, n2, adv, mask, **kw)
    torch.testing.assert_close(d, v, rtol=1e-12, atol=1e-14)
    d.backward()
    v.backward()
    torch.testing.assert_close(n1.grad, n2.grad, rtol=1e-12, atol=1e-14)
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        torch.testing.assert_close(dm[k], vm[k])
    assert dm["decoupled_is_mean"].item() == pytest.approx(1.0)
    assert dm["decoupled_kl_behav"].item() == 0.0


def _oracle(prox, new, adv, mask, mu, level, c, eps_l, eps_h, clip_c, mode):
    """Per-token Python loop: the formula of the docstring, read literally."""
    b, t = prox.shape
    per = [[0.0] * t for _ in range(b)]
    for i in range(b):
        seq = sum(float(prox[i, j] - mu[i, j]) for j in range(t) if mask[i, j])
        for j in range(t):
            if not mask[i, j]:
                continue
            lw = float(prox[i, j] - mu[i, j]) if level == "token" else seq
            w = min(math.exp(lw), c)
            r = math.exp(float(new[i, j] - prox[i, j]))
            a = float(adv[i, j])
            term = max(-a * r, -a * min(max(r, 1 - eps_l), 1 + eps_h))
            if a < 0:
                term = min(term, -a * clip_c)
            per[i][j] = w * term
    if mode == "token-mean":
        return sum(map(sum, per)) / max(float(mask.sum()), 1.0)
    rows = [i for i in range(b) if mask[i].sum() > 0]
    return sum(sum(per[i]) / float(mask[i].sum()) for i in rows) / max(len(rows), 1)


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_loop_oracle(seed, level, mode):
    prox, new, adv, mask, mu = _rand(seed)
    c, eps_l, eps_h, clip_c = 1.3, 0.2, 0.28, 3.0
    loss, _ = _call(
        get_policy_loss("decoupled"),
        prox,
        new,
        adv,
        mask,
        rollout_log_prob=mu,
        loss_agg_mode=mode,
        rollout_is=level,
        rollout_is_threshold=c,
        clip_ratio_low=eps_l,
        clip_ratio_high=eps_h,
        clip_ratio_c=clip_c,
    )
    want = _oracle(prox, new, adv, mask, mu, level, c, eps_l, eps_h, clip_c, mode)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    # and the weights really differ from 1 here (the oracle test is not vanilla in disguise)
    w, _ = proximal_is_weights(prox, mu, mask, level=level, threshold=c)
    assert (w[mask.bool()] - 1).abs().max() > 0.05
