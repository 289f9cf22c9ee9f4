"""``balance_for_dp``: reorder a batch so a ``DP_COMPUTE_PROTO`` split gives equal token loads."""

from __future__ import annotations

import torch

from postrl.protocol.balance import balanced_permutation
from postrl.protocol.data import DataProto, DataProtoError

__all__ = ["balance_for_dp"]


def balance_for_dp(
    data: DataProto, dp_size: int, length_key: str = "attention_mask"
) -> tuple[DataProto, dict[str, float]]:
    """Reorder ``data`` by Karmarkar-Karp over sequence lengths for ``dp_size`` ranks.

    Args:
        data: the batch to be dispatched.
        dp_size: number of data-parallel ranks the dispatch will split over.
        length_key: ``batch`` key giving lengths: a (B, T) 0/1 mask (lengths = row sums) or a
            (B,) tensor of lengths.

    Returns:
        The reordered batch and ``balance/*`` metrics (see
        :func:`postrl.protocol.balance.balanced_permutation`). Row contents are unchanged; only
        their order moves, so anything keyed by row (uids, group ids) stays consistent.
    """
    if length_key not in data.batch:
        raise DataProtoError(
            f"balance_for_dp: batch has no {length_key!r} (keys: {sorted(data.batch)}); "
            "pass length_key="
        )
    lens = data.batch[length_key]
    if lens.dim() == 2:
        lens = lens.sum(dim=-1)  # (B,)
    elif lens.dim() != 1:
        raise DataProtoError(
            f"balance_for_dp: batch[{length_key!r}] must be (B, T) or (B,), got {tuple(lens.shape)}"
        )
    perm, metrics = balanced_permutation(lens.to(torch.long).tolist(), dp_size)
    return data.reorder(perm), metrics
