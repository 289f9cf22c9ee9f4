"""Fixtures of the CUDA tests (marker ``gpu``; ``benchmarks/gpu_check.sh`` runs them on a lent GPU).

Every test here takes the ``device`` fixture: ``cuda``, skipped cleanly when CUDA is absent. To
prove the code paths on a machine without a GPU, ``POSTRL_GPU_TEST_DEVICE=cpu`` runs the same
bodies on the CPU (``POSTRL_GPU_TEST_STEPS`` shortens the 20-step run there)::

    POSTRL_GPU_TEST_DEVICE=cpu POSTRL_GPU_TEST_STEPS=2 pytest -m gpu tests/gpu
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> str:
    """``cuda`` (skips without CUDA) or the ``POSTRL_GPU_TEST_DEVICE`` override."""
    dev = os.environ.get("POSTRL_GPU_TEST_DEVICE", "cuda")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (set POSTRL_GPU_TEST_DEVICE=cpu to run the bodies on CPU)")
    return dev
