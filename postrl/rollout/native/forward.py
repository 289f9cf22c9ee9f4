"""Prefill and decode forwards of the native decoder over a slot KV cache.

KV cache layout: ``k, v: (L, S, H_kv, T_max, D)`` — one slot per running sequence. The running
sequences always occupy slots ``0 .. B-1`` (the engine compacts on exit), so decode attention
reads ``k[l, :B, :, :T]`` as a *view*, with no gather. Position ``j`` of slot ``b`` is attended
iff ``j <= pos_b`` (positions past ``pos_b`` may hold stale values and are masked).

Shared-prompt prefill: ``prefill`` runs each *unique* prompt once and scatters its K/V into every
slot that uses it (``dst_slots[i]`` gets unique prompt ``src[i]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from postrl.rollout.native.model import DecoderConfig, DecoderWeights, apply_rope, mlp, rms_norm

__all__ = ["prefill", "decode"]


def _qkv(x: torch.Tensor, lw, cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project ``x`` (..., hidden) to q (..., H, D), k, v (..., H_kv, D) with optional q/k-norm."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = F.linear(x, lw.w_qkv, lw.b_qkv)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    lead = x.shape[:-1]
    q, k, v = q.reshape(*lead, H, D), k.reshape(*lead, Hkv, D), v.reshape(*lead, Hkv, D)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    return q, k, v


def prefill(
    w: DecoderWeights,
    cfg: DecoderConfig,
    tokens: torch.Tensor,
    lens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst_slots: torch.Tensor,
    src: torch.Tensor,
) -> torch.Tensor:
    """Prefill ``U`` unique prompts and return last-position logits (U, V).

    Args:
        tokens: (U, P) right-padded prompt ids; lens: (U,) true lengths.
        cos, sin: (T_max, D) RoPE tables.
        dst_slots: (N,) cache slots to fill; src: (N,) which unique prompt each slot receives.

    Right padding needs no mask beyond causality: a real query ``i < len`` only attends keys
    ``j <= i``, all real. Pad positions write garbage K/V past ``len``, which decode masks.
    """
    U, P = tokens.shape
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = F.embedding(tokens, w.embed)  # (U, P, hidden)
    c, s = cos[:P, None, :], sin[:P, None, :]  # (P, 1, D)
    for li, lw in enumerate(w.layers):
        h = rms_norm(x, lw.ln1, cfg.rms_norm_eps)
        q, k, v = _qkv(h, lw, cfg)  # (U, P, H|Hkv, D)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (U, H|Hkv, P, D)
        k_cache[li, dst_slots, :, :P] = k[src]
        v_cache[li, dst_slots, :, :P] = v[src]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)  # (U, H, P, D)
        x = x + F.linear(o.transpose(1, 2).reshape(U, P, H * D), lw.w_o, lw.b_o)
        x = x + mlp(rms_norm(x, lw.ln2, cfg.rms_norm_eps), lw)
    last = x[torch.arange(U, device=x.device), lens - 1]  # (U, hidden)
    return F.linear(rms_norm(last, w.norm, cfg.rms_norm_eps), w.lm_head)


def decode(
    w: DecoderWeights,
    cfg: DecoderConfig,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    T: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    arange_b: torch.Tensor,
    arange_t: torch.Tensor,
) -> torch.Tensor:
    """One decode step for slots ``0 .. B-1``; returns logits (B, V).

    Args:
        tokens: (B,) input ids, written at positions ``pos`` (B,); ``T = max(pos) + 1``.
        arange_b, arange_t: preallocated ``arange`` buffers (sliced, never reallocated).
    """
    B = tokens.shape[0]
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // Hkv
    ar = arange_b[:B]
    x = F.embedding(tokens, w.embed)  # (B, hidden)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # (B, 1, D)
    # additive mask (B, 1, 1, T): 0 where j <= pos_b, -inf after
    mask = torch.zeros(B, 1, 1, T, dtype=x.dtype, device=x.device)
    mask.masked_fill_((arange_t[:T][None, :] > pos[:, None])[:, None, None, :], float("-inf"))
    scale = D**-0.5
    for li, lw in enumerate(w.layers):
        h = rms_norm(x, lw.ln1, cfg.rms_norm_eps)
        q, k, v = _qkv(h, lw, cfg)  # (B, H|Hkv, D)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        k_cache[li, ar, :, pos] = k
        v_cache[li, ar, :, pos] = v
        K = k_cache[li, :B, :, :T]  # (B, Hkv, T, D) view
        V = v_cache[li, :B, :, :T]
        scores = torch.matmul(q.view(B, Hkv, G, D), K.transpose(-1, -2))  # (B, Hkv, G, T)
        scores = scores.mul_(scale).add_(mask)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(p, V).reshape(B, H * D)  # (B, Hkv, G, D) -> (B, H·D)
        x = x + F.linear(o, lw.w_o, lw.b_o)
        x = x + mlp(rms_norm(x, lw.ln2, cfg.rms_norm_eps), lw)
    return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head)
