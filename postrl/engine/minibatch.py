"""Mini-batches of a data-parallel update that line up across ranks.

Every rank of a dp group must run the same number of optimizer steps and the same collectives
(denominator all-reduce, gradient all-reduce, metric all-reduce) in the same order, whatever rows
it received. Two things break that if done naively:

* dropping rows whose ``response_mask`` is all zero (failed samples, filtered groups) *before*
  splitting into mini-batches gives ranks different mini-batch counts → a collective deadlock;
* a rank whose mini-batch has no valid row runs no micro-batch, so its metric keys differ.

:func:`split_mini_batches` therefore splits the shard first (the same count on every rank, agreed
by an all-reduce MAX), then drops empty rows inside each mini-batch, keeping one fully masked
placeholder row when nothing is left: it runs forward/backward like any row but contributes
exactly zero to the loss, the gradients and the global denominators.

:func:`pad_masked_rows` pads a batch to a multiple of the dp size with such masked rows *before*
the dp dispatch, so the dispatch's own padding (which repeats real rows) never trains a sample
twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from postrl.protocol import DataProto

__all__ = ["ZEROED_KEYS", "mask_rows", "pad_masked_rows", "split_mini_batches"]

ZEROED_KEYS = ("response_mask", "advantages", "returns")
"""Keys zeroed on masked rows (NaN-free placeholders: a masked NaN would still poison 0·NaN)."""


def mask_rows(data: DataProto) -> DataProto:
    """A copy of ``data`` whose rows contribute nothing to an update.

    ``response_mask`` (and ``advantages`` / ``returns`` when present) become zero; every other
    tensor is shared with ``data``.
    """
    batch = dict(data.batch)
    for k in ZEROED_KEYS:
        if k in batch:
            batch[k] = torch.zeros_like(batch[k])
    return DataProto(batch, dict(data.non_tensor_batch), dict(data.meta_info))


def pad_masked_rows(data: DataProto, divisor: int) -> DataProto:
    """Pad ``data`` to a multiple of ``divisor`` rows with masked copies of its leading rows.

    Use before a ``dp_compute_proto`` update call: the dispatch then needs no padding of its own
    (it pads by repeating real rows, which would train those samples twice).
    """
    if divisor <= 1 or len(data) % divisor == 0:
        return data
    if len(data) == 0:
        raise ValueError(
            "pad_masked_rows: cannot pad an empty batch; check the batch before the update"
        )
    pad = (-len(data)) % divisor
    idx = torch.arange(pad) % len(data)
    return DataProto.concat([data, mask_rows(data[idx])])


def _allreduce_max(n: int, group: dist.ProcessGroup | None) -> int:
    if group is None or dist.get_world_size(group) == 1:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def split_mini_batches(
    data: DataProto,
    size: int,
    order: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[DataProto]:
    """This rank's mini-batches: the same count on every rank of ``group``, none empty.

    Args:
        data: the rank's shard (needs ``response_mask``; must have at least one row).
        size: rows per mini-batch on this rank (``ppo_mini_batch_size × n / dp``).
        order: row permutation to split (shuffling); default identity.
        group: the dp process group (None: single process).

    Returns:
        Mini-batches without all-masked rows, except a single masked placeholder row where a
        mini-batch (or a rank with fewer rows than others) has no valid row.
    """
    if len(data) == 0:
        raise ValueError(
            "split_mini_batches: the shard has no rows (a dp dispatch never sends an empty shard)"
        )
    b = len(data)
    order = torch.arange(b) if order is None else order
    chunks = [order[s : s + size] for s in range(0, b, max(1, size))]
    n = _allreduce_max(len(chunks), group)
    chunks += [order[:0]] * (n - len(chunks))
    valid = data.batch["response_mask"].sum(-1) > 0
    out = []
    for idx in chunks:
        keep = idx[valid[idx]]
        if len(keep):
            out.append(data[keep])
        else:  # nothing to learn here, but the collectives and metric keys must still line up
            out.append(mask_rows(data[idx[:1] if len(idx) else torch.zeros(1, dtype=torch.long)]))
    return out
