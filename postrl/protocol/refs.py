"""Rows by reference: the second transport of the one step (``trainer.async.data_plane``).

A batch whose rows sit in Ray's object store reaches a worker as a :class:`RefShard` (that
rank's rows: payload references, earlier calls' output columns, per-row values from the
driver). The controller materialises it on the worker (:meth:`RefShard.materialise`) and calls
the worker's method body — the same ``compute_log_prob`` / ``update_actor`` the ``driver``
plane calls with a padded ``DataProto`` — and keeps the answer's tensors where they were made:
the caller receives a :class:`RemoteProto` (a reference, the column names and the answer's
``meta_info``), which the next call's shards carry as a column. No tensor crosses the driver.

A dp-split dispatch (``controller/dispatch.py``) asks the batch for its shards with
``ref_shards(n)`` (the batch type lives with its owner, ``trainer/object_store.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from postrl.protocol.data import DataProto

__all__ = ["RefShard", "RemoteProto", "keep_remote", "materialise_args"]


@dataclass
class RefShard:
    """One dp rank's rows of a batch that stays in the object store.

    Attributes:
        refs: one payload reference per row (``{"batch": scored DataProto}``; rows of one payload
            share it).
        rows: each row's index within its payload.
        masked: rows that only pad the shard to the group's size: their ``zeroed_keys`` are
            zeroed (they train nothing).
        columns: :class:`RemoteProto` answers of earlier calls on this same shard, joined in
            order (e.g. ``old_log_probs``, ``ref_log_prob``).
        row_values: per-row scalars from the driver, each broadcast over the row's
            ``response_mask`` (``(B,)`` → ``(B, R)``: an outcome advantage and return).
        meta_info: the call's ``meta_info`` (temperature, global step, flags).
        zeroed_keys: the keys zeroed on masked rows (the engine's ``ZEROED_KEYS``).
        timeout_s: deadline of the fetches.
    """

    refs: list[Any]
    rows: list[int]
    masked: list[bool]
    columns: list[RemoteProto] = field(default_factory=list)
    row_values: dict[str, list[float]] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)
    zeroed_keys: tuple[str, ...] = ()
    timeout_s: float | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def materialise(self) -> DataProto:
        """This rank's batch: each payload fetched once, the wanted rows padded into the
        rollout layout with :func:`~postrl.protocol.layout.concat_rollouts` in the shard's order,
        the columns joined, the row values broadcast, the masked rows zeroed.
        ``meta_info["timing"]`` holds ``timing_s/fetch_refs`` and ``timing_s/collate``;
        ``meta_info["by_ref"]`` tells the method body its answer stays on this side."""
        import ray

        from postrl.protocol.layout import concat_rollouts

        t0 = time.perf_counter()
        unique = list(dict.fromkeys(self.refs))  # each payload once
        fetched = ray.get(unique + [c.ref for c in self.columns], timeout=self.timeout_s)
        payloads = dict(zip(unique, fetched[: len(unique)], strict=True))
        t1 = time.perf_counter()
        wanted: dict[Any, list[int]] = {}  # payload -> positions in the shard, in order
        for pos, ref in enumerate(self.refs):
            wanted.setdefault(ref, []).append(pos)
        parts, order = [], []
        for ref, positions in wanted.items():
            parts.append(payloads[ref]["batch"][torch.tensor([self.rows[p] for p in positions])])
            order += positions
        batch = concat_rollouts(parts)[torch.tensor(order).argsort()]  # the shard's row order
        b = dict(batch.batch)
        for col in fetched[len(unique) :]:
            b.update(dict(col.batch))
        mask = b["response_mask"]
        for key, values in self.row_values.items():  # (B,) -> (B, R) over the policy tokens
            b[key] = torch.tensor(values, dtype=torch.float32)[:, None] * mask
        pads = torch.tensor(self.masked, dtype=torch.bool)
        if bool(pads.any()):
            for key in self.zeroed_keys:
                if key in b:
                    b[key] = b[key].masked_fill(pads.view(-1, *([1] * (b[key].dim() - 1))), 0)
        timing = {"timing_s/fetch_refs": t1 - t0, "timing_s/collate": time.perf_counter() - t1}
        meta = {**self.meta_info, "timing": timing, "by_ref": True}
        return DataProto(b, batch.non_tensor_batch, meta)


@dataclass
class RemoteProto:
    """A worker's answer to a call on a :class:`RefShard`: its tensors stay in the object
    store (``ref``: a ``DataProto`` of them), the caller gets their names and the answer's
    ``meta_info`` (metrics)."""

    ref: Any
    keys: tuple[str, ...]
    meta_info: dict[str, Any]


def keep_remote(out: Any) -> Any:
    """On the worker: a ``DataProto`` answer put into the object store (its tensors stay on
    this side) as a :class:`RemoteProto`; any other answer unchanged."""
    if not isinstance(out, DataProto):
        return out
    import ray

    keys = tuple(out.batch.keys()) if out.batch is not None else ()
    ref = ray.put(DataProto(out.batch, {}, {})) if keys else None
    return RemoteProto(ref, keys, dict(out.meta_info))


def materialise_args(args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """On the worker: every :class:`RefShard` argument materialised; whether there was one
    (then the answer is kept remote with :func:`keep_remote`)."""
    found = any(isinstance(v, RefShard) for v in (*args, *kwargs.values()))
    if not found:
        return args, kwargs, False
    args = tuple(v.materialise() if isinstance(v, RefShard) else v for v in args)
    kwargs = {k: v.materialise() if isinstance(v, RefShard) else v for k, v in kwargs.items()}
    return args, kwargs, True
