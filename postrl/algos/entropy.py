"""Entropy of the next-token distribution from logits, chunked over rows."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["entropy_from_logits"]


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) -> (N,) ``H = -sum_v p_v log p_v`` with ``log p = z - logsumexp(z)``, float32.

    Working with ``log p`` (not ``logsumexp(z) - sum p z``) avoids cancellation for large
    logits; ``-inf`` logits (masked vocabulary entries) contribute 0, not NaN.
    """
    z = logits.float()
    z = z - z.amax(dim=-1, keepdim=True).detach().clamp(min=-1e30)  # exact shift: max is 0
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)  # (N, V)
    logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return -(torch.exp(logp) * logp).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits)``, processed ``chunk_size`` rows at a time.

    Args:
        logits: (..., V), any float dtype.
        chunk_size: rows (flattened leading positions) per chunk; bounds the extra memory to
            ``chunk_size x V`` float32. When gradients are needed each chunk is
            recomputed in backward (activation checkpointing), so the autograd graph does not
            keep a second vocab-sized tensor for the whole input either.

    Returns:
        (...) float32 entropies.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    need_grad = flat.requires_grad and torch.is_grad_enabled()
    outs = []
    for start in range(0, flat.shape[0], chunk_size):  # loop over chunks, not samples
        chunk = flat[start : start + chunk_size]
        if need_grad:
            outs.append(checkpoint(_entropy_rows, chunk, use_reentrant=False))
        else:
            outs.append(_entropy_rows(chunk))
    if not outs:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(outs).reshape(lead)
