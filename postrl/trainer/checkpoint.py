"""Atomic trainer checkpoints with a sha256 manifest, and resume from the newest complete one.

Layout::

    RUN_DIR/checkpoints/step_000012/
        actor/ critic/ ...        written by the workers (safetensors + JSON)
        trainer_state.json        step, dataloader position, KL controller, tracking state
        rng.safetensors           torch CPU RNG state (numpy/python states live in the JSON)
        manifest.json             sha256 + size of every file above (written last)

A checkpoint is written into ``step_N.tmp-<pid>`` and renamed into place only after the
manifest is complete, so a kill at any moment leaves either no ``step_N`` or a complete one.
``find_latest_checkpoint`` verifies manifests and logs every directory it skips. Nothing is
unpickled: tensors are safetensors, the rest JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "capture_rng_state",
    "restore_rng_state",
    "save_checkpoint",
    "find_latest_checkpoint",
    "load_trainer_state",
    "verify_manifest",
]


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupt (the message names the file)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def capture_rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able python/numpy RNG state, tensors for torch's RNG state)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    meta = {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }
    return meta, {"torch_cpu": torch.get_rng_state()}


def restore_rng_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(tensors["torch_cpu"])


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    write_components: Callable[[Path], None],
    keep_last: int = 0,
) -> Path:
    """Write ``step_{step}`` atomically; ``write_components(tmp_dir)`` writes the workers' parts.

    Returns the final directory. ``keep_last > 0`` deletes older complete checkpoints.
    """
    from safetensors.torch import save_file

    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_components(tmp)
    rng_meta, rng_tensors = capture_rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    state = dict(trainer_state, rng=rng_meta, step=step)
    (tmp / "trainer_state.json").write_text(json.dumps(state, sort_keys=True))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {
        str(p.relative_to(tmp)): {"sha256": _sha256(p), "size": p.stat().st_size} for p in files
    }
    mpath = tmp / "manifest.json"
    mpath.write_text(json.dumps({"step": step, "files": manifest}, sort_keys=True))
    with mpath.open("rb") as f:
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last > 0:
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and ".tmp-" not in p.name)
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint written: %s", final)
    return final


def verify_manifest(ckpt: str | Path) -> None:
    """Raise :class:`CheckpointError` unless every manifest entry exists with its sha256."""
    ckpt = Path(ckpt)
    mpath = ckpt / "manifest.json"
    if not mpath.exists():
        raise CheckpointError(f"{ckpt}: no manifest.json (incomplete checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
    for rel, info in manifest.items():
        p = ckpt / rel
        if not p.exists():
            raise CheckpointError(f"{ckpt}: file {rel} listed in the manifest is missing")
        if p.stat().st_size != info["size"] or _sha256(p) != info["sha256"]:
            raise CheckpointError(f"{ckpt}: file {rel} does not match its sha256 in the manifest")


def find_latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """Newest complete checkpoint under ``ckpt_root`` (skipped ones are logged), or None."""
    root = Path(ckpt_root)
    if not root.exists():
        return None
    candidates = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), reverse=True
    )
    for c in candidates:
        if ".tmp-" in c.name:
            logger.warning("skipping unfinished checkpoint %s (interrupted while writing)", c)
            continue
        try:
            verify_manifest(c)
        except CheckpointError as e:
            logger.warning("skipping checkpoint: %s", e)
            continue
        return c
    return None


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """Verify ``ckpt`` and return its trainer state; restores the RNG states."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    verify_manifest(ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    restore_rng_state(state["rng"], load_file(str(ckpt / "rng.safetensors")))
    return state
