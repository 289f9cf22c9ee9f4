"""Varlen attention over packed sequences, plugged into transformers' ``AttentionInterface``.

The padding-free forward packs the valid tokens of a micro-batch into one row of ``N`` tokens.
Everything except attention (embeddings, norms, MLPs, projections, RoPE with per-token positions)
then runs on exactly ``N`` tokens. Attention alone needs the sequence structure; a dense
block-diagonal ``N × N`` mask would cost ``O(N²)`` — on CPU far more than the padded forward.
Instead :func:`varlen_attention` *gathers* the packed q/k/v into ``(S, L)`` per-sequence rows
(``S`` virtual sequences, ``L`` the longest), runs SDPA with ``is_causal=True`` (valid tokens are
a prefix of each row, so causal masking is exact and no mask tensor is built), and gathers the
outputs back to the ``N`` packed slots. Cost: ``S · L²`` attention (that of the padded forward),
``N`` for everything else.

**Prefix sharing** (:class:`PrefixLayout`): the ``n`` responses of a prompt share one stored
copy of the prompt tokens, and attention runs in two passes — each prompt causally over itself
once, then each response's queries over [its prompt's keys, its own keys] with a boolean mask —
so no prompt query is computed per response. Gradients of shared keys and values are summed
over the responses by autograd (``index_select``'s backward is ``index_add_``).

The layout travels as the ``postrl_layout`` keyword argument of the model's forward, which
transformers passes down to every attention call (this also survives activation checkpointing,
which re-runs layers with their original kwargs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from postrl.kernels.train import Segments, packed_attention

FUSED_ATTENTION = "_postrl_fused_attention"
"""Class attribute (True) of an attention module whose packed attention runs the fused kernel
(the subclass :func:`postrl.engine.fused.install` swaps in)."""

__all__ = [
    "ATTN_NAME",
    "AttnLayout",
    "PrefixLayout",
    "register_varlen_attention",
    "varlen_attention",
    "varlen_calls",
]

ATTN_NAME = "postrl_varlen"


@dataclass(frozen=True)
class AttnLayout:
    """Where each virtual sequence's tokens live in the packed row (one causal pass per sequence).

    Attributes:
        gather_idx: (S, L) long — packed index of token j of virtual sequence s (any valid index
            on padding slots, whose outputs are never read).
        out_idx: (N,) long — for packed token n, the flat index ``s * L + j`` of the virtual
            sequence slot whose attention output it takes.
        segments: the same structure as groups of contiguous segments, for the fused kernel
            (:func:`postrl.kernels.train.packed_attention`); None: torch ops only.
    """

    gather_idx: torch.Tensor
    out_idx: torch.Tensor
    segments: Segments | None = None


@dataclass(frozen=True)
class PrefixLayout:
    """Prompt-shared layout: each prompt attends once, each response attends to its prompt's keys.

    ``G`` prompt groups (prompt stored once), ``B`` responses; ``Lp``/``Lr`` the longest prompt /
    response. Attention is split in two passes so no prompt query is computed more than once:

    * prompts: ``(G, Lp)`` causal self-attention over each group's prompt;
    * responses: ``(B, Lr)`` queries over ``Lp + Lr`` keys = [the group's prompt, the row's own
      response], masked by ``resp_mask`` (prompt key j valid iff ``j < plen``; response key k
      valid iff ``k <= i``).

    Cost ``G·Lp² + B·Lr·(Lp+Lr)`` instead of ``B·(Lp+Lr)²`` for one pass per row.

    Attributes:
        prompt_idx: (G, Lp) packed index of prompt token j of group g (clamped on padding).
        resp_q_idx: (B, Lr) packed index of response token i of row b (clamped on padding).
        resp_k_idx: (B, Lp + Lr) packed index of key slot j of row b.
        resp_mask: (B, 1, Lr, Lp + Lr) bool, True where attention is allowed.
        out_idx: (N,) for packed token n, its row in ``cat([prompt outputs (G·Lp), response
            outputs (B·Lr)])``.
        segments: as in :class:`AttnLayout`.
    """

    prompt_idx: torch.Tensor
    resp_q_idx: torch.Tensor
    resp_k_idx: torch.Tensor
    resp_mask: torch.Tensor
    out_idx: torch.Tensor
    segments: Segments | None = None


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (S, L) of token-major ``x`` (N, h, D) as a contiguous (S, h, L, D).

    One ``index_select`` over the (token, head) rows of ``x`` in (S, h, L) order, so the result
    is already laid out as the attention's batched matmuls read it (a gather in (S, L) order
    then a transpose made each matmul copy it: W1's response pass, forward + backward of one
    layer, 7.9 → 6.5 ms). ``index_select`` (not advanced indexing): its backward is
    ``index_add_``, several times faster on CPU than the accumulating ``index_put_`` advanced
    indexing falls back to.
    """
    s, length = idx.shape
    n, h, d = x.shape
    heads = torch.arange(h, device=idx.device).view(1, h, 1)
    rows = (idx.unsqueeze(1) * h + heads).reshape(-1)  # (S, h, L) order
    return x.reshape(n * h, d).index_select(0, rows).view(s, h, length, d)


