"""Fixtures of the engine tests: synthetic RL batches in the trainer's layout."""

from __future__ import annotations

import pytest

from postrl.testing import synth_batch


@pytest.fixture
def make_batch():
    """Return :func:`synth_batch`."""
    return synth_batch
