"""Prefill and decode forwards of the native decoder over a slot KV cache.

K/V live in a ``KVStore`` (see ``kvstore.py``): one prefix row per distinct prompt, one slot per
running sequence holding only its completion. Running slots and live prefixes are compact
(``0 .. B-1``, ``0 .. NG-1``) so decode reads them as views. Positions past a sequence's current
length may hold stale values and are masked.

Shared-prompt prefill: ``prefill`` runs each *distinct* prompt once, writing its prefix row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from postrl.rollout.native.kernels import DecodeKernels
from postrl.rollout.native.kvstore import DecodeLayout, KVStore
from postrl.rollout.native.model import (
    DecoderConfig,
    DecoderWeights,
    apply_rope_fast,
    mlp,
    rms_norm,
)

__all__ = ["prefill", "prefill_fused", "decode", "decode_fused"]


def _qkv(
    x: torch.Tensor, lw, cfg: DecoderConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def _qkv_fused(x: torch.Tensor, lw, cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-time projection: ``qk`` (B, H + H_kv, D) (q/k-normed, ready for one RoPE call), v."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = F.linear(x, lw.w_qkv, lw.b_qkv)  # (B, (H + 2·Hkv)·D)
    B = x.shape[0]
    qk = qkv[:, : (H + Hkv) * D].reshape(B, H + Hkv, D)
    v = qkv[:, (H + Hkv) * D :].reshape(B, Hkv, D)
    if lw.q_norm is not None:  # Qwen3: separate q/k norm weights over head_dim
        qk = torch.cat(
            [
                rms_norm(qk[:, :H], lw.q_norm, cfg.rms_norm_eps),
                rms_norm(qk[:, H:], lw.k_norm, cfg.rms_norm_eps),
            ],
            1,
        )
    return qk, v


def prefill(
    w: DecoderWeights,
    cfg: DecoderConfig,
    tokens: torch.Tensor,
    lens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Prefill ``U`` distinct prompts into prefix rows ``rows`` (U,); return last-position
    logits (U, V).

    Args:
        tokens: (U, P) right-padded prompt ids; lens: (U,) true lengths.
        cos, sin: (T_max, D) RoPE tables (``sin`` sign-folded, see ``model.apply_rope_fast``).
        k_cache, v_cache: the prefix store (L, S, H_kv, T_max, D).

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
        q, k = apply_rope_fast(q, c, s), apply_rope_fast(k, c, s)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (U, H|Hkv, P, D)
        k_cache[li, rows, :, :P] = k
        v_cache[li, rows, :, :P] = v
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=Hkv != H
        )  # (U, H, P, D)
        x = x + F.linear(o.transpose(1, 2).reshape(U, P, H * D), lw.w_o, lw.b_o)
        x = x + mlp(rms_norm(x, lw.ln2, cfg.rms_norm_eps), lw)
    last = x[torch.arange(U, device=x.device), lens - 1]  # (U, hidden)
    return F.linear(rms_norm(last, w.norm, cfg.rms_norm_eps), w.lm_head)


def decode(
    w: DecoderWeights,
    cfg: DecoderConfig,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    off: torch.Tensor,
    T: int,
    uniform_off: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: KVStore,
    lay: DecodeLayout,
    arange_b: torch.Tensor,
    arange_t: torch.Tensor,
) -> torch.Tensor:
    """One decode step for running slots ``0 .. B-1``; returns logits (B, V).

    Attention of slot ``b`` spans its prompt (prefix row ``pid_b``, positions ``< P_b``) and its own
    completion (slot offsets ``0 .. off_b``), under one softmax::

        s = [q·K_pre^T, q·K_own^T] / sqrt(D) + masks;   o = softmax(s) · [V_pre; V_own]

    The prompt part is one batched matmul per group: queries are scattered into a padded
    (NG, nmax) table so a prompt's K/V is read once for its ``nmax·G`` queries.

    Args:
        tokens: (B,) input ids at absolute positions ``pos`` (B,) (for RoPE);
        off: (B,) own-cache offsets ``pos - P_b``; ``T = max(off) + 1``; ``uniform_off``: all
            offsets equal (sequences admitted together) → cache writes are one strided copy.
        sin: the *sign-folded* table (see ``model.apply_rope_fast``).
        arange_b, arange_t: preallocated ``arange`` buffers.
    """
    B = tokens.shape[0]
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G, NG, nmax, Pm = H // Hkv, lay.NG, lay.nmax, lay.Pm
    Tmax = kv.k.shape[3]
    x = F.embedding(tokens, w.embed)  # (B, hidden)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # (B, 1, D)
    own_mask = torch.zeros(B, 1, 1, T, dtype=x.dtype, device=x.device)
    own_mask.masked_fill_((arange_t[:T][None, :] > off[:, None])[:, None, None, :], float("-inf"))
    mask = torch.cat([lay.pre_mask, own_mask], dim=-1)  # (B, 1, 1, Pm + T)
    wflat = ((arange_b[:B, None] * Hkv + arange_b[None, :Hkv]) * Tmax + off[:, None]).reshape(
        -1
    )  # (B·Hkv,)
    scale = D**-0.5

    def to_groups(t: torch.Tensor) -> torch.Tensor:  # (B, Hkv, G, X) -> (NG, Hkv, nmax·G, X)
        if lay.identity:
            return t.view(NG, nmax, Hkv, G, -1).transpose(1, 2).reshape(NG, Hkv, nmax * G, -1)
        pad = t.new_zeros(NG * nmax, Hkv, G, t.shape[-1]).index_copy_(0, lay.flat, t)
        return pad.view(NG, nmax, Hkv, G, -1).transpose(1, 2).reshape(NG, Hkv, nmax * G, -1)

    def from_groups(t: torch.Tensor) -> torch.Tensor:  # (NG, Hkv, nmax·G, X) -> (B, Hkv, G, X)
        X = t.shape[-1]
        if lay.identity:
            return t.view(NG, Hkv, nmax, G, X).transpose(1, 2).reshape(B, Hkv, G, X)
        return (
            t.view(NG, Hkv, nmax, G, X)
            .transpose(1, 2)
            .reshape(NG * nmax, Hkv, G, X)
            .index_select(0, lay.flat)
        )

    for li, lw in enumerate(w.layers):
        h = rms_norm(x, lw.ln1, cfg.rms_norm_eps)
        qk, v = _qkv_fused(h, lw, cfg)  # (B, H + Hkv, D), (B, Hkv, D)
        qk = apply_rope_fast(qk, c, s)
        q, k = qk[:, :H], qk[:, H:]
        if uniform_off:
            kv.k[li, :B, :, T - 1] = k
            kv.v[li, :B, :, T - 1] = v
        else:
            kv.k[li].view(-1, D).index_copy_(0, wflat, k.reshape(B * Hkv, D))
            kv.v[li].view(-1, D).index_copy_(0, wflat, v.reshape(B * Hkv, D))
        qg = q.reshape(B, Hkv, G, D)
        s_pre = from_groups(
            torch.matmul(to_groups(qg), kv.pk[li, :NG, :, :Pm].transpose(-1, -2))
        )  # (B, Hkv, G, Pm)
        s_own = torch.matmul(qg, kv.k[li, :B, :, :T].transpose(-1, -2))  # (B, Hkv, G, T)
        scores = torch.cat([s_pre, s_own], dim=-1).mul_(scale).add_(mask)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        p_pre, p_own = p.split([Pm, T], dim=-1)
        o = from_groups(torch.matmul(to_groups(p_pre), kv.pv[li, :NG, :, :Pm]))  # (B, Hkv, G, D)
        o = o + torch.matmul(p_own, kv.v[li, :B, :, :T])
        o = o.reshape(B, H * D)
        # residual adds fused into the GEMMs: x + o·W_oᵀ, x + (silu(g)·u)·W_downᵀ
        x = _out_proj(x, o, lw)
        g, u = F.linear(rms_norm(x, lw.ln2, cfg.rms_norm_eps), lw.w_gu).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(g).mul_(u), lw.w_down.t())
    return F.linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head)


def decode_fused(
    w: DecoderWeights,
    cfg: DecoderConfig,
    kern: DecodeKernels,
    tokens: torch.Tensor,
    pos: torch.Tensor,
    plen: torch.Tensor,
    pid: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: KVStore,
    arange_b: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    """``decode`` with the fused CPU kernels (``kernels.py``): same inputs, same logits up to float
    rounding. Per layer: RMSNorm → qkv GEMM → ``rope_kv`` (q/k-norm, RoPE, cache write, in place)
    → ``decode_attention`` (prefix + own completion, one softmax) → o GEMM (+residual) → RMSNorm
    → gate/up GEMM → SiLU·up → down GEMM (+residual). ``sin`` is the *plain* table; ``pos``,
    ``plen``, ``pid`` are contiguous (B,) int64 views of the engine's slot state.
    """
    H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    scale = D**-0.5
    x = F.embedding(tokens, w.embed)  # (B, hidden)
    slot, off = arange_b[: tokens.shape[0]], pos - plen
    for li, lw in enumerate(w.layers):
        kc, vc = kv.k[li], kv.v[li]
        qkv = F.linear(kern.rms_norm(x, lw.ln1, eps), lw.w_qkv, lw.b_qkv)  # (B, (H + 2·Hkv)·D)
        kern.rope_kv(qkv, H, Hkv, D, cos, sin, pos, slot, off, lw.q_norm, lw.k_norm, eps, kc, vc)
        o = kern.decode_attention(
            qkv, H, Hkv, D, kv.pk[li], kv.pv[li], kc, vc, pid, plen, pos, scale, threads
        )
        x = _out_proj(x, o, lw)
        x = torch.addmm(
            x, kern.silu_mul(F.linear(kern.rms_norm(x, lw.ln2, eps), lw.w_gu)), lw.w_down.t()
        )
    return F.linear(kern.rms_norm(x, w.norm, eps), w.lm_head)


def _out_proj(x: torch.Tensor, o: torch.Tensor, lw) -> torch.Tensor:
    """``x + o·W_oᵀ (+ b_o)``, the residual add fused into the GEMM when there is no bias."""
    return torch.addmm(x, o, lw.w_o.t()) if lw.b_o is None else x + F.linear(o, lw.w_o, lw.b_o)


def prefill_fused(
    w: DecoderWeights,
    cfg: DecoderConfig,
    kern: DecodeKernels,
    tokens: torch.Tensor,
    lens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    start: int = 0,
) -> torch.Tensor:
    """``prefill`` with the fused kernels (same inputs, ``sin`` plain; same logits up to float
    rounding). Tokens are flattened to ``U·P`` rows; RoPE and the prefix-cache writes are one
    kernel call per layer, and causal attention is the decode-attention kernel reading the
    prefix rows just written (query ``t`` over positions ``0..t``), so no layout copies. The
    last layer needs only its K/V at every position (for the cache) and its output at each
    prompt's *last* position (for the logits), so its attention, o projection and MLP run on
    ``U`` rows instead of ``U·P``.

    ``start``: the prompts' first ``start`` positions are already in their rows (a shared prefix
    copied in, ``NativeBackend``'s trunk); ``tokens``/``lens`` are then the rest of each prompt,
    placed at positions ``start ..``, and attend the whole row.
    """
    U, P = tokens.shape
    H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    L, scale, threads = len(w.layers), D**-0.5, torch.get_num_threads()
    dev = tokens.device
    pos = torch.arange(start, start + P, device=dev).repeat(U)  # (U·P,)
    slot = rows.repeat_interleave(P)
    last = torch.arange(U, device=dev) * P + lens - 1  # flat index of each prompt's last token
    # causal attention as decode attention with an empty "own" part: query (u, t) attends the
    # prefix row it just wrote, positions 0..t (plen = t + 1, pos = t -> no completion keys)
    plen_all, plen_last = pos + 1, lens.to(torch.int64) + start
    x = F.embedding(tokens.reshape(-1), w.embed)  # (U·P, hidden)
    for li, lw in enumerate(w.layers):
        qkv = F.linear(kern.rms_norm(x, lw.ln1, eps), lw.w_qkv, lw.b_qkv)  # (U·P, (H + 2·Hkv)·D)
        kc, vc = k_cache[li], v_cache[li]
        kern.rope_kv(qkv, H, Hkv, D, cos, sin, pos, slot, pos, lw.q_norm, lw.k_norm, eps, kc, vc)
        if li == L - 1:  # last layer: only the last position's output is needed
            o = kern.decode_attention(
                qkv[last].contiguous(),
                H,
                Hkv,
                D,
                kc,
                vc,
                kc,
                vc,
                rows,
                plen_last,
                plen_last - 1,
                scale,
                threads,
            )  # (U, H·D)
            x = x[last]
        else:
            o = kern.decode_attention(
                qkv, H, Hkv, D, kc, vc, kc, vc, slot, plen_all, pos, scale, threads
            )
        x = _out_proj(x, o, lw)
        x = torch.addmm(
            x, kern.silu_mul(F.linear(kern.rms_norm(x, lw.ln2, eps), lw.w_gu)), lw.w_down.t()
        )
    return F.linear(kern.rms_norm(x, w.norm, eps), w.lm_head)
