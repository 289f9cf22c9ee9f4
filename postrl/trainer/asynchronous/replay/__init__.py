"""The replay buffer of async training: tags (control plane), the trajectory store (data
plane), the event-driven :class:`ReplayBuffer` and its samplers. See ``docs/async.md``."""

from postrl.trainer.asynchronous.replay.buffer import EVICTION_REASONS, STRATEGIES, ReplayBuffer
from postrl.trainer.asynchronous.replay.errors import (
    AdmissionError,
    ReplayTimeoutError,
    StalenessBoundError,
)
from postrl.trainer.asynchronous.replay.samplers import (
    SAMPLERS,
    OldestFirstSampler,
    Sampler,
    build_sampler,
)
from postrl.trainer.asynchronous.replay.store import (
    LocalTrajectoryStore,
    MissingTrajectoryError,
    TrajectoryStore,
)
from postrl.trainer.asynchronous.replay.tags import (
    Eviction,
    GroupTags,
    TrajectoryKey,
    TrajectoryStatus,
    TrajectoryTag,
    version_range,
)

__all__ = [
    "EVICTION_REASONS",
    "STRATEGIES",
    "AdmissionError",
    "Eviction",
    "ReplayBuffer",
    "ReplayTimeoutError",
    "StalenessBoundError",
    "SAMPLERS",
    "OldestFirstSampler",
    "Sampler",
    "build_sampler",
    "LocalTrajectoryStore",
    "MissingTrajectoryError",
    "TrajectoryStore",
    "GroupTags",
    "TrajectoryKey",
    "TrajectoryStatus",
    "TrajectoryTag",
    "version_range",
]
