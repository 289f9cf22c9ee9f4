"""Typed configs: dataclasses per component, YAML + ``key=value`` overrides, startup validation."""

from postrl.config.loader import (
    ConfigError,
    apply_overrides,
    dump_config,
    from_dict,
    load_config,
    to_dict,
)
from postrl.config.schema import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PostRLConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from postrl.config.validate import validate_config

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "PostRLConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "apply_overrides",
    "dump_config",
    "from_dict",
    "load_config",
    "to_dict",
    "validate_config",
]
