"""Loss aggregation (``agg_loss``) with explicit global denominators.

A loss matrix ``L`` (B, T) and mask ``M`` (B, T) reduce to a scalar in one of five modes. Let
``N_tok`` be the number of valid tokens and ``N_seq`` the number of sequences with at least one
valid token **in the whole optimizer step** (all micro-batches, all dp ranks), and
``n_i = sum_t M_it``:

==========================  =================================================  =============
mode                        value                                              needs
==========================  =================================================  =============
``token-mean``              ``sum_it L_it M_it / N_tok``                       N_tok
``token-sum``               ``sum_it L_it M_it``                               —
``seq-mean-token-sum``      ``sum_i (sum_t L_it M_it) / N_seq``                N_seq
``seq-mean-token-mean``     ``sum_i (sum_t L_it M_it / n_i) / N_seq``          N_seq
``seq-mean-token-sum-norm`` ``sum_i (sum_t L_it M_it) / (N_seq * C)``          N_seq (+ C)
==========================  =================================================  =============

``C`` (``norm_length``) is the constant of Dr. GRPO (arXiv 2503.20783): verl uses the max
response length; we default to ``loss_mask.shape[-1]``. Pass ``norm_length`` explicitly
(e.g. ``data.max_response_length``) whenever micro-batches may be padded to different widths,
otherwise the constant changes between shards.

**Additivity contract.** The returned value is this shard's *additive contribution*: summing
``agg_loss`` over disjoint shards that each receive the same global denominators equals
``agg_loss`` of the whole batch. There is no ``* dp_size`` factor (verl multiplies by
``dp_size`` to undo DDP/FSDP gradient averaging; here the engine owns that correction — with a
mean all-reduce it must scale the loss by ``dp_size`` itself). Without denominators the local
counts are used (single-shard use). If ``dp_size > 1`` and a needed denominator is missing we
raise ``ValueError``: a silently wrong factor across parallel sizes is the bug we refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from postrl.registry import Registry

__all__ = ["AGG_MODES", "AggFn", "agg_loss", "register_agg_mode"]


class AggFn(Protocol):
    """Signature of a registered aggregation mode."""

    def __call__(
        self,
        loss_mat: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        global_num_tokens: torch.Tensor | float | None,
        global_num_seqs: torch.Tensor | float | None,
        norm_length: float | None,
    ) -> torch.Tensor:
        """Reduce (B, T) losses to a 0-d tensor."""
        ...


AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")


def register_agg_mode(name: str, **meta: object) -> Callable[[AggFn], AggFn]:
    """Register an aggregation mode; declare ``needs=("global_num_tokens", ...)``."""
    return AGG_MODES.register(name, **meta)


def _den(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A denominator as a tensor on ``like``'s device, clamped to >= 1 to avoid 0/0."""
    d = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return d.clamp(min=1.0)


def _seq_token_sums(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(loss_mask.bool(), loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)  # (B,)


def _local_num_seqs(loss_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (loss_mask.sum(dim=-1) > 0).to(dtype).sum()


@register_agg_mode("token-mean", needs=("global_num_tokens",))
def _token_mean(loss_mat, loss_mask, *, global_num_tokens, global_num_seqs, norm_length):
    total = torch.where(loss_mask.bool(), loss_mat, torch.zeros_like(loss_mat)).sum()
    n = loss_mask.to(loss_mat.dtype).sum() if global_num_tokens is None else global_num_tokens
    return total / _den(n, total)


@register_agg_mode("token-sum", needs=())
def _token_sum(loss_mat, loss_mask, *, global_num_tokens, global_num_seqs, norm_length):
    return torch.where(loss_mask.bool(), loss_mat, torch.zeros_like(loss_mat)).sum()


@register_agg_mode("seq-mean-token-sum", needs=("global_num_seqs",))
def _seq_mean_token_sum(loss_mat, loss_mask, *, global_num_tokens, global_num_seqs, norm_length):
    seq = _seq_token_sums(loss_mat, loss_mask)  # (B,)
    n = _local_num_seqs(loss_mask, seq.dtype) if global_num_seqs is None else global_num_seqs
    return seq.sum() / _den(n, seq)


@register_agg_mode("seq-mean-token-mean", needs=("global_num_seqs",))
def _seq_mean_token_mean(loss_mat, loss_mask, *, global_num_tokens, global_num_seqs, norm_length):
    seq = _seq_token_sums(loss_mat, loss_mask)  # (B,)
    n_i = loss_mask.to(seq.dtype).sum(dim=-1).clamp(min=1.0)  # (B,); empty rows sum to 0 anyway
    n = _local_num_seqs(loss_mask, seq.dtype) if global_num_seqs is None else global_num_seqs
    return (seq / n_i).sum() / _den(n, seq)


@register_agg_mode("seq-mean-token-sum-norm", needs=("global_num_seqs",))
def _seq_mean_token_sum_norm(
    loss_mat, loss_mask, *, global_num_tokens, global_num_seqs, norm_length
):
    seq = _seq_token_sums(loss_mat, loss_mask)  # (B,)
    n = _local_num_seqs(loss_mask, seq.dtype) if global_num_seqs is None else global_num_seqs
    c = float(loss_mask.shape[-1] if norm_length is None else norm_length)
    return seq.sum() / (_den(n, seq) * max(c, 1.0))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: torch.Tensor | float | None = None,
    global_num_seqs: torch.Tensor | float | None = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) loss matrix into this shard's additive scalar contribution.

    See the module docstring for the formula of each mode and the additivity contract.

    Args:
        loss_mat: (B, T) per-token losses.
        loss_mask: (B, T) 1/True on tokens that count.
        loss_agg_mode: a name registered in ``AGG_MODES``.
        global_num_tokens: valid tokens in the whole optimizer step (all shards).
        global_num_seqs: sequences with >= 1 valid token in the whole optimizer step.
        dp_size: data-parallel world size; > 1 makes the needed denominators mandatory.
        norm_length: the constant ``C`` of ``seq-mean-token-sum-norm``.

    Returns:
        0-d tensor.

    Raises:
        ValueError: ``dp_size > 1`` and a denominator the mode needs is ``None``.
        RegistryError: unknown ``loss_agg_mode`` (lists the registered ones).
    """
    fn = AGG_MODES.get(loss_agg_mode)
    if dp_size > 1:
        given = {"global_num_tokens": global_num_tokens, "global_num_seqs": global_num_seqs}
        missing = [
            k for k in AGG_MODES.meta(loss_agg_mode).get("needs", ()) if given.get(k) is None
        ]
        if missing:
            raise ValueError(
                f"agg_loss(loss_agg_mode={loss_agg_mode!r}, dp_size={dp_size}) needs "
                f"{', '.join(missing)}: pass the count summed over all micro-batches and dp "
                f"ranks of the step (see postrl.algos.local_denominators)"
            )
    return fn(
        loss_mat,
        loss_mask,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_length=norm_length,
    )
