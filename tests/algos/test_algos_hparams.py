"""Hyperparameters of estimators and losses are typed keyword arguments, bound at startup."""

from __future__ import annotations

import inspect

import pytest
import torch

import postrl.algos as A
from postrl.algos.hparams import hparam_names


@pytest.mark.parametrize("name", A.POLICY_LOSSES.names())
def test_every_loss_declares_typed_hyperparameters(name):
    """No built-in loss hides hyperparameters in ``**kwargs`` (so every name can be checked)."""
    params = inspect.signature(A.get_policy_loss(name)).parameters.values()
    assert not any(p.kind is p.VAR_KEYWORD for p in params), name
    assert "norm_length" in hparam_names(A.get_policy_loss(name), A.POLICY_LOSS_INPUTS)


def test_misspelt_loss_hparam_is_an_error_with_did_you_mean():
    errs = A.policy_loss_hparam_errors("sapo", {"tau_poss": 2.0})
    assert len(errs) == 1
    assert "actor.policy_loss_kwargs.tau_poss" in errs[0] and "did you mean 'tau_pos'" in errs[0]
    assert "Accepted: norm_length, tau_neg, tau_pos" in errs[0]
    with pytest.raises(A.HParamError, match="did you mean 'tau_pos'"):
        A.bind_policy_loss("sapo", {"tau_poss": 2.0})


def test_loss_hparam_type_and_dedicated_fields():
    errs = A.policy_loss_hparam_errors("kl_cov", {"kl_cov_ratio": "big", "ppo_kl_coef": 2})
    assert errs == [
        "actor.policy_loss_kwargs.kl_cov_ratio='big': policy loss 'kl_cov' expects float "
        "(default 0.0002)"
    ]  # an int for a float is fine
    errs = A.policy_loss_hparam_errors("vanilla", {"clip_ratio_high": 0.28, "clip_ratio": 0.3})
    assert any("set actor.clip_ratio_high" in e for e in errs)
    assert any("set actor.clip_ratio_low and actor.clip_ratio_high" in e for e in errs)
    errs = A.policy_loss_hparam_errors("vanilla", {"rollout_is_weights": 1})
    assert "supplies per batch" in errs[0]


def test_bound_loss_uses_the_bound_values_and_shared_settings():
    """Shared settings reach only losses that declare them; bound values change the result."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    m = torch.ones_like(adv)
    common = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    sapo = A.bind_policy_loss("sapo", {"tau_pos": 2.0}, common=common)
    assert sapo.keywords == {"tau_pos": 2.0}  # sapo has no clip ratios: nothing else bound
    x = A.LossInputs(old, new, adv, m)
    got, _ = sapo(x)
    want, _ = A.get_policy_loss("sapo")(x, tau_pos=2.0)
    default, _ = A.get_policy_loss("sapo")(x)
    assert got.item() == want.item() != default.item()
    van = A.bind_policy_loss("vanilla", {}, common=common)
    assert van.keywords == common


def test_user_loss_with_var_kwargs_accepts_any_name():
    @A.register_policy_loss("test_hp_open_loss")
    def open_loss(x, **hparams):
        return (x.log_prob * 0).sum(), {}

    assert A.policy_loss_hparam_errors("test_hp_open_loss", {"anything": 1}) == []
    fn = A.bind_policy_loss("test_hp_open_loss", {"anything": 1}, common={"clip_ratio_c": 3.0})
    assert fn.keywords == {"anything": 1, "clip_ratio_c": 3.0}


def test_estimator_kwargs_checked_against_the_signature():
    assert A.adv_estimator_hparam_errors("grpo", {"epsilon": 1e-4}) == []
    errs = A.adv_estimator_hparam_errors("grpo", {"epsilonn": 1e-4})
    assert "did you mean 'epsilon'" in errs[0] and "Accepted: epsilon" in errs[0]
    # estimators' **kwargs absorb the uniform inputs, never unknown hyperparameters
    assert A.adv_estimator_hparam_errors("remax", {"epsilon": 1.0})
    errs = A.adv_estimator_hparam_errors("grpo", {"norm_adv_by_std_in_grpo": False})
    assert "set algorithm.norm_adv_by_std_in_grpo" in errs[0]
    errs = A.adv_estimator_hparam_errors("optimal_token_baseline", {"sum_pi_squared": 1})
    assert "supplies per batch" in errs[0]  # a need, not a hyperparameter
    assert A.adv_estimator_hparam_errors("gdpo", {"reward_weights": [1.0, 0.5]}) == []
    assert A.adv_estimator_hparam_errors("gdpo", {"reward_weights": "1,2"})
    assert A.adv_estimator_hparam_errors("gpg", {"f_norm": 2}) == []


def test_bound_estimator_uses_the_value():
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0]])
    mask = torch.ones_like(r)
    index = ["a", "a", "a"]
    fn = A.bind_adv_estimator("gpg", {"f_norm": 2.0})
    half, _ = fn(token_level_rewards=r, response_mask=mask, index=index, gamma=1.0)
    full, _ = A.get_adv_estimator("gpg")(token_level_rewards=r, response_mask=mask, index=index)
    assert torch.allclose(half * 2, full) and full.abs().sum() > 0
    with pytest.raises(A.HParamError, match="f_normm"):
        A.bind_adv_estimator("gpg", {"f_normm": 2.0})
