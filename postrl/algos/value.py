"""Clipped value (critic) loss."""

from __future__ import annotations

from typing import Any

import torch

from postrl.algos.aggregation import agg_loss
from postrl.algos.utils import masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Any = None,
    global_num_seqs: Any = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss (Schulman et al. 2017; the "value clipping" of OpenAI baselines).

    ``v_clip = values + clip(vpreds - values, -c, c)``,
    ``L = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2))``.

    Args:
        vpreds: (B, T) current critic predictions. returns: (B, T) targets R (e.g. from GAE).
        values: (B, T) critic predictions at rollout time. cliprange_value: c.

    Returns:
        ``(loss, {"vf_clipfrac": share of tokens where the clipped branch is larger})``.
    """
    v_clip = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    l1 = (vpreds - returns).square()
    l2 = (v_clip - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(l1, l2),
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
        norm_length=norm_length,
    )
    clipfrac = masked_mean((l2 > l1).to(vpreds.dtype), response_mask)
    return loss, {"vf_clipfrac": clipfrac.detach()}
