"""postrl.reward: reward functions by data_source, custom-function loading, the reward loop.

Public API (imported lazily so spawned reward workers start without torch)::

    from postrl.reward import (REWARD_FNS, register_reward_fn, load_custom_reward_fn,
                               RewardLoop, RewardStage, RewardRequest, RewardResult, RewardError,
                               RewardFailureError, build_reward_stage)

See ``docs/rewards.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "REWARD_FNS": "postrl.reward.registry",
    "register_reward_fn": "postrl.reward.registry",
    "get_reward_fn": "postrl.reward.registry",
    "default_compute_score": "postrl.reward.registry",
    "load_custom_reward_fn": "postrl.reward.custom",
    "CustomRewardError": "postrl.reward.custom",
    "RewardLoop": "postrl.reward.loop",
    "RewardStage": "postrl.reward.stage",
    "build_reward_stage": "postrl.reward.stage",
    "RewardRequest": "postrl.reward.types",
    "RewardResult": "postrl.reward.types",
    "SampleScore": "postrl.reward.types",
    "RewardError": "postrl.reward.types",
    "RewardFailureError": "postrl.reward.types",
    "FAILURE_REASONS": "postrl.reward.types",
    "format_reward": "postrl.reward.shaping",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'postrl.reward' has no attribute {name!r}")
