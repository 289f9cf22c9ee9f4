"""``DataProto``: the batch container that flows through every stage of an RL step.

A ``DataProto`` holds
  * ``batch``: a dict of tensors that all share the leading batch dimension ``B``;
  * ``non_tensor_batch``: a dict of numpy object arrays of length ``B`` (messages, ground truth,
    uids, ...);
  * ``meta_info``: a plain dict of batch-level values (temperature, global token counts, ...).

All operations return new objects (views where torch/numpy allow); the in-place ones end in
``_``. Errors name the offending key and sizes.

We deliberately do not depend on ``tensordict``: a dict of tensors with checked batch sizes is
all the system needs, imports in milliseconds and pickles cheaply (Ray moves tensors zero-copy
through its object store; numpy object arrays pickle as lists).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["DataProto", "DataProtoError"]


class DataProtoError(ValueError):
    """Raised for mismatched batch sizes, missing keys or conflicting unions."""


def _as_object_array(values: Any, key: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


@dataclass
class DataProto:
    """Tensors + non-tensor arrays + meta info with one batch dimension.

    Construct with :meth:`from_dict` (checks sizes) or directly (then call :meth:`check`).
    """

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build a checked ``DataProto``; non-tensor values become numpy object arrays."""
        nt = {k: _as_object_array(v, k) for k, v in (non_tensors or {}).items()}
        out = cls(dict(tensors or {}), nt, dict(meta_info or {}))
        out.check()
        return out

    def check(self) -> None:
        """Raise ``DataProtoError`` unless every tensor and array has the same batch size."""
        sizes = {
            f"batch[{k!r}]": (v.shape[0] if v.dim() > 0 else None) for k, v in self.batch.items()
        }
        sizes.update({f"non_tensor_batch[{k!r}]": len(v) for k, v in self.non_tensor_batch.items()})
        for k, v in self.non_tensor_batch.items():
            if not isinstance(v, np.ndarray):
                raise DataProtoError(
                    f"non_tensor_batch[{k!r}] must be a numpy array, got {type(v).__name__}"
                )
        distinct = set(sizes.values())
        if None in distinct:
            bad = [k for k, s in sizes.items() if s is None]
            raise DataProtoError(f"{bad[0]} is a 0-d tensor; every entry needs a batch dimension")
        if len(distinct) > 1:
            detail = ", ".join(f"{k}: {s}" for k, s in sizes.items())
            raise DataProtoError(f"batch sizes differ ({detail}); all entries must share dim 0")

    def __len__(self) -> int:
        for v in self.batch.values():
            return int(v.shape[0])
        for v in self.non_tensor_batch.values():
            return len(v)
        return 0

    # ------------------------------------------------------------------ indexing
    def __getitem__(
        self, item: int | slice | Sequence[int] | torch.Tensor | np.ndarray
    ) -> DataProto:
        """Index or slice rows; an int returns a batch of one row (dimension kept)."""
        if isinstance(item, int):
            item = slice(item, item + 1 if item != -1 else None)
        if isinstance(item, slice):
            return DataProto(
                {k: v[item] for k, v in self.batch.items()},
                {k: v[item] for k, v in self.non_tensor_batch.items()},
                dict(self.meta_info),
            )
        idx = (
            item
            if isinstance(item, torch.Tensor)
            else torch.as_tensor(np.asarray(item), dtype=torch.long)
        )
        if idx.dtype == torch.bool:
            idx = idx.nonzero(as_tuple=True)[0]
        idx_np = idx.cpu().numpy()
        return DataProto(
            {k: v[idx.to(v.device)] for k, v in self.batch.items()},
            {k: v[idx_np] for k, v in self.non_tensor_batch.items()},
            dict(self.meta_info),
        )

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Keep only the named keys (``None`` keeps all of that kind)."""

        def pick(d: dict, keys: Iterable[str] | None, what: str) -> dict:
            if keys is None:
                return dict(d)
            missing = [k for k in keys if k not in d]
            if missing:
                raise DataProtoError(f"{what} has no key(s) {missing}; available: {sorted(d)}")
            return {k: d[k] for k in keys}

        return DataProto(
            pick(self.batch, batch_keys, "batch"),
            pick(self.non_tensor_batch, non_tensor_keys, "non_tensor_batch"),
            pick(self.meta_info, meta_keys, "meta_info"),
        )

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
        meta_keys: Iterable[str] = (),
    ) -> DataProto:
        """Remove the named keys from ``self`` (in place) and return them as a new DataProto."""
        out = self.select(list(batch_keys), list(non_tensor_keys), list(meta_keys))
        for k in batch_keys:
            del self.batch[k]
        for k in non_tensor_keys:
            del self.non_tensor_batch[k]
        for k in meta_keys:
            del self.meta_info[k]
        return out

    def union(self, other: DataProto) -> DataProto:
        """Merge keys of ``other`` into a new DataProto; equal keys must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise DataProtoError(f"cannot union batches of size {len(self)} and {len(other)}")
        batch = dict(self.batch)
        for k, v in other.batch.items():
            if k in batch and not (
                batch[k] is v or (batch[k].shape == v.shape and torch.equal(batch[k], v))
            ):
                raise DataProtoError(
                    f"union conflict on batch[{k!r}]: both sides have different values"
                )
            batch[k] = v
        nt = dict(self.non_tensor_batch)
        for k, v in other.non_tensor_batch.items():
            if k in nt and not (nt[k] is v or _object_arrays_equal(nt[k], v)):
                raise DataProtoError(f"union conflict on non_tensor_batch[{k!r}]")
            nt[k] = v
        meta = dict(self.meta_info)
        for k, v in other.meta_info.items():
            if k in meta and not _values_equal(meta[k], v):
                raise DataProtoError(f"union conflict on meta_info[{k!r}]: {meta[k]!r} != {v!r}")
            meta[k] = v
        return DataProto(batch, nt, meta)

    # ------------------------------------------------------------------ split / join
    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Concatenate along the batch dimension; keys must match; meta of the first is kept."""
        if not parts:
            raise DataProtoError("concat of an empty list")
        keys = set(parts[0].batch)
        nt_keys = set(parts[0].non_tensor_batch)
        for i, p in enumerate(parts[1:], 1):
            if set(p.batch) != keys or set(p.non_tensor_batch) != nt_keys:
                raise DataProtoError(
                    f"concat: part {i} has keys {sorted(p.batch)}+{sorted(p.non_tensor_batch)}, "
                    f"part 0 has {sorted(keys)}+{sorted(nt_keys)}"
                )
        batch = {k: torch.cat([p.batch[k] for p in parts], dim=0) for k in parts[0].batch}
        nt = {
            k: np.concatenate([p.non_tensor_batch[k] for p in parts], axis=0)
            for k in parts[0].non_tensor_batch
        }
        return DataProto(batch, nt, dict(parts[0].meta_info))

    def split(self, size: int) -> list[DataProto]:
        """Split into consecutive pieces of ``size`` rows (the last may be shorter)."""
        if size <= 0:
            raise DataProtoError(f"split size must be positive, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[DataProto]:
        """Split into ``n`` equal pieces; raises unless ``len(self)`` is divisible by ``n``."""
        if n <= 0 or len(self) % n:
            raise DataProtoError(
                f"chunk: batch size {len(self)} is not divisible by {n}; "
                f"use pad_to_divisor({n}) first"
            )
        return self.split(len(self) // n) if len(self) else [self[0:0] for _ in range(n)]

    def reorder(self, idx: torch.Tensor | Sequence[int]) -> DataProto:
        """Return rows in the order ``idx`` (a permutation)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        if idx_t.numel() != len(self):
            raise DataProtoError(
                f"reorder index has {idx_t.numel()} entries for a batch of {len(self)}"
            )
        return self[idx_t]

    def repeat(self, n: int, interleave: bool = True) -> DataProto:
        """Repeat every row ``n`` times: ``interleave`` gives a a b b, else a b a b."""
        if interleave:
            batch = {k: v.repeat_interleave(n, dim=0) for k, v in self.batch.items()}
            nt = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(n, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            nt = {k: np.concatenate([v] * n, axis=0) for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, nt, dict(self.meta_info))

    def pad_to_divisor(self, k: int) -> tuple[DataProto, int]:
        """Pad by repeating leading rows until ``len % k == 0``; returns (padded, pad_size)."""
        pad = (-len(self)) % k
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise DataProtoError("cannot pad an empty batch")
        reps = [self[i % len(self)] for i in range(pad)]
        return DataProto.concat([self, *reps]), pad

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (inverse of :meth:`pad_to_divisor`)."""
        return self if pad_size == 0 else self[: len(self) - pad_size]

    # ------------------------------------------------------------------ devices / IO
    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to ``device`` (non-tensor data stays on the host)."""
        return DataProto(
            {k: v.to(device) for k, v in self.batch.items()},
            dict(self.non_tensor_batch),
            dict(self.meta_info),
        )

    def __getstate__(self) -> dict[str, Any]:
        # Tensors pickle via torch's storage sharing path; object arrays as lists (cheap).
        return {
            "batch": self.batch,
            "non_tensor_batch": {
                k: (v.dtype.str, v.tolist()) if v.dtype == object else v
                for k, v in self.non_tensor_batch.items()
            },
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = state["batch"]
        self.non_tensor_batch = {
            k: _as_object_array(v[1], k) if isinstance(v, tuple) else v
            for k, v in state["non_tensor_batch"].items()
        }
        self.meta_info = state["meta_info"]

    def save(self, path: str | Path) -> None:
        """Write tensors as safetensors plus JSON for non-tensor data and meta (no pickle)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous().cpu() for k, v in self.batch.items()},
            str(path / "batch.safetensors"),
        )
        payload = {
            "n": len(self),
            "non_tensor_batch": {k: v.tolist() for k, v in self.non_tensor_batch.items()},
            "meta_info": self.meta_info,
        }
        (path / "non_tensor.json").write_text(json.dumps(payload, default=_json_default))

    @classmethod
    def load(cls, path: str | Path) -> DataProto:
        """Inverse of :meth:`save`."""
        from safetensors.torch import load_file

        path = Path(path)
        batch = load_file(str(path / "batch.safetensors"))
        payload = json.loads((path / "non_tensor.json").read_text())
        return cls.from_dict(batch, payload["non_tensor_batch"], payload["meta_info"])

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.batch.items()}
        return (
            f"DataProto(len={len(self)}, batch={shapes}, "
            f"non_tensor={sorted(self.non_tensor_batch)}, meta={sorted(self.meta_info)})"
        )


def _object_arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    try:
        return bool(np.all(a == b))
    except Exception:
        return all(_values_equal(x, y) for x, y in zip(a.tolist(), b.tolist()))


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


def _json_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"cannot save {type(o).__name__} in DataProto non-tensor data as JSON")
