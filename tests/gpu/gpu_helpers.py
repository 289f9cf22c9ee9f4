"""Helpers of the CUDA tests (a separate module: ``conftest`` names are not importable safely)."""

from __future__ import annotations

import socket

from postrl.testing import synth_batch

__all__ = ["free_port", "synth_batch"]


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for a one-rank process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
