"""Advantage estimators: hand-computed cases, loop oracles on random inputs, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from postrl.algos import ADV_ESTIMATORS, get_adv_estimator


def outcome(scores, lengths, t=4):
    """Outcome rewards on the last valid token; right-padded masks."""
    b = len(scores)
    r = torch.zeros(b, t, dtype=torch.float64)
    m = torch.zeros(b, t, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        m[i, :n] = 1
        if n:
            r[i, n - 1] = s
    return r, m


def seq_adv(adv, mask, ref=None):
    """Per-sequence advantage (asserting it is constant over valid tokens).

    With ``ref`` (oracle values), returns ``(got, ref with 0 for zero-length rows)``.
    """
    if ref is not None:
        keep = mask.sum(-1) > 0
        return seq_adv(adv, mask), [x if keep[i] else 0.0 for i, x in enumerate(ref)]
    out = []
    for i in range(adv.shape[0]):
        vals = adv[i][mask[i].bool()]
        if vals.numel():
            assert torch.allclose(vals, vals[0].expand_as(vals))
            out.append(vals[0].item())
        else:
            out.append(0.0)
    return out


# ------------------------------------------------------------------ hand-computed cases
def test_grpo_hand():
    # group a: [1, 0, 1, 0]: mean .5, unbiased std sqrt(4 * .25 / 3) = 0.57735 -> +-0.866025
    # group b: single sample -> 0 ; group c: [2, 2] all equal -> 0
    r, m = outcome([1, 0, 1, 0, 3, 2, 2], [4, 2, 1, 3, 2, 4, 4])
    idx = np.array(["a", "a", "a", "a", "b", "c", "c"], dtype=object)
    adv, ret = get_adv_estimator("grpo")(token_level_rewards=r, response_mask=m, index=idx)
    e = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert seq_adv(adv, m) == pytest.approx([e, -e, e, -e, 0, 0, 0], abs=1e-6)
    assert torch.equal(adv, ret)
    assert (adv[m == 0] == 0).all()
    # Dr.GRPO: no std division -> +-0.5
    adv, _ = get_adv_estimator("grpo")(
        token_level_rewards=r, response_mask=m, index=idx, norm_adv_by_std_in_grpo=False
    )
    assert seq_adv(adv, m)[:4] == pytest.approx([0.5, -0.5, 0.5, -0.5])
    # PSR / NSR weights: positive and negative advantages scaled separately
    adv, _ = get_adv_estimator("grpo")(
        token_level_rewards=r,
        response_mask=m,
        index=idx,
        norm_adv_by_std_in_grpo=False,
        positive_weight=2.0,
        negative_weight=0.1,
    )
    assert seq_adv(adv, m)[:4] == pytest.approx([1.0, -0.05, 1.0, -0.05])
    # positive-sample reinforcement only (the 3-digit recipe): a wrong answer's advantage is
    # exactly 0 on every token, a right one's is GRPO's
    adv, _ = get_adv_estimator("grpo")(
        token_level_rewards=r, response_mask=m, index=idx, negative_weight=0.0
    )
    assert seq_adv(adv, m)[:4] == pytest.approx([e, 0.0, e, 0.0], abs=1e-6)
    assert (adv[1] == 0).all() and (adv[3] == 0).all()
    with pytest.raises(ValueError, match="negative_weight=-1 must be >= 0"):
        get_adv_estimator("grpo")(
            token_level_rewards=r, response_mask=m, index=idx, negative_weight=-1
        )


def test_rloo_hand():
    # group [1, 2, 6]: leave-one-out baselines 4, 3.5, 1.5 -> [-3, -1.5, 4.5]
    r, m = outcome([1, 2, 6], [1, 2, 3])
    adv, _ = get_adv_estimator("rloo")(token_level_rewards=r, response_mask=m, index=[0, 0, 0])
    assert seq_adv(adv, m) == pytest.approx([-3.0, -1.5, 4.5])


def test_opo_hand():
    # lengths [1, 3], scores [1, 0]: baseline (1*1 + 3*0) / 4 = .25 -> [.75, -.25]
    r, m = outcome([1, 0], [1, 3])
    adv, _ = get_adv_estimator("opo")(token_level_rewards=r, response_mask=m, index=[7, 7])
    assert seq_adv(adv, m) == pytest.approx([0.75, -0.25])


def test_gpg_hand():
    # scores [1, 0, 0, 0], B = 4, one non-zero -> alpha = 4; mean .25 -> 4 * [.75, -.25, ...]
    r, m = outcome([1, 0, 0, 0], [1, 1, 1, 1])
    adv, _ = get_adv_estimator("gpg")(token_level_rewards=r, response_mask=m, index=[0] * 4)
    assert seq_adv(adv, m) == pytest.approx([3.0, -1.0, -1.0, -1.0])


def test_passk_hand():
    # group [.2, .9, .5]: best .9, second .5 -> gap .4; std = sqrt(.24667 / 2) = .351188
    r, m = outcome([0.2, 0.9, 0.5], [2, 2, 2])
    fn = get_adv_estimator("grpo_passk")
    adv, _ = fn(token_level_rewards=r, response_mask=m, index=[0, 0, 0])
    assert seq_adv(adv, m) == pytest.approx([0, 0.4 / (0.351188 + 1e-6), 0], abs=1e-5)
    adv, _ = fn(
        token_level_rewards=r, response_mask=m, index=[0, 0, 0], norm_adv_by_std_in_grpo=False
    )
    assert seq_adv(adv, m) == pytest.approx([0, 0.4, 0], abs=1e-9)


def test_remax_hand():
    # rewards [0, 1, 2] all valid: reward-to-go [3, 3, 2]; baseline 1 -> [2, 2, 1]
    r = torch.tensor([[0.0, 1.0, 2.0]])
    m = torch.ones(1, 3)
    adv, ret = get_adv_estimator("remax")(
        token_level_rewards=r, response_mask=m, reward_baselines=torch.tensor([1.0])
    )
    assert adv.tolist() == [[2.0, 2.0, 1.0]] and ret.tolist() == [[3.0, 3.0, 2.0]]


def test_gae_hand():
    # T = 2, r = [0, 1], V = [.5, .2], gamma = lam = 1:
    # delta_1 = 1 - .2 = .8 -> A_1 = .8 ; delta_0 = 0 + .2 - .5 = -.3 -> A_0 = -.3 + .8 = .5
    # returns = A + V = [1, 1]; whitened A: mean .65, unbiased std .212132 -> [-.7071, .7071]
    adv, ret = get_adv_estimator("gae")(
        token_level_rewards=torch.tensor([[0.0, 1.0]]),
        response_mask=torch.ones(1, 2),
        values=torch.tensor([[0.5, 0.2]]),
        gamma=1.0,
        lam=1.0,
    )
    assert ret[0].tolist() == pytest.approx([1.0, 1.0])
    assert adv[0].tolist() == pytest.approx([-0.70711, 0.70711], abs=1e-4)


def test_gdpo_hand_separates_components():
    # Two components, group of 4. c1 = [1,1,0,0], c2 = [1,0,1,0]. GRPO on the sum [2,1,1,0]
    # ties samples 1 and 2; GDPO gives each component +-0.866 and sums:
    # [1.732, 0, 0, -1.732] -> whitened (mean 0, unbiased std 1.41421) -> [1.2247, 0, 0, -1.2247]
    comps = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    r, m = outcome(comps.sum(-1).tolist(), [1, 1, 1, 1], t=1)
    adv, _ = get_adv_estimator("gdpo")(
        token_level_rewards=r, response_mask=m, index=[0] * 4, reward_components=comps
    )
    assert adv[:, 0].tolist() == pytest.approx([1.224745, 0.0, 0.0, -1.224745], abs=1e-5)


# ------------------------------------------------------------------ loop oracles
def _oracle_group(scores, idx, valid, fn):
    out = [0.0] * len(scores)
    groups = {}
    for i, g in enumerate(idx):
        if valid[i]:
            groups.setdefault(g, []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        vals = [scores[i] for i in members]
        for i in members:
            out[i] = fn(scores[i], vals, i, members)
    return out


def _std(v):
    mu = sum(v) / len(v)
    return math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))


ORACLES = {
    "grpo": lambda s, v, i, mem: (s - sum(v) / len(v)) / (_std(v) + 1e-6),
    "rloo": lambda s, v, i, mem: s - (sum(v) - s) / (len(v) - 1),
}


def _random_batch(seed, b=24, t=6, groups=5, fail_rate=0.15):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g).tolist()
    scores = torch.randint(0, 3, (b,), generator=g).double().tolist()
    r, m = outcome(scores, lengths, t)
    idx = torch.randint(0, groups, (b,), generator=g).numpy()
    sample_mask = (torch.rand(b, generator=g) > fail_rate).numpy()
    r[~torch.as_tensor(sample_mask)] = float("nan")  # failed rewards are NaN
    return r, m, idx, sample_mask, scores


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("seed", range(5))
def test_group_estimators_match_loop(name, seed):
    r, m, idx, sm, scores = _random_batch(seed)
    adv, _ = get_adv_estimator(name)(
        token_level_rewards=r, response_mask=m, index=idx, sample_mask=sm
    )
    # zero-length rows hold their reward at no token; score = sum over T (verl)
    sums = [0.0 if not sm[i] else float(torch.nansum(r[i])) for i in range(len(scores))]
    exp = _oracle_group(sums, idx.tolist(), sm.tolist(), ORACLES[name])
    assert torch.isfinite(adv).all()
    got, exp = seq_adv(adv, m, exp)
    assert got == pytest.approx(exp, abs=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_opo_passk_gpg_match_loop(seed):
    r, m, idx, sm, _ = _random_batch(seed, fail_rate=0.0)
    s = r.sum(-1).tolist()
    lens = m.sum(-1).tolist()
    il = idx.tolist()
    valid = [True] * len(s)
    opo = _oracle_group(
        s,
        il,
        valid,
        lambda x, v, i, mem: (
            x - sum(lens[j] * s[j] for j in mem) / max(sum(lens[j] for j in mem), 1e-8)
        ),
    )
    adv, _ = get_adv_estimator("opo")(token_level_rewards=r, response_mask=m, index=idx)
    got, exp = seq_adv(adv, m, opo)
    assert got == pytest.approx(exp, abs=1e-9)

    def passk(x, v, i, mem):
        order = sorted(mem, key=lambda j: -s[j])  # stable: first best index wins
        if i != order[0]:
            return 0.0
        return (s[order[0]] - s[order[1]]) / (_std(v) + 1e-6)

    adv, _ = get_adv_estimator("grpo_passk")(token_level_rewards=r, response_mask=m, index=idx)
    got, exp = seq_adv(adv, m, _oracle_group(s, il, valid, passk))
    assert got == pytest.approx(exp, abs=1e-9)

    alpha = len(s) / max(sum(1 for x in s if x != 0), 1)
    gpg = _oracle_group(s, il, valid, lambda x, v, i, mem: alpha * (x - sum(v) / len(v)))
    adv, _ = get_adv_estimator("gpg")(token_level_rewards=r, response_mask=m, index=idx)
    got, exp = seq_adv(adv, m, gpg)
    assert got == pytest.approx(exp, abs=1e-9)


def _whiten_oracle(values, mask):
    vals = [values[i][t] for i in range(len(values)) for t in range(len(values[i])) if mask[i][t]]
    if len(vals) < 2:
        return [[0.0] * len(row) for row in values]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    return [
        [
            (values[i][t] - mu) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0
            for t in range(len(values[i]))
        ]
        for i in range(len(values))
    ]


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_textbook_loop(seed):
    """GAE with observation tokens (mask 0 inside) == textbook GAE on the compressed sequence."""
    g = torch.Generator().manual_seed(seed)
    b, t, gamma, lam = 5, 7, 0.9, 0.8
    r = torch.randn(b, t, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, generator=g, dtype=torch.float64)
    m = (torch.rand(b, t, generator=g) < 0.7).double()
    adv, ret = get_adv_estimator("gae")(
        token_level_rewards=r, response_mask=m, values=v, gamma=gamma, lam=lam
    )
    raw = [[0.0] * t for _ in range(b)]
    ret_exp = [[0.0] * t for _ in range(b)]
    for i in range(b):
        pos = [k for k in range(t) if m[i, k]]
        for j, k in enumerate(pos):
            a = 0.0
            for ll, kk in enumerate(pos[j:]):  # A_t = sum_l (gamma lam)^l delta_{t+l}
                nxt = v[i, pos[j + ll + 1]].item() if j + ll + 1 < len(pos) else 0.0
                a += (gamma * lam) ** ll * (r[i, kk].item() + gamma * nxt - v[i, kk].item())
            raw[i][k] = a
            ret_exp[i][k] = a + v[i, k].item()
    assert torch.allclose(ret, torch.tensor(ret_exp, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(
        adv, torch.tensor(_whiten_oracle(raw, m.tolist()), dtype=torch.float64), atol=1e-9
    )


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_pp_matches_loop(gamma):
    g = torch.Generator().manual_seed(3)
    r, m = outcome([1.0, -2.0, 0.5, 3.0], [4, 2, 3, 1])
    r = r + torch.randn(r.shape, generator=g, dtype=torch.float64) * m  # dense rewards
    adv, ret = get_adv_estimator("reinforce_plus_plus")(
        token_level_rewards=r, response_mask=m, gamma=gamma
    )
    exp = [
        [
            sum(gamma ** (k - t) * r[i, k].item() for k in range(t, int(m[i].sum())))
            if m[i, t]
            else 0.0
            for t in range(4)
        ]
        for i in range(4)
    ]
    assert torch.allclose(ret, torch.tensor(exp, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(
        adv, torch.tensor(_whiten_oracle(exp, m.tolist()), dtype=torch.float64), atol=1e-9
    )


def test_rpp_baseline_and_gdpo_match_loop():
    r, m, idx, sm, _ = _random_batch(11, fail_rate=0.0)
    s = r.sum(-1).tolist()
    cent = _oracle_group(s, idx.tolist(), [True] * len(s), lambda x, v, i, mem: x - sum(v) / len(v))
    counts = {g: list(idx).count(g) for g in set(idx.tolist())}
    use = [[bool(m[i, t]) and counts[idx[i]] > 1 for t in range(m.shape[1])] for i in range(len(s))]
    exp = _whiten_oracle([[c] * m.shape[1] for c in cent], use)
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=r, response_mask=m, index=idx
    )
    assert torch.allclose(adv, torch.tensor(exp, dtype=torch.float64), atol=1e-9)
    # GDPO with one component == GRPO then whitening
    grpo = _oracle_group(s, idx.tolist(), [True] * len(s), ORACLES["grpo"])
    exp = _whiten_oracle([[c] * m.shape[1] for c in grpo], use)
    adv, _ = get_adv_estimator("gdpo")(token_level_rewards=r, response_mask=m, index=idx)
    assert torch.allclose(adv, torch.tensor(exp, dtype=torch.float64), atol=1e-9)


def test_optimal_token_baseline_matches_loop():
    g = torch.Generator().manual_seed(5)
    b, t = 6, 5
    r, m = outcome([1.0, 0.0, 1.0, 0.0, 2.0, 1.0], [5, 3, 4, 2, 5, 1], t)
    idx = np.array([0, 0, 0, 1, 1, 2])
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    spi2 = torch.rand(b, t, generator=g, dtype=torch.float64) * 0.5
    adv, ret = get_adv_estimator("optimal_token_baseline")(
        token_level_rewards=r, response_mask=m, index=idx, old_log_probs=old, sum_pi_squared=spi2
    )
    G = [
        [sum(r[i, k].item() for k in range(tt, t) if m[i, k]) if m[i, tt] else 0 for tt in range(t)]
        for i in range(b)
    ]
    W = [
        [
            sum((1 - 2 * math.exp(old[i, k]) + spi2[i, k].item()) for k in range(tt + 1) if m[i, k])
            if m[i, tt]
            else 0
            for tt in range(t)
        ]
        for i in range(b)
    ]
    exp = [[0.0] * t for _ in range(b)]
    lens = [int(m[i].sum()) for i in range(b)]
    for gid in set(idx.tolist()):
        mem = [i for i in range(b) if idx[i] == gid]
        if len(mem) < 2:
            continue
        srt = sorted(lens[i] for i in mem)
        for i in mem:
            for tt in range(lens[i]):
                base = sum(G[j][tt] * W[j][tt] for j in mem) / (sum(W[j][tt] for j in mem) + 1e-8)
                if lens[i] == srt[-1] and srt.count(srt[-1]) == 1 and tt >= srt[-2]:
                    base = 0.0  # zero tail of the unique longest sample
                exp[i][tt] = G[i][tt] - base
    assert torch.allclose(adv, torch.tensor(exp, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(ret, torch.tensor(G, dtype=torch.float64), atol=1e-9)


# ------------------------------------------------------------------ edge cases
ALL_KW = dict(gamma=0.95, lam=0.9, epsilon=1e-6, norm_adv_by_std_in_grpo=True, unknown_kw=123)


def _call(name, r, m, idx, sm=None):
    b, t = r.shape
    extra = dict(
        values=torch.zeros(b, t, dtype=r.dtype),
        reward_baselines=torch.zeros(b, dtype=r.dtype),
        old_log_probs=torch.full((b, t), -1.0, dtype=r.dtype),
        sum_pi_squared=torch.full((b, t), 0.3, dtype=r.dtype),
    )
    return get_adv_estimator(name)(
        token_level_rewards=r, response_mask=m, index=idx, sample_mask=sm, **extra, **ALL_KW
    )


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_no_nan_edge_cases(name):
    # groups of one, all-equal groups, zero-length responses, failed (NaN) rewards
    r, m = outcome([1.0, 1.0, 1.0, 5.0, 2.0, 0.0], [3, 4, 2, 0, 4, 1])
    r[5, 0] = float("nan")
    idx = ["eq", "eq", "eq", "zero_len", "single", "failed"]
    sm = [True, True, True, True, True, False]
    adv, ret = _call(name, r, m, idx, sm)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
    assert (adv[m == 0] == 0).all(), name
    assert (adv[5] == 0).all(), name  # failed sample
    if ADV_ESTIMATORS.meta(name)["outcome"] and name not in ("gdpo", "remax"):
        assert (adv == 0).all(), name  # all-equal group, groups of one -> no signal


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline", "gdpo"]
)
def test_sample_mask_excludes_from_group_stats(name):
    # a failed sample (NaN reward, or any reward) must not change the others' advantages
    r, m = outcome([1.0, 0.0, 0.5, 7.0], [2, 2, 2, 2])
    base, _ = _call(name, r[:3], m[:3], [0, 0, 0])
    r2 = r.clone()
    r2[3, 1] = float("nan")
    adv, _ = _call(name, r2, m, [0, 0, 0, 0], [True, True, True, False])
    assert torch.allclose(adv[:3], base, atol=1e-12), name
    assert (adv[3] == 0).all()
    # explicit sample_mask False with a finite reward: same result
    adv, _ = _call(name, r, m, [0, 0, 0, 0], np.array([True, True, True, False]))
    assert torch.allclose(adv[:3], base, atol=1e-12), name


def test_missing_needs_raise():
    r, m = outcome([1.0], [1])
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        get_adv_estimator("optimal_token_baseline")(
            token_level_rewards=r, response_mask=m, index=[0], old_log_probs=torch.zeros(1, 4)
        )


def test_index_kinds_and_tensor_index():
    r, m = outcome([1.0, 0.0, 3.0, 1.0], [1, 1, 1, 1])
    fn = get_adv_estimator("grpo")
    a1, _ = fn(token_level_rewards=r, response_mask=m, index=["x", "x", "y", "y"])
    a2, _ = fn(token_level_rewards=r, response_mask=m, index=torch.tensor([5, 5, 2, 2]))
    a3, _ = fn(
        token_level_rewards=r,
        response_mask=m,
        index=np.array([("a", 1), ("a", 1), 3, 3], dtype=object),
    )
    assert torch.allclose(a1, a2) and torch.allclose(a1, a3)
