"""postrl.rollout — token-in/token-out inference backends behind one async interface.

``import postrl.rollout`` is cheap: backends (``native``, ``hf``, ``vllm``, ``sglang``) are
registered lazily and imported on first ``create_rollout_backend(name, ...)``.
"""

from postrl.rollout.base import ROLLOUT_BACKENDS, create_rollout_backend, register_rollout_backend
from postrl.rollout.client import LoadBalancer, RolloutClient, RolloutReplica
from postrl.rollout.replica import RemoteReplica, Replica
from postrl.rollout.types import (
    FinishReason,
    ReplicaDeadError,
    ReplicaRestartError,
    RolloutBackend,
    RolloutError,
    RolloutTimeoutError,
    SamplingParams,
    TokenOutput,
    WeightItem,
)

__all__ = [
    "LoadBalancer",
    "RolloutClient",
    "RolloutReplica",
    "RemoteReplica",
    "Replica",
    "ROLLOUT_BACKENDS",
    "create_rollout_backend",
    "register_rollout_backend",
    "FinishReason",
    "ReplicaDeadError",
    "ReplicaRestartError",
    "RolloutBackend",
    "RolloutError",
    "RolloutTimeoutError",
    "SamplingParams",
    "TokenOutput",
    "WeightItem",
]
