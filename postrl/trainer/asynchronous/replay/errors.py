"""Typed errors of the replay buffer (each message says what happened and the fix)."""

from __future__ import annotations

__all__ = ["ReplayTimeoutError", "StalenessBoundError", "AdmissionError"]


class ReplayTimeoutError(TimeoutError):
    """A buffer wait passed its deadline; the message says what it waited for and what it had."""


class StalenessBoundError(RuntimeError):
    """The ``wait`` strategy cannot keep ``max_staleness``: more groups must be trained at this
    version than one update takes (admission beyond the pacing cap, or versions skipped)."""


class AdmissionError(RuntimeError):
    """``admit`` beyond the pacing cap, or a uid admitted twice."""
