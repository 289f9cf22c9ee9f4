"""``off_policy_health``: ESS/N, chi-square and KL(mu || pi_prox), checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algos import off_policy_health


def test_equal_log_probs_mean_no_mismatch():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    h = off_policy_health(lp, lp.clone(), mask)
    assert h == {"ess_ratio": 1.0, "chi2": 0.0, "kl_behav_prox": 0.0}
    assert all(isinstance(v, float) for v in h.values())


def test_skewed_weights_by_hand():
    # log w = old - rollout on the valid tokens: [log 2, 0, 0, log 1/2]; the masked token's
    # huge ratio must not count
    rollout = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.tensor([[math.log(2.0), 0.0, 50.0], [0.0, math.log(0.5), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.float32)
    h = off_policy_health(old, rollout, mask)
    w = [2.0, 1.0, 1.0, 0.5]
    ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w))  # 4.5^2 / (4 * 6.25) = 0.81
    assert ess == pytest.approx(0.81)
    assert h["ess_ratio"] == pytest.approx(ess, rel=1e-9)
    assert h["chi2"] == pytest.approx(sum(x * x for x in w) / 4 - 1.0, rel=1e-9)  # 0.5625
    # mean(log mu - log pi_prox) = -(log 2 + log 1/2) / 4 = 0
    assert h["kl_behav_prox"] == pytest.approx(0.0, abs=1e-12)


def test_one_dominant_weight_gives_ess_near_one_over_n_and_positive_kl():
    rollout = torch.full((1, 4), -3.0)
    old = torch.tensor([[-3.0 + 10.0, -3.0, -3.0, -3.0]])  # w = [e^10, 1, 1, 1]
    h = off_policy_health(old, rollout, torch.ones(1, 4))
    w = [math.exp(10.0), 1.0, 1.0, 1.0]
    assert h["ess_ratio"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)))
    assert 0.25 < h["ess_ratio"] < 0.2501
    assert h["kl_behav_prox"] == pytest.approx(-10.0 / 4)  # mu puts less mass there
    # pi_prox below mu on every token: KL(mu || pi_prox) k1 estimate is positive
    h = off_policy_health(rollout - 0.2, rollout, torch.ones(1, 4))
    assert h["kl_behav_prox"] == pytest.approx(0.2)
    assert h["ess_ratio"] == pytest.approx(1.0)  # a constant weight has full ESS
    assert h["chi2"] == pytest.approx(math.exp(-0.4) - 1.0)


def test_empty_mask_and_extreme_values_stay_finite():
    lp = torch.randn(2, 3)
    h = off_policy_health(lp, lp + 1.0, torch.zeros(2, 3))
    assert h == {"ess_ratio": 1.0, "chi2": 0.0, "kl_behav_prox": 0.0}
    old = torch.tensor([[0.0, float("nan"), 1e4]])
    h = off_policy_health(old, torch.zeros(1, 3), torch.ones(1, 3))
    assert all(math.isfinite(v) for v in h.values())
    assert 0.0 < h["ess_ratio"] <= 1.0


def test_shape_mismatch_names_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        off_policy_health(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
