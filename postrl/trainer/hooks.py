"""Fault points of the trainer: named places where callbacks installed by a test run.

The trainer calls :func:`fire` with a point name at the places where a crash is most
interesting for crash-consistency (exact-resume) tests:

- ``step{N}:after_gen``: step ``N``'s rollout has finished, nothing of the step is trained yet;
- ``step{N}:after_update``: step ``N``'s update ran, its weights are neither pushed to the
  rollout nor saved (an async mode has the next batch in flight);
- ``step{N}:ckpt_components``: inside step ``N``'s checkpoint write, the components are on
  disk in the temporary directory but the manifest is not (an unfinished checkpoint);
- ``step{N}:end``: step ``N`` is logged (and saved when ``save_freq`` says so).

The library installs nothing and never reads an environment variable here: with no callback
installed :func:`fire` is one truthiness check of an empty list. A test installs a callback
(``postrl.testing.faults.install_kill_at("step3:after_gen")`` SIGKILLs the process there; a
run in a subprocess does it through ``python -m postrl.testing.faults_run``). A callback gets
the point name and may do anything — raise, sleep, record, kill; an exception it raises
propagates out of the trainer at that point, like any other failure.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FAULT_HOOKS", "FaultHook", "fire", "install", "uninstall"]

FaultHook = Callable[[str], None]
"""A callback run at every fault point with the point's name, e.g. ``"step3:after_gen"``."""

FAULT_HOOKS: list[FaultHook] = []
"""The installed callbacks, run in installation order; empty unless a test installed one."""


def fire(point: str) -> None:
    """Run every installed callback with ``point`` (nothing to do when none is installed)."""
    if FAULT_HOOKS:
        for hook in tuple(FAULT_HOOKS):  # a hook may uninstall itself
            hook(point)


def install(hook: FaultHook) -> FaultHook:
    """Append ``hook`` to :data:`FAULT_HOOKS` and return it (to :func:`uninstall` it later)."""
    if not callable(hook):
        raise TypeError(f"a fault hook must be callable with the point name, got {hook!r}")
    FAULT_HOOKS.append(hook)
    return hook


def uninstall(hook: FaultHook) -> None:
    """Remove ``hook`` from :data:`FAULT_HOOKS`; raises ``ValueError`` if it is not installed."""
    try:
        FAULT_HOOKS.remove(hook)
    except ValueError:
        raise ValueError(
            f"fault hook {hook!r} is not installed (installed: {FAULT_HOOKS!r})"
        ) from None
