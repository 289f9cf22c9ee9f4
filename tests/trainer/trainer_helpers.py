"""Helpers shared by the trainer tests.

Imported by module name: pytest puts this folder on sys.path.
"""

from __future__ import annotations

from typing import Any

import torch


def actor_params(trainer: Any) -> dict[str, torch.Tensor]:
    """A detached copy of the actor's weights (HF names)."""
    return {k: v.detach().clone() for k, v in trainer.roles.actor.get_per_tensor_param()}


def fit_with_snapshots(
    trainer: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]]:
    """``(actor weights before, last step's metrics, actor weights after)`` of ``trainer.fit()``."""
    before = actor_params(trainer)
    last = trainer.fit()
    return before, last, actor_params(trainer)
