"""Rollout backend registry and factory.

``ROLLOUT_BACKENDS`` maps a name to a backend class whose constructor is
``cls(model_path, **options)``. ``native`` and ``hf`` are registered lazily by import path, as are
``vllm`` and ``sglang`` (which need optional extras), so ``import postrl.rollout`` imports none
of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from postrl.registry import Registry

__all__ = ["ROLLOUT_BACKENDS", "register_rollout_backend", "create_rollout_backend"]

T = TypeVar("T")

ROLLOUT_BACKENDS: Registry[Any] = Registry("rollout backend")
ROLLOUT_BACKENDS.add_lazy("native", "postrl.rollout.native.engine:NativeBackend", device="cpu|cuda")
ROLLOUT_BACKENDS.add_lazy("hf", "postrl.rollout.hf_backend:HFBackend", device="cpu|cuda")
ROLLOUT_BACKENDS.add_lazy(
    "vllm", "postrl.rollout.vllm_backend:VLLMBackend", extra="vllm", device="cuda"
)
ROLLOUT_BACKENDS.add_lazy(
    "sglang", "postrl.rollout.sglang_backend:SGLangBackend", extra="sglang", device="cuda"
)


def register_rollout_backend(name: str, **meta: Any) -> Callable[[T], T]:
    """Class decorator registering a rollout backend under ``name`` (constructor
    ``cls(model_path, **options)``)."""
    return ROLLOUT_BACKENDS.register(
        name, override=name in ("native", "hf", "vllm", "sglang"), **meta
    )


def create_rollout_backend(name: str, model_path: str | Path, **options: Any) -> Any:
    """Instantiate the backend registered as ``name`` for the HF model directory ``model_path``.

    ``options`` are backend-specific (native: ``max_num_seqs``, ``max_model_len``, ``device``,
    ``dtype``, ...). Unknown names raise listing the registered ones.
    """
    cls = ROLLOUT_BACKENDS.get(name)
    return cls(str(model_path), **options)