SMALL_SCORES = 1 << 22
"""Masked attention whose score tensor has at most this many elements (16 MB in fp32) runs as
two batched matmuls and a softmax (:func:`_matmul_attention`) instead of SDPA: the responses'
pass of a prefix-shared batch is many tiny blocks (W1: 128 rows × 16 queries × ≈42 keys), where
CPU SDPA's flash kernel spends more on per-block setup than on arithmetic (forward + backward per
layer 12.9 ms vs 9.4 ms, 2 threads, AVX2). Larger score tensors keep SDPA, which never
materializes them."""


def _matmul_attention(q, k, v, scaling: float, mask: torch.Tensor) -> torch.Tensor:
    """Softmax(q·kᵀ·scaling, masked) · v with grouped-query heads and no key/value repeat: the
    ``g`` query heads of a key/value head are folded into the query length, so each (row, kv head)
    is one small matmul. (S, H, L, D) queries, (S, Hkv, K, D) keys/values, ``mask`` (S, 1 or H,
    L, K) bool (True = attend; every query row must attend somewhere) -> (S, H, L, D). The softmax
    runs in float32 whatever the input dtype, as SDPA's kernels accumulate."""
    s_, h, length, d = q.shape
    hk = k.shape[1]
    g = h // hk
    scores = torch.matmul(q.reshape(s_, hk, g * length, d), k.transpose(-1, -2)) * scaling
    scores = scores.view(s_, hk, g, length, -1)
    m = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.view(s_, hk, g, length, -1)
    probs = torch.softmax(scores.float().masked_fill(~m, float("-inf")), -1).to(q.dtype)
    return torch.matmul(probs.view(s_, hk, g * length, -1), v).view(s_, h, length, d)


def _sdpa(
    q, k, v, *, scaling, causal: bool = False, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA with grouped-query heads (no key/value repeat), (S, H, L, D) -> (S·L, H, D); small
    masked passes through :func:`_matmul_attention` (:data:`SMALL_SCORES`)."""
    if mask is not None and mask.dtype == torch.bool and q.shape[1] % k.shape[1] == 0:
        if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= SMALL_SCORES:
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            out = _matmul_attention(q, k, v, scale, mask)
            return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[-1])


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    postrl_layout: AttnLayout | PrefixLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over packed tokens following ``postrl_layout``.

    Args:
        query: (1, H, N, D); key/value: (1, Hkv, N, D).

    Returns:
        ((1, N, H, D) attention output, None) — the layout transformers' attention layers expect.
    """
    if postrl_layout is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_NAME!r} needs the postrl_layout kwarg; "
            "call the model through "
            "postrl.engine.logprob (or load it with attn_implementation='sdpa' for plain use)"
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}"
        )
    _CALLS[0] += 1
    q, k, v = (
        t.squeeze(0).transpose(0, 1) for t in (query, key, value)
    )  # (N, h, D); squeeze, not [0]: select's backward zero-fills the whole input
    lay = postrl_layout
    if (
        lay.segments is not None
        and getattr(module, FUSED_ATTENTION, False)
        and dropout == 0.0
        and kwargs.get("sliding_window") is None
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
        and not torch.is_autocast_enabled("cpu")
    ):
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        return packed_attention(q, k, v, lay.segments, scale).unsqueeze(0), None
    if isinstance(lay, PrefixLayout):
        pi = lay.prompt_idx
        parts = [_sdpa(_take(q, pi), _take(k, pi), _take(v, pi), scaling=scaling, causal=True)]
        if lay.resp_q_idx.shape[1]:
            ki = lay.resp_k_idx
            parts.append(
                _sdpa(
                    _take(q, lay.resp_q_idx),
                    _take(k, ki),
                    _take(v, ki),
                    scaling=scaling,
                    mask=lay.resp_mask,
                )
            )
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
    else:
        gi = lay.gather_idx
        out = _sdpa(
            _take(q, gi), _take(k, gi), _take(v, gi), scaling=scaling, causal=True
        )  # (S*L, H, D)
    return out.index_select(0, lay.out_idx).unsqueeze(0), None  # (1, N, H, D)


_CALLS = [0]


def varlen_calls() -> int:
    """How many times :func:`varlen_attention` has run in this process (a model whose attention
    layers do not dispatch through transformers' ``AttentionInterface`` never calls it)."""
    return _CALLS[0]


def register_varlen_attention() -> None:
    """Register :func:`varlen_attention` as ``attn_implementation='postrl_varlen'`` (idempotent).

    No mask function is registered on purpose: transformers then skips building any mask.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention)
