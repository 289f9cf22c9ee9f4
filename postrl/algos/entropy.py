"""Entropy of the next-token distribution from logits, chunked over rows."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["adapt_entropy_coeff", "entropy_from_logits"]


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


def adapt_entropy_coeff(
    coeff: float,
    entropy: float,
    *,
    target: float,
    step: float,
    max_coeff: float,
    min_coeff: float = 0.0,
) -> float:
    """The entropy bonus's next weight under adaptive entropy control.

    A fixed bonus either does nothing (entropy well above where it matters) or keeps pushing
    once the policy has become confident. Adaptive entropy control (He et al. 2025, Skywork-OR1,
    arXiv 2505.22312, sec. 4) makes the weight a controller on the measured entropy instead: it
    rises by ``step`` after each update whose token-mean entropy ``H`` fell below ``target`` and
    falls by ``step`` after one above it, clamped to ``[min_coeff, max_coeff]``::

        c_{k+1} = clip(c_k + step * sign(target - H_k), min_coeff, max_coeff)

    (``H_k == target`` lowers it.) So the bonus sits at its floor while the entropy is high and
    grows only as long as the policy sits below the target, which bounds the entropy collapse of
    positive-sample reinforcement. Skywork-OR1's floor is 0; a floor at a fixed bonus that is
    known to work keeps that bonus's early protection and adds the controller on top.

    Args:
        coeff: the weight used in the update just made (``>= 0``).
        entropy: that update's token-mean entropy of the policy, in nats.
        target: the entropy to hold (``> 0``).
        step: how far one update moves the weight (``> 0``).
        max_coeff: upper bound of the weight (``>= min_coeff``).
        min_coeff: lower bound of the weight (``>= 0``).

    Returns:
        The weight for the next update.
    """
    if target <= 0 or step <= 0 or not 0 <= min_coeff <= max_coeff:
        raise ValueError(
            f"adapt_entropy_coeff: target={target} and step={step} must be > 0 and "
            f"0 <= min_coeff={min_coeff} <= max_coeff={max_coeff}"
        )
    nxt = coeff + step if entropy < target else coeff - step
    return min(max(nxt, min_coeff), max_coeff)
