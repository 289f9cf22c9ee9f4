"""postrl.algos stays pure (no ray/transformers/config import) and its registries behave."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import postrl.algos as A
from postrl.registry import RegistryError


def test_import_is_pure():
    code = (
        "import sys, postrl.algos; "
        "bad=[m for m in ('ray','transformers','postrl.config') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_required_names_registered():
    assert {
        "gae",
        "grpo",
        "grpo_passk",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
        "gdpo",
        "optimal_token_baseline",
    } <= set(A.ADV_ESTIMATORS.names())
    assert {
        "vanilla",
        "gspo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "cispo",
        "sapo",
        "bypass_mode",
        "reinforce",
    } <= set(A.POLICY_LOSSES.names())
    assert {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+"} <= set(
        A.KL_ESTIMATORS.names()
    )
    assert set(A.AGG_MODES.names()) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }


def test_meta_declares_needs():
    assert A.ADV_ESTIMATORS.meta("gae")["needs"] == ("values",)
    assert A.ADV_ESTIMATORS.meta("remax")["needs"] == ("reward_baselines",)
    assert A.ADV_ESTIMATORS.meta("grpo")["needs"] == ()
    assert A.ADV_ESTIMATORS.meta("grpo")["outcome"] is True
    assert A.ADV_ESTIMATORS.meta("gae")["outcome"] is False


def test_unknown_names_list_choices():
    with pytest.raises(RegistryError, match="did you mean 'grpo'"):
        A.get_adv_estimator("grpoo")
    with pytest.raises(RegistryError, match="vanilla"):
        A.get_policy_loss("nope")
    with pytest.raises(RegistryError, match="low_var_kl"):
        A.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "low_var")
    with pytest.raises(RegistryError, match="token-mean"):
        A.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-meen")


def test_user_registration_from_outside():
    @A.register_adv_est("test_user_est_zero", needs=())
    def zero(*, token_level_rewards, response_mask, **kw):
        z = torch.zeros_like(token_level_rewards)
        return z, z

    fn = A.get_adv_estimator("test_user_est_zero")
    adv, _ = fn(token_level_rewards=torch.ones(2, 3), response_mask=torch.ones(2, 3), index=[0, 0])
    assert adv.abs().sum() == 0
    with pytest.raises(RegistryError, match="already registered"):
        A.register_adv_est("test_user_est_zero")(zero)
