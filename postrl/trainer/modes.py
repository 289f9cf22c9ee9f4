"""Trainer modes: how rollout and training share devices. They differ only in lifecycle hooks.

``step()`` (``postrl.trainer.trainer.RLTrainer.step``) is one function; a mode supplies
  * ``rollout(trainer, prompts, on_sample_end)`` — produce the batch of trajectories;
  * ``on_sample_end(trainer, i, output, row)`` — per finished trajectory (reward streaming);
  * ``sync_weights(trainer)`` — after the update, make the rollout use the new policy;
  * ``on_step_end(trainer, step, metrics)`` — bookkeeping after a step.

``sync`` is implemented here: rollout and training take turns on the same devices (the rollout
engine wakes for generation and sleeps — KV cache released — while the actor trains). The async
modes of the next wave register under other names without touching ``step()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from postrl.protocol import DataProto
from postrl.registry import Registry

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["TRAINER_MODES", "register_trainer", "TrainerMode", "SyncMode"]

TRAINER_MODES: Registry[type] = Registry("trainer mode")


def register_trainer(name: str, **meta: Any) -> Callable[[T], T]:
    """Class decorator registering a :class:`TrainerMode` under ``name`` (``trainer.mode``)."""
    return TRAINER_MODES.register(name, **meta)


class TrainerMode:
    """Base of trainer modes; override the hooks that differ."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._loop = asyncio.new_event_loop()

    def run_async(self, coro: Any) -> Any:
        """Run a coroutine on the mode's persistent event loop."""
        return self._loop.run_until_complete(coro)

    def rollout(
        self,
        prompts: DataProto,
        sampling: Any,
        n: int,
        step: int,
        on_sample_end: Callable[..., None] | None = None,
    ) -> DataProto:
        raise NotImplementedError

    def sync_weights(self) -> dict[str, float]:
        raise NotImplementedError

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """Called after every step (default: nothing)."""

    def close(self) -> None:
        self._loop.close()


@register_trainer("sync")
class SyncMode(TrainerMode):
    """Rollout and training alternate on the same devices (verl's hybrid engine)."""

    def rollout(
        self,
        prompts: DataProto,
        sampling: Any,
        n: int,
        step: int,
        on_sample_end: Callable[..., None] | None = None,
    ) -> DataProto:
        t = self.trainer
        t.rollout.wake_up()
        try:
            return self.run_async(
                t.agent_manager.generate(
                    prompts,
                    sampling,
                    n,
                    seed=t.cfg.trainer.seed,
                    step=step,
                    on_sample_end=on_sample_end,
                )
            )
        finally:
            if t.cfg.rollout.free_cache_engine:
                t.rollout.sleep()

    def sync_weights(self) -> dict[str, float]:
        return self.trainer.push_weights_to_rollout()
