"""Batched, counter-based sampling: reproducible per request, independent of batch composition.

Each row ``b`` carries its own seed ``s_b`` and counter ``c_b`` (= number of tokens the request
has generated so far). One uniform ``u_b = hash(s_b, c_b) ∈ [0, 1)`` per row drives inverse-CDF
sampling over the (filtered) categorical distribution::

    p = softmax(filter(logits / T))                  # filter = top-k then top-p (nucleus)
    y = min{ i : Σ_{j ≤ i} p_j > u · Σ_j p_j }       # inverse CDF (searchsorted)

Because ``u_b`` depends only on ``(s_b, c_b)`` — never on a global RNG stream or the row's place
in the batch — the same request with the same seed samples the same tokens whichever requests
share its batch (up to floating-point differences in the logits themselves). The hash is
Chris Wellons' ``lowbias32`` integer finaliser applied twice (seed, then counter), computed on
int64 tensors masked to 32 bits; only ``B`` hashes per step are needed (not ``B × V``).

Greedy rows (``T == 0``) take ``argmax(logits)``. The returned log-prob is
``log_softmax(logits.float() / T')[y]`` with ``T' = T`` (``1`` for greedy), on the full,
*untruncated* distribution (see ``postrl.rollout.types``).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["counter_uniform", "sample_tokens"]

_M32 = 0xFFFFFFFF


def _mix32(x):
    """lowbias32 finaliser on int64 values holding 32 bits (exact, no overflow).

    Only ``& ^ >> *`` are used, so the same code runs on torch tensors and numpy arrays.
    """
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _hash(seeds, counters):
    """32-bit hash of ``(seed, counter)`` (both seed halves enter), torch or numpy int64."""
    h = _mix32(seeds ^ 0x9E3779B9)
    h = _mix32(h ^ (seeds >> 32) * 0x85EBCA6B)
    return _mix32(h ^ (counters * 0xC2B2AE35))


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform in [0, 1) per row from ``(seed, counter)``. ``seeds``, ``counters``: (B,) int64.

    Both 32-bit halves of the seed enter the hash. Returns (B,) float64 (53-bit resolution is not
    needed; 32 bits are used).
    """
    if (
        seeds.device.type == "cpu"
    ):  # same integer math in numpy: ~20 tiny ops cost µs, not 20 kernel launches
        return torch.from_numpy(
            _hash(seeds.numpy(), counters.numpy()).astype(np.float64) / 4294967296.0
        )
    return _hash(seeds, counters).double() / 4294967296.0


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    use_filters: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return ``(tokens (B,) int64, log_probs (B,) fp32)``.

    Args:
        logits: (B, V) next-token logits (any float dtype; computed in fp32).
        temperature: (B,) fp32; 0 = greedy.
        top_k: (B,) int64; <= 0 disables.
        top_p: (B,) fp32 in (0, 1]; 1 disables.
        seeds, counters: (B,) int64, see module docstring.
        use_filters: False when no row uses top-k/top-p (skips the sort); rows without filters
            sample identically either way.
    """
    lf = logits.float()
    greedy = temperature <= 0
    t_eff = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = lf / t_eff[:, None]  # (B, V)
    logp_all = torch.log_softmax(scaled, dim=-1)  # (B, V) the reported distribution
    u = counter_uniform(seeds, counters).to(torch.float32)  # (B,)
    V = scaled.shape[-1]
    # unfiltered rows: inverse CDF in vocabulary order (always computed, so a row's sample never
    # depends on whether *other* rows use filters)
    cdf = torch.softmax(scaled, dim=-1).cumsum(-1)  # (B, V)
    sampled = (
        torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_max(V - 1)
    )
    if use_filters:
        filtered = (top_k > 0) | (top_p < 1)  # (B,)
        s_logits, s_idx = scaled.sort(dim=-1, descending=True)  # (B, V)
        s_probs = torch.softmax(s_logits, dim=-1)
        ranks = torch.arange(V, device=logits.device)
        k_eff = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
        keep = ranks[None, :] < k_eff[:, None]
        keep &= (s_probs.cumsum(-1) - s_probs) < top_p[:, None]  # mass before token < p
        s_cdf = (s_probs * keep).cumsum(-1)  # (B, V)
        pick = torch.searchsorted(s_cdf, (u * s_cdf[:, -1])[:, None], right=True).clamp_max(V - 1)
        sampled = torch.where(filtered, s_idx.gather(1, pick).squeeze(1), sampled)
    tokens = torch.where(greedy, lf.argmax(-1), sampled)
    return tokens, logp_all.gather(1, tokens[:, None]).squeeze(1)
