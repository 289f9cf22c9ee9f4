"""Fault injection for crash-consistency tests: a callback that SIGKILLs at a named fault point.

Library code only calls :func:`postrl.trainer.hooks.fire` at its fault points (listed there:
``step3:after_gen``, ``step3:ckpt_components``, ``step4:end``, ...). This module provides the
callbacks a test installs:

- :func:`kill_at` builds a hook that SIGKILLs this process when the point is reached;
- :func:`install_kill_at` builds one and installs it in ``postrl.trainer.hooks.FAULT_HOOKS``;
- ``python -m postrl.testing.faults_run --kill-at POINT train CONFIG k=v ...`` runs any
  ``postrl`` command with the hook installed — how a test kills a training subprocess;
- :class:`CorruptSync` (``faults_run --corrupt-sync STEP`` / ``--corrupt-sync-always STEP``)
  corrupts one tensor of the weight sync after step ``STEP`` in transit (after its checksum was
  taken): once (the weight-sync contract resends and the run recovers) or on every try (the run
  stops naming the tensor).
"""

from __future__ import annotations

import os
import signal

import torch

from postrl.trainer.hooks import install

__all__ = ["CorruptSync", "KillAt", "install_corrupt_sync", "install_kill_at", "kill_at"]


class KillAt:
    """A fault hook that SIGKILLs this process at ``point`` and records the points it saw."""

    def __init__(self, point: str) -> None:
        if not isinstance(point, str) or not point:
            raise ValueError(
                f"kill point must be a non-empty string like 'step3:end', got {point!r}"
            )
        self.point = point
        self.seen: list[str] = []

    def __call__(self, point: str) -> None:
        self.seen.append(point)
        if point == self.point:
            os.kill(os.getpid(), signal.SIGKILL)

    def __repr__(self) -> str:
        return f"KillAt({self.point!r})"


def kill_at(point: str) -> KillAt:
    """A hook that SIGKILLs this process when the trainer reaches ``point`` (not installed)."""
    return KillAt(point)


def install_kill_at(point: str) -> KillAt:
    """Install a :class:`KillAt` hook for ``point`` and return it (``hooks.uninstall`` removes
    it)."""
    hook = KillAt(point)
    install(hook)
    return hook


class CorruptSync:
    """Corrupts the first tensor of the weight pushes that follow step ``step``'s update (its
    bytes + 0.5, after the sender's checksum): the first push only (``always=False``) or every
    push and resend (``always=True``). ``corrupted`` counts the tensors it changed; ``name``
    is the one it corrupts."""

    def __init__(self, step: int, always: bool = False) -> None:
        if step < 1:
            raise ValueError(f"--corrupt-sync STEP must be a step >= 1, got {step}")
        self.step, self.always = step, always
        self.armed = False
        self.corrupted = 0
        self.name: str | None = None

    def on_point(self, point: str) -> None:
        """Trainer fault hook: arm at ``step{step}:after_update``."""
        if point == f"step{self.step}:after_update":
            self.armed = True

    def on_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """Transport fault (``postrl.weights.verify.TRANSPORT_FAULTS``)."""
        if self.name is None:
            self.name = name
        if not self.armed or name != self.name:
            return None
        self.corrupted += 1
        self.armed = self.always
        return t.detach().clone() + 0.5


def install_corrupt_sync(step: int, always: bool = False) -> CorruptSync:
    """Install a :class:`CorruptSync` (trainer fault hook + weight transport fault)."""
    from postrl.weights.verify import TRANSPORT_FAULTS

    fault = CorruptSync(step, always)
    install(fault.on_point)
    TRANSPORT_FAULTS.append(fault.on_tensor)
    return fault
