"""Policy losses: hand-computed branches, loop oracles, gradients, common contract."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from postrl.algos import (
    POLICY_LOSS_INPUTS,
    POLICY_LOSSES,
    LossInputs,
    get_policy_loss,
    register_policy_loss,
)


def _call(fn, old, new, adv, mask, **kw):
    """``fn(LossInputs(old, new, adv, mask, <input fields of kw>), <the rest of kw>)``."""
    fields = {k: kw.pop(k) for k in list(kw) if k in POLICY_LOSS_INPUTS}
    return fn(LossInputs(old, new, adv, mask, **fields), **kw)


def _lp(ratios):
    """old = 0, new = log(ratio) -> r = ratio exactly."""
    new = torch.tensor([ratios], dtype=torch.float64).log()
    return torch.zeros_like(new), new


# ------------------------------------------------------------------ vanilla: hand cases
def test_vanilla_clip_higher_and_dual_clip_hand():
    # eps_l = .2, eps_h = .28 (DAPO clip-higher), c = 3.
    # tok0: A=+1, r=1.5 -> max(-1.5, -1.28) = -1.28 (upper clip active)
    # tok1: A=+1, r=1.25 -> max(-1.25, -1.25) = -1.25 (inside: clip-higher lets it through)
    # tok2: A=-1, r=0.5 -> max(.5, .8) = .8 (lower clip active)
    # tok3: A=-1, r=5.0 -> max(5, 1.28) = 5 -> dual clip min(5, 3) = 3
    old, new = _lp([1.5, 1.25, 0.5, 5.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(adv)
    loss, met = _call(
        get_policy_loss("vanilla"),
        old,
        new,
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    assert loss.item() == pytest.approx((-1.28 - 1.25 + 0.8 + 3.0) / 4)
    assert met["pg_clipfrac"].item() == pytest.approx(2 / 4)  # tok0, tok2
    assert met["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)  # tok3
    # ppo_kl = mean(old - new) = -mean(log r)
    assert met["ppo_kl"].item() == pytest.approx(-sum(math.log(x) for x in [1.5, 1.25, 0.5, 5]) / 4)
    assert all(v.dim() == 0 and not v.requires_grad for v in met.values())


def test_vanilla_symmetric_clip_blocks_what_clip_higher_passes():
    old, new = _lp([1.25])
    adv = torch.ones(1, 1, dtype=torch.float64)
    sym, _ = _call(get_policy_loss("vanilla"), old, new, adv, torch.ones_like(adv), clip_ratio=0.2)
    assert sym.item() == pytest.approx(-1.2)


def test_vanilla_gradient_zero_when_clipped():
    old, new = _lp([1.5, 1.0])
    new.requires_grad_(True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, _ = _call(get_policy_loss("vanilla"), old, new, adv, torch.ones_like(adv))
    loss.backward()
    # clipped token: no gradient; unclipped token at r = 1: d(-A r)/d log pi / 2 tokens = -.5
    assert new.grad.tolist() == [[0.0, -0.5]]


# ------------------------------------------------------------------ oracles on random inputs
def _rand(seed, b=4, t=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    new = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.75).double()
    mask[0] = 0  # an empty row
    return old, new, adv, mask


def _token_mean(vals, mask):
    num = sum(vals[i][t] for i in range(len(vals)) for t in range(len(vals[0])) if mask[i][t])
    return num / max(sum(sum(r) for r in mask), 1)


def _seq_mean_token_mean(vals, mask):
    seqs = [sum(v for v, m in zip(vr, mr) if m) / sum(mr) for vr, mr in zip(vals, mask) if sum(mr)]
    return sum(seqs) / max(len(seqs), 1)


def _tok(fn, old, new, adv):
    b, t = old.shape
    return [
        [fn(math.exp(new[i, k] - old[i, k]), adv[i, k].item(), new[i, k].item()) for k in range(t)]
        for i in range(b)
    ]


ORACLES = {
    "vanilla": lambda r, a, lp: (
        min(max(-a * r, -a * min(max(r, 0.8), 1.2)), -a * 3.0)
        if a < 0
        else max(-a * r, -a * min(max(r, 0.8), 1.2))
    ),
    "reinforce": lambda r, a, lp: -a * lp,
    "gpg": lambda r, a, lp: -a * lp,
    "cispo": lambda r, a, lp: -min(max(r, 0.8), 1.2) * a * lp,
    "sapo": lambda r, a, lp: (
        -(4 / (1.0 if a > 0 else 1.05)) / (1 + math.exp(-(1.0 if a > 0 else 1.05) * (r - 1))) * a
    ),
}


@pytest.mark.parametrize("name", sorted(ORACLES))
@pytest.mark.parametrize("seed", range(3))
def test_token_losses_match_loop(name, seed):
    old, new, adv, mask = _rand(seed)
    loss, _ = _call(get_policy_loss(name), old, new, adv, mask)
    exp = _token_mean(_tok(ORACLES[name], old, new, adv), mask.tolist())
    assert loss.item() == pytest.approx(exp, abs=1e-10)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_matches_loop(seed):
    old, new, adv, mask = _rand(seed)
    b, t = old.shape
    vals = []
    for i in range(b):
        n = max(sum(mask[i].tolist()), 1)
        s = math.exp(sum((new[i, k] - old[i, k]).item() for k in range(t) if mask[i, k]) / n)
        vals.append(
            [
                max(-adv[i, k].item() * s, -adv[i, k].item() * min(max(s, 1 - 3e-4), 1 + 4e-4))
                for k in range(t)
            ]
        )
    loss, _ = _call(
        get_policy_loss("gspo"), old, new, adv, mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4
    )
    assert loss.item() == pytest.approx(_seq_mean_token_mean(vals, mask.tolist()), abs=1e-10)


@pytest.mark.parametrize("seed", range(3))
def test_geo_mean_matches_loop(seed):
    old, new, adv, mask = _rand(seed)
    b, t = old.shape
    seqs = []
    for i in range(b):
        idx = [k for k in range(t) if mask[i, k]]
        if not idx:
            continue
        ls = []
        for k in idx:
            lr, a = (new[i, k] - old[i, k]).item(), adv[i, k].item()
            sg = (a > 0) - (a < 0)
            ls.append(sg * min(sg * lr, sg * min(max(lr, -0.4), 0.4)))
        seqs.append(-(sum(adv[i, k].item() for k in idx) / len(idx)) * math.exp(sum(ls) / len(idx)))
    loss, _ = _call(get_policy_loss("geo_mean"), old, new, adv, mask, clip_ratio=0.4)
    assert loss.item() == pytest.approx(sum(seqs) / len(seqs), abs=1e-10)


def test_gspo_gradient_is_sequence_ratio_times_token_grad():
    # one sequence, 2 tokens, ratios e^{.1}, e^{.3}: s = e^{.2}; A = 1, no clip (wide range)
    # L = mean_t(-A s_t) where s_t has value s and d s_t / d lp_t = s -> grad = -s / 2 each
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    loss, _ = _call(
        get_policy_loss("gspo"),
        old,
        new,
        torch.ones(1, 2, dtype=torch.float64),
        torch.ones(1, 2),
        clip_ratio=10.0,
    )
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-math.exp(0.2) / 2] * 2)


def test_sapo_gradient_at_ratio_one_equals_reinforce():
    # f(r) = 4/tau * sigmoid(tau (r - 1)); f'(1) = 4/tau * tau/4 = 1 -> d(-f A)/d lp = -A r = -A
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, -3.0]], dtype=torch.float64)
    loss, _ = _call(
        get_policy_loss("sapo"), old, new, adv, torch.ones(1, 2), loss_agg_mode="token-sum"
    )
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-2.0, 3.0])


def test_cispo_keeps_gradient_of_clipped_tokens():
    # r = 3 (clipped to 1.2 by the weight), A = 1: grad = -1.2 (PPO would give 0)
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.tensor([[math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    loss, met = _call(
        get_policy_loss("cispo"), old, new, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    )
    loss.backward()
    assert new.grad.item() == pytest.approx(-1.2)
    assert met["pg_clipfrac"].item() == 1.0


def test_bypass_mode():
    old_ignored, new = _lp([1.5, 0.9])
    rollout = torch.zeros_like(new)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    m = torch.ones_like(adv)
    fn = get_policy_loss("bypass_mode")
    loss, _ = _call(fn, old_ignored + 7.0, new, adv, m, rollout_log_prob=rollout)
    ref, _ = _call(get_policy_loss("vanilla"), rollout, new, adv, m)
    assert loss.item() == pytest.approx(ref.item())
    # reinforce: -min(r, 2) A log pi: tokens r=1.5 -> -1.5*log1.5 ; r=.9 -> +.9*log.9
    loss, _ = _call(fn, old_ignored, new, adv, m, rollout_log_prob=rollout, bypass_loss="reinforce")
    assert loss.item() == pytest.approx((-1.5 * math.log(1.5) + 0.9 * math.log(0.9)) / 2)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        _call(fn, old_ignored, new, adv, m)


def test_clip_cov_and_kl_cov_select_high_covariance_tokens():
    # 1 x 4 tokens. kl_cov with ratio .25 -> k = 1 token penalised: the top covariance one.
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[-0.1, -2.0, -0.5, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[3.0, -1.0, 0.0, -2.0]], dtype=torch.float64)
    m = torch.ones_like(adv)
    # cov_t = (A - 0) * (lp - (-0.9)) = [2.4, 1.1, 0, 0.2] -> top = token 0
    loss, met = _call(
        get_policy_loss("kl_cov"), old, new, adv, m, kl_cov_ratio=0.25, ppo_kl_coef=1.0
    )
    r = new.exp()[0]
    exp = (-(adv[0] * r).sum() + abs(-0.1)) / 4
    assert loss.item() == pytest.approx(exp.item())
    assert met["pg_clipfrac"].item() == pytest.approx(0.25)
    # clip_cov: candidates have cov in (1, 5): tokens 0 and 1 (neither PPO-clipped? token 0:
    # r = .905 inside [.8, 1.2]; token 1: r = .135 with A < 0 -> clipped -> excluded) => token 0
    new_g = new.clone().requires_grad_(True)
    loss, met = _call(get_policy_loss("clip_cov"), old, new_g, adv, m, clip_cov_ratio=0.25)
    loss.backward()
    assert new_g.grad[0, 0].item() == 0.0 and met["pg_clipfrac"].item() == pytest.approx(0.25)


# ------------------------------------------------------------------ contract for every loss
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_contract(name):
    old, new, adv, mask = _rand(7)
    new = new.clone().requires_grad_(True)
    kw = dict(rollout_log_prob=old.clone())
    with pytest.raises(TypeError, match="some_unknown_hparam"):  # typed: nothing ignored
        _call(get_policy_loss(name), old, new, adv, mask, some_unknown_hparam=1, **kw)
    loss, met = _call(get_policy_loss(name), old, new, adv, mask, **kw)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} <= set(met)
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in met.values())
    loss.backward()
    assert torch.isfinite(new.grad).all() and (new.grad[mask == 0] == 0).all()
    # all rows masked / zero-length responses: finite zero loss
    z = torch.zeros_like(mask)
    loss0, met0 = _call(get_policy_loss(name), old, new.detach(), adv, z, **kw)
    assert torch.isfinite(loss0) and loss0.item() == 0.0
    assert all(torch.isfinite(v) for v in met0.values())
    # dp > 1 without denominators raises; with them the shard sum equals the whole batch
    with pytest.raises(ValueError):
        _call(
            get_policy_loss(name),
            old,
            new.detach(),
            adv,
            mask,
            dp_size=2,
            loss_agg_mode="token-mean",
            **kw,
        )


@pytest.mark.parametrize(
    "name", [n for n in POLICY_LOSSES.names() if n not in ("clip_cov", "kl_cov")]
)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_split_over_dp_equals_whole(name, mode):
    old, new, adv, mask = _rand(3, b=6)
    kw = dict(loss_agg_mode=mode, norm_length=5)
    fn = get_policy_loss(name)
    rollout = old - 0.1
    whole, _ = _call(fn, old, new, adv, mask, rollout_log_prob=rollout, **kw)
    den = dict(global_num_tokens=mask.sum(), global_num_seqs=(mask.sum(-1) > 0).sum())
    parts = [
        _call(
            fn, old[s], new[s], adv[s], mask[s], dp_size=2, rollout_log_prob=rollout[s], **den, **kw
        )[0]
        for s in (slice(0, 2), slice(2, 6))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-12)


def test_rollout_is_weights_multiply():
    old, new, adv, mask = _rand(1)
    w = torch.full_like(old, 0.5)
    a, _ = _call(get_policy_loss("vanilla"), old, new, adv, mask)
    b, _ = _call(get_policy_loss("vanilla"), old, new, adv, mask, rollout_is_weights=w)
    assert b.item() == pytest.approx(0.5 * a.item())


# ------------------------------------------------------------------ the one input type
def test_loss_inputs_frozen_and_shape_checked():
    old, new, adv, mask = _rand(2)
    x = LossInputs(old, new, adv, mask)
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.log_prob = new  # a loss never edits its inputs
    with pytest.raises(ValueError, match=r"LossInputs.advantages has shape \(4, 1\)"):
        LossInputs(old, new, adv[:, :1], mask)
    assert set(POLICY_LOSS_INPUTS) == {f.name for f in dataclasses.fields(LossInputs)}


def test_register_refuses_the_old_positional_signature():
    with pytest.raises(TypeError, match="one positional parameter, the postrl.algos.LossInputs"):

        @register_policy_loss("test_old_style_loss")
        def old_style(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio=0.2):
            return log_prob.sum(), {}

    assert "test_old_style_loss" not in POLICY_LOSSES
