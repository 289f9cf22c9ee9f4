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

The same mechanism gives **prefix sharing**: a virtual sequence is an *index list* into the
packed tokens, so the ``n`` responses of a prompt can each be ``[prompt tokens, response_i]``
while the prompt is stored (and its MLP/projections computed) once. Gradients of shared keys and
values are summed over the virtual sequences by autograd (gather's backward is scatter-add).

The layout travels as the ``postrl_layout`` keyword argument of the model's forward, which
transformers passes down to every attention call (this also survives activation checkpointing,
which re-runs layers with their original kwargs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ATTN_NAME", "AttnLayout", "register_varlen_attention", "varlen_attention"]

ATTN_NAME = "postrl_varlen"


@dataclass(frozen=True)
class AttnLayout:
    """Where each virtual sequence's tokens live in the packed row.

    Attributes:
        gather_idx: (S, L) long — packed index of token j of virtual sequence s (any valid index
            on padding slots, whose outputs are never read).
        out_idx: (N,) long — for packed token n, the flat index ``s * L + j`` of the virtual
            sequence slot whose attention output it takes.
    """

    gather_idx: torch.Tensor
    out_idx: torch.Tensor


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    postrl_layout: AttnLayout | None = None,
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
            f"attn_implementation={ATTN_NAME!r} needs the postrl_layout kwarg; call the model through "
            "postrl.engine.logprob (or load it with attn_implementation='sdpa' for plain use)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    idx = postrl_layout.gather_idx  # (S, L)
    s, length = idx.shape
    q = query[0][:, idx].transpose(0, 1)  # (H, S, L, D) -> (S, H, L, D)
    k = key[0][:, idx].transpose(0, 1)  # (S, Hkv, L, D)
    v = value[0][:, idx].transpose(0, 1)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)  # (S, H, L, D)
    out = out.transpose(1, 2).reshape(s * length, out.shape[1], out.shape[-1])  # (S*L, H, D)
    return out[postrl_layout.out_idx].unsqueeze(0), None  # (1, N, H, D)


def register_varlen_attention() -> None:
    """Register :func:`varlen_attention` as ``attn_implementation='postrl_varlen'`` (idempotent).

    No mask function is registered on purpose: transformers then skips building any mask.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention)
