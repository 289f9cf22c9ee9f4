"""Fault injection for crash-consistency tests: a callback that SIGKILLs at a named fault point.

Library code only calls :func:`postrl.trainer.hooks.fire` at its fault points (listed there:
``step3:after_gen``, ``step3:ckpt_components``, ``step4:end``, ...). This module provides the
callbacks a test installs:

- :func:`kill_at` builds a hook that SIGKILLs this process when the point is reached;
- :func:`install_kill_at` builds one and installs it in ``postrl.trainer.hooks.FAULT_HOOKS``;
- ``python -m postrl.testing.faults_run --kill-at POINT train CONFIG k=v ...`` runs any
  ``postrl`` command with the hook installed — how a test kills a training subprocess.
"""

from __future__ import annotations

import os
import signal

from postrl.trainer.hooks import install

__all__ = ["KillAt", "install_kill_at", "kill_at"]


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
