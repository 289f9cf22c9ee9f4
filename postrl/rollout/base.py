"""Rollout backend registry and factory.

``ROLLOUT_BACKENDS`` maps a name to a backend class whose constructor is
``cls(model_path, **options)``. ``native`` and ``hf`` are registered lazily by import path, as are
``vllm`` and ``sglang`` (which need optional extras), so ``import postrl.rollout`` imports none
of them.

Facts an entry declares (callers read them, never the name): ``device`` (where it runs),
``own_process`` (its engine always runs in a replica process of its own, in every trainer mode:
vLLM pins packages the trainer's venv cannot hold) and ``python`` (that process's default
interpreter, relative to the working directory or the source tree; ``rollout.python``
overrides it), ``setup`` (how to get it where it is missing, shown before the pip extra).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from postrl.registry import Registry

__all__ = [
    "ROLLOUT_BACKENDS",
    "register_rollout_backend",
    "create_rollout_backend",
    "runs_in_own_process",
    "replica_python",
]

T = TypeVar("T")

ROLLOUT_BACKENDS: Registry[Any] = Registry("rollout backend")
ROLLOUT_BACKENDS.add_lazy("native", "postrl.rollout.native.engine:NativeBackend", device="cpu|cuda")
ROLLOUT_BACKENDS.add_lazy("hf", "postrl.rollout.hf_backend:HFBackend", device="cpu|cuda")
ROLLOUT_BACKENDS.add_lazy(
    "vllm",
    "postrl.rollout.vllm_backend:VLLMBackend",
    extra="vllm",
    device="cpu|cuda",
    own_process=True,
    python=".venv-vllm/bin/python",
    setup="on CPU: `make vllm-venv`; on GPU: ",
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


def runs_in_own_process(name: str) -> bool:
    """Whether backend ``name`` declares ``own_process`` (replicas always in processes)."""
    return bool(ROLLOUT_BACKENDS.meta(name).get("own_process"))


def replica_python(name: str, configured: str = "") -> str:
    """The interpreter a replica process of backend ``name`` runs: ``configured`` when given
    (``rollout.python``), else the entry's ``python`` default when that file exists (in the
    working directory, or beside the ``postrl`` source tree), else this interpreter."""
    import sys

    if configured:
        return configured
    default = ROLLOUT_BACKENDS.meta(name).get("python")
    if default:
        for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
            cand = root / default
            if cand.exists():
                return str(cand)
    return sys.executable
