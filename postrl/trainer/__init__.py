"""The RL trainer: the step, its stages and hooks, modes, validation, checkpoint/resume.

Heavy modules are imported lazily: ``from postrl.trainer import RLTrainer`` works, and
``import postrl.trainer`` alone stays cheap.
"""

from postrl.trainer.asynchronous.fully_async import (
    FullyAsyncMode,  # registers fully_async, separate_async
)
from postrl.trainer.asynchronous.one_step_off import (
    OneStepOffMode,  # registers trainer.mode=one_step_off
)
from postrl.trainer.modes import TRAINER_MODES, SyncMode, TrainerMode, register_trainer

__all__ = [
    "TRAINER_MODES",
    "RLTrainer",
    "SyncMode",
    "OneStepOffMode",
    "FullyAsyncMode",
    "TrainerMode",
    "register_trainer",
]


def __getattr__(name: str):
    if name == "RLTrainer":
        from postrl.trainer.trainer import RLTrainer

        return RLTrainer
    raise AttributeError(f"module 'postrl.trainer' has no attribute {name!r}")
