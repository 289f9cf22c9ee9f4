"""postrl.algos — pure tensor math of RL post-training (torch + numpy only).

Registries (each a :class:`postrl.registry.Registry`; users add entries from outside with the
decorators and select them by name in the config):

* ``ADV_ESTIMATORS`` — :func:`register_adv_est`, :func:`get_adv_estimator`
  (``algorithm.adv_estimator``);
* ``POLICY_LOSSES`` — :func:`register_policy_loss`, :func:`get_policy_loss`
  (``actor.policy_loss``); each loss takes one frozen :class:`LossInputs`;
* ``KL_ESTIMATORS`` — :func:`register_kl_estimator`, :func:`kl_penalty`
  (``actor.kl_loss_type``, ``algorithm.kl_penalty``);
* ``AGG_MODES`` — :func:`register_agg_mode`, :func:`agg_loss` (``actor.loss_agg_mode``);
* ``DISTILL_LOSSES`` — :func:`register_distill_loss` (``distill.loss``: on-policy distillation
  from a teacher, ``postrl/algos/distill.py``).

Hyperparameters are typed keyword-only arguments, bound once at startup:
:func:`bind_policy_loss` (``actor.policy_loss_kwargs``), :func:`bind_adv_estimator`
(``algorithm.adv_estimator_kwargs``); ``*_hparam_errors`` list the problems for config validation
(unknown names with a did-you-mean, wrong types).

Importing this package loads neither ray, transformers nor the config system. See
``docs/algorithms.md`` for the paper index.
"""

from postrl.algos import advantages_extra as _advantages_extra  # noqa: F401  (registers)
from postrl.algos import policy_losses_cov as _policy_losses_cov  # noqa: F401  (registers)
from postrl.algos import policy_losses_decoupled as _policy_losses_decoupled  # noqa: F401
from postrl.algos.advantages import (
    ADV_ESTIMATOR_INPUTS,
    ADV_ESTIMATORS,
    adv_estimator_hparam_errors,
    bind_adv_estimator,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    register_adv_est,
)
from postrl.algos.advantages_extra import (
    compute_gdpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_optimal_token_baseline_advantage,
)
from postrl.algos.aggregation import AGG_MODES, agg_loss, register_agg_mode
from postrl.algos.dapo import filter_groups, overlong_reward_penalty
from postrl.algos.distill import DISTILL_LOSSES, register_distill_loss
from postrl.algos.entropy import adapt_entropy_coeff, entropy_from_logits
from postrl.algos.health import off_policy_health
from postrl.algos.hparams import HParamError
from postrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    compute_rewards,
    kl_penalty,
    register_kl_estimator,
)
from postrl.algos.policy_losses import (
    POLICY_LOSS_INPUTS,
    POLICY_LOSSES,
    LossInputs,
    bind_policy_loss,
    get_policy_loss,
    policy_loss_hparam_errors,
    register_policy_loss,
)
from postrl.algos.rollout_correction import (
    compute_rollout_correction,
    rollout_correction_with_health,
)
from postrl.algos.utils import (
    compute_response_mask,
    group_ids,
    local_denominators,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from postrl.algos.value import compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_INPUTS",
    "ADV_ESTIMATORS",
    "HParamError",
    "LossInputs",
    "POLICY_LOSS_INPUTS",
    "adv_estimator_hparam_errors",
    "bind_adv_estimator",
    "bind_policy_loss",
    "policy_loss_hparam_errors",
    "AGG_MODES",
    "DISTILL_LOSSES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_kl_loss",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_response_mask",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction",
    "rollout_correction_with_health",
    "compute_value_loss",
    "adapt_entropy_coeff",
    "entropy_from_logits",
    "filter_groups",
    "get_adv_estimator",
    "get_policy_loss",
    "group_ids",
    "kl_penalty",
    "local_denominators",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "off_policy_health",
    "overlong_reward_penalty",
    "register_adv_est",
    "register_agg_mode",
    "register_distill_loss",
    "register_kl_estimator",
    "register_policy_loss",
]
