"""The rollout batch layout shared by the agent manager, the replay buffer and the workers.

:func:`concat_rollouts` joins batches of the agent manager's layout (prompts left-padded,
responses right-padded, ``P + R``-wide fields prompt ‖ response) into one; the trainer joins
scored groups with it, and in the object-store data plane each training worker joins the
trajectories of its shard with it, so both build the same padded batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from postrl.protocol.data import DataProto

__all__ = ["concat_rollouts", "segment_parents"]

_PAD_VALUES = {"rollout_policy_version": -1}
"""Padding values of batch fields whose padding is not 0."""


def segment_parents(non_tensor: dict[str, Any]) -> list[int] | None:
    """Per row, the row of the trajectory it belongs to: itself for a trajectory's own row
    (``segment == 0``), the row with the same ``(uid, sample_index)`` and segment 0 for a
    segment row (``AgentLoopOutput.segments``). None when the batch has no segment rows.

    Raises:
        ValueError: a segment row whose trajectory row is not in the batch.
    """
    seg = non_tensor.get("segment")
    if seg is None or not (np.asarray(seg) > 0).any():
        return None
    uids, ks = non_tensor["uid"], non_tensor["sample_index"]
    own = {(uids[i], int(ks[i])): i for i in range(len(seg)) if int(seg[i]) == 0}
    parents = []
    for i in range(len(seg)):
        p = own.get((uids[i], int(ks[i]))) if int(seg[i]) else i
        if p is None:
            raise ValueError(
                f"row {i} is segment {int(seg[i])} of trajectory ({uids[i]}, {int(ks[i])}), "
                "whose own row is not in the batch: segments must travel with their trajectory"
            )
        parents.append(p)
    return parents


def concat_rollouts(parts: list[DataProto]) -> DataProto:
    """Concatenate rollout batches of the agent manager's layout (prompts left-padded to their
    batch's longest prompt P, responses right-padded to its longest response R; fields of width
    P + R are prompt ‖ response) into one batch padded to the longest of all parts."""
    if len(parts) == 1:
        return parts[0]
    P = max(p.batch["prompts"].shape[1] for p in parts)
    R = max(p.batch["responses"].shape[1] for p in parts)

    def repad(key: str, t: torch.Tensor, p: int, r: int) -> torch.Tensor:
        if t.dim() < 2:
            return t
        v = _PAD_VALUES.get(key, 0)
        if key == "prompts":
            return torch.nn.functional.pad(t, (P - p, 0), value=v)
        if t.shape[1] == p + r and key != "responses":
            left = torch.nn.functional.pad(t[:, :p], (P - p, 0), value=v)
            return torch.cat([left, torch.nn.functional.pad(t[:, p:], (0, R - r), value=v)], 1)
        if t.shape[1] == r:
            return torch.nn.functional.pad(t, (0, R - r), value=v)
        raise ValueError(
            f"concat_rollouts: field {key!r} has width {t.shape[1]}, not P={p}, R={r} or P+R"
        )

    padded = []
    for part in parts:
        p, r = part.batch["prompts"].shape[1], part.batch["responses"].shape[1]
        b = {k: repad(k, t, p, r) for k, t in part.batch.items()}
        padded.append(DataProto(b, part.non_tensor_batch, part.meta_info))
    return DataProto.concat(padded)
