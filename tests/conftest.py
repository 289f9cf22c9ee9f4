"""Shared fixtures: tiny models are created once per session in a temp dir (nothing downloaded)."""

from __future__ import annotations

import os
import sys

# Before torch loads its OpenMP runtime: a thread that waits for its team sleeps instead of
# spinning. The suite runs two xdist workers of two torch threads each on two cores; spinning
# threads burn the cycles the other worker's threads wait for (measured on the AVX2 kind: the
# distill, e2e and actor test files took 739 s with the default policy, 54 s with PASSIVE).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

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


SERIAL_MARKERS: tuple[str, ...] = ()
"""Tests with one of these markers are also marked ``serial``: ``tests/suite.py`` runs them
alone, after the parallel phase. Empty today: the fault tests wait on events with deadlines that
hold under load (``make test-stress`` repeats them next to busy loops), local Ray clusters are
per-process, and the vLLM engine takes 1 GiB of KV cache, so all of them share the two workers
with the rest. Mark a test ``serial`` by hand if it really must see an idle machine."""

SLOW_FIRST = (
    "tests/trainer/test_object_store.py",
    "tests/trainer/test_tool_rl.py",
    "tests/trainer/test_fully_async.py",
    "tests/trainer/test_determinism.py",
    "tests/trainer/test_vllm_train.py",
    "tests/trainer/test_one_step_off.py",
    "tests/trainer/test_distill.py",
    "tests/recipes/test_quickstart.py",
    "tests/trainer/test_resume.py",
    "tests/agent/test_verifiers.py",
    "tests/trainer/test_e2e.py",
    "tests/trainer/test_weight_contract.py",
    "tests/rollout/test_ray_replica.py",
    "tests/rollout/test_vllm.py",
    "tests/trainer/test_fully_async_ray.py",
    "tests/agent/test_gateway_train.py",
    "tests/trainer/test_dynamic_sampling.py",
    "tests/rollout/test_kernels.py",
)
"""Test files that take a minute or more, longest first (measured on the AVX2 kind). ``make test``
hands whole files to its two xdist workers in collection order (``--dist loadfile
--no-loadscopereorder``); starting the long files first keeps one worker from running a
two-minute file alone at the end (longest-processing-time-first scheduling)."""


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`FAULT_MODULES` ``fault`` and those of :data:`SERIAL_MARKERS`
    ``serial``; move the files of :data:`SLOW_FIRST` to the front (each file's own order kept)."""
    for item in items:
        if item.nodeid.split("::")[0] in FAULT_MODULES:
            item.add_marker(pytest.mark.fault)
        if any(item.get_closest_marker(m) for m in SERIAL_MARKERS):
            item.add_marker(pytest.mark.serial)
    rank = {f: i for i, f in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def load_benchmark():
    """Return ``load(name) -> module``: ``benchmarks/<name>.py`` (a script folder, not a
    package) imported as module ``bench_<name>``."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def load(name: str):
        spec = importlib.util.spec_from_file_location(
            f"bench_{name}", root / "benchmarks" / f"{name}.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses resolve string annotations through it
        spec.loader.exec_module(mod)
        return mod

    return load


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
