"""Fault injection for crash-consistency tests: ``POSTRL_KILL_AT=<point>`` SIGKILLs the process.

Points are named where the trainer calls :func:`maybe_kill`, e.g. ``step3:after_gen``,
``step3:ckpt_components`` (inside a checkpoint write, before its manifest) or ``step4:end``.
With the variable unset this is one dict lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["maybe_kill"]


def maybe_kill(point: str) -> None:
    """SIGKILL this process if ``POSTRL_KILL_AT`` equals ``point`` (testing only)."""
    if os.environ.get("POSTRL_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)
