"""Shared fixtures: tiny models are created once per session in a temp dir (nothing downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

FAULT_MODULES = (
    "tests/agent/test_tool_loop_faults.py",
    "tests/rollout/test_native_swap.py",
    "tests/rollout/test_ray_replica.py",
    "tests/rollout/test_replica_process.py",
    "tests/rollout/test_watchdog.py",
    "tests/testing/test_faults.py",
    "tests/trainer/test_fully_async.py",
    "tests/trainer/test_fully_async_ray.py",
    "tests/trainer/test_object_store.py",
    "tests/trainer/test_one_step_off.py",
)
"""The kill, hang, restart, weight-push and random-timing tests: marked ``fault``, which
``make test-stress`` (tests/stress.py) repeats under competing CPU load."""


SERIAL_MARKERS = ("fault", "ray", "vllm")
"""Tests with one of these markers are also marked ``serial``: ``tests/suite.py`` runs them
alone, after the parallel phase (faults must see the machine as a user's run would; one Ray
cluster and one vLLM engine at a time)."""


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`FAULT_MODULES` ``fault``, and those of :data:`SERIAL_MARKERS`
    ``serial``."""
    for item in items:
        if item.nodeid.split("::")[0] in FAULT_MODULES:
            item.add_marker(pytest.mark.fault)
        if any(item.get_closest_marker(m) for m in SERIAL_MARKERS):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Return ``make(arch="qwen2", preset="tiny", seed=0) -> Path``, cached per session."""
    from postrl.testing import make_model

    cache: dict[tuple[str, str, int], object] = {}

    def make(arch: str = "qwen2", preset: str = "tiny", seed: int = 0):
        key = (arch, preset, seed)
        if key not in cache:
            cache[key] = make_model(
                tmp_path_factory.mktemp(f"{arch}_{preset}_{seed}"),
                preset=preset,
                arch=arch,
                seed=seed,
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory):
    """Path of the default tiny qwen2 model."""
    return tiny_model_factory()
