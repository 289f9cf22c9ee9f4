"""Padding-free log-probs, entropy and values of response tokens.

Pipeline for one micro-batch (``B`` rows of ``input_ids`` (B, P+R) = left-padded prompt ++
right-padded response, ``attention_mask`` (B, P+R)):

1. :func:`pack` removes padding and lays the ``N`` valid tokens out in one row, optionally with
   **prefix sharing** (rows with identical prompts store the prompt once; see
   :mod:`postrl.engine.varlen`). Position ids restart at 0 for every sequence (responses continue
   after their prompt).
2. The decoder runs once over the packed row with postrl's varlen attention → hidden (N, H).
3. Only the ``M`` hidden states that predict a response token are kept, and
   :func:`chunked_token_logprobs` projects them to the vocabulary ``chunk_size`` rows at a time:
   for logits ``z = h Wᵀ / τ`` (τ the rollout temperature, applied exactly as the sampler did),
   ``log p(y) = z_y − logsumexp(z)`` and ``H = logsumexp(z) − Σ_v softmax(z)_v z_v`` (and, when
   asked, ``Σ_v softmax(z)_v²``, the optimal-token-baseline's ``sum_pi_squared``, as one
   reduction over the same softmax: no further (chunk, V) tensor; and for distillation a
   teacher's top-k log-probs and ids, or a student's log-probs at given ids). Under
   autograd each chunk is recomputed in backward (activation checkpointing) so at most one
   (chunk, V) logits tensor is alive at any time.
4. Results are scattered back to (B, R), zero on padding.

Logit soft-capping (Gemma 2) and logit scaling (Cohere) are not applied: models that need them
are rejected by :class:`~postrl.engine.model.PolicyModel` only in that their lm head must be a
plain ``nn.Linear``; add them here if such a model is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from postrl.engine.varlen import AttnLayout, PrefixLayout
from postrl.kernels.train import Segments

__all__ = ["Packed", "pack", "chunked_token_logprobs", "policy_logprobs", "critic_values"]

DEFAULT_CHUNK = 1024


@dataclass(frozen=True)
class Packed:
    """A packed micro-batch.

    Attributes:
        input_ids: (1, N) packed token ids.
        position_ids: (1, N) per-sequence positions.
        layout: the varlen attention layout (:class:`PrefixLayout` with prefix sharing).
        pred_idx: (M,) packed index of the hidden state predicting each valid response token.
        targets: (M,) the response token ids.
        resp_valid: (B, R) bool, where the M values go back to.
        num_tokens: N (tokens actually computed).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: AttnLayout
    pred_idx: torch.Tensor
    targets: torch.Tensor
    resp_valid: torch.Tensor
    num_tokens: int


def _prefix_layout(
    group, g, gplen, pstart, rlen, rstart, tok_kind, tok_group, tok_row, within, n, segments
) -> PrefixLayout:
    """The two-pass prompt-shared attention layout (see
    :class:`~postrl.engine.varlen.PrefixLayout`)."""
    dev = group.device
    b = group.shape[0]
    lp = max(int(gplen.max()), 1)
    lr = int(rlen.max()) if b else 0
    jp = torch.arange(lp, device=dev)
    ir = torch.arange(lr, device=dev)
    prompt_idx = (
        pstart.unsqueeze(1) + torch.minimum(jp.unsqueeze(0), (gplen - 1).clamp(min=0).unsqueeze(1))
    ).clamp(0, n - 1)
    resp_q_idx = (
        rstart.unsqueeze(1) + torch.minimum(ir.unsqueeze(0), (rlen - 1).clamp(min=0).unsqueeze(1))
    ).clamp(0, n - 1)
    resp_k_idx = torch.cat([prompt_idx[group], resp_q_idx], dim=1)  # (B, Lp + Lr)
    see_prompt = (jp.view(1, 1, lp) < gplen[group].view(b, 1, 1)).expand(b, lr, lp)
    see_resp = (ir.view(1, 1, lr) <= ir.view(1, lr, 1)).expand(b, lr, lr)
    resp_mask = torch.cat([see_prompt, see_resp], dim=2).unsqueeze(1)  # (B, 1, Lr, Lp + Lr)
    out_idx = torch.where(tok_kind == 0, tok_group * lp + within, g * lp + tok_row * lr + within)
    return PrefixLayout(
        prompt_idx=prompt_idx,
        resp_q_idx=resp_q_idx,
        resp_k_idx=resp_k_idx,
        resp_mask=resp_mask,
        out_idx=out_idx,
        segments=segments,
    )


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    share_prefix: bool = False,
) -> Packed:
    """Remove padding and pack a micro-batch into one row.

    Each row is a prompt segment (its valid tokens, contiguous because prompts are left-padded)
    and a response segment (contiguous, right-padded). With ``share_prefix`` rows whose prompt
    (ids and padding) is identical form a group whose prompt segment is stored once; otherwise
    every row is its own group. Virtual attention sequence of row b: [prompt of its group,
    response of b].

    Args:
        input_ids: (B, P+R) token ids.
        attention_mask: (B, P+R) 1 on valid tokens.
        response_length: R.
        share_prefix: share identical prompts.
    """
    dev = input_ids.device
    b, t = input_ids.shape
    p = t - response_length
    if p < 1:
        raise ValueError(
            f"need at least one prompt column, got input width {t} and "
            f"response_length {response_length}"
        )
    mask = attention_mask.bool()
    plen = mask[:, :p].sum(1)  # (B,)
    rlen = mask[:, p:].sum(1)  # (B,)
    if bool(((plen == 0) & (rlen > 0)).any()):
        raise ValueError(
            "a row has response tokens but an empty prompt; every response needs >= 1 prompt token"
        )
    rows = torch.arange(b, device=dev)
    if share_prefix:
        key = torch.where(mask[:, :p], input_ids[:, :p], torch.full_like(input_ids[:, :p], -1))
        _, group = torch.unique(key, dim=0, return_inverse=True)  # (B,)
    else:
        group = rows
    g = int(group.max()) + 1 if b else 0
    owner = torch.full((g,), b, device=dev, dtype=torch.long).scatter_reduce(
        0, group, rows, "amin"
    )  # (G,)
    # Segments: G prompt segments then B response segments, ordered (group, kind, row).
    seg_row = torch.cat([owner, rows])  # (G+B,)
    seg_kind = torch.cat(
        [torch.zeros(g, dtype=torch.long, device=dev), torch.ones(b, dtype=torch.long, device=dev)]
    )
    seg_group = torch.cat([torch.arange(g, device=dev), group])
    seg_len = torch.cat([plen[owner], rlen])
    seg_col0 = torch.cat([p - plen[owner], torch.full((b,), p, device=dev, dtype=torch.long)])
    order = torch.argsort(seg_group * (2 * (b + 1)) + seg_kind * (b + 1) + seg_row)
    seg_row, seg_kind, seg_group, seg_len, seg_col0 = (
        x[order] for x in (seg_row, seg_kind, seg_group, seg_len, seg_col0)
    )
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    n = int(seg_len.sum())
    segments = Segments(
        start=seg_start,
        length=seg_len,
        group_off=torch.cat(
            [seg_len.new_zeros(1), torch.bincount(seg_group, minlength=g).cumsum(0)]
        ),
    )
    seg_of_tok = torch.repeat_interleave(torch.arange(len(seg_len), device=dev), seg_len)  # (N,)
    within = torch.arange(n, device=dev) - seg_start[seg_of_tok]  # (N,)
    ids = input_ids[seg_row[seg_of_tok], seg_col0[seg_of_tok] + within]  # (N,)
    # start of each group's prompt / each row's response in the packed row
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order), device=dev)
    pstart = seg_start[inv[:g]]  # (G,)
    rstart = seg_start[inv[g:]]  # (B,)
    gplen = plen[owner]  # (G,)
    tok_plen = gplen[seg_group[seg_of_tok]]  # (N,)
    pos = within + seg_kind[seg_of_tok] * tok_plen  # (N,)
    if share_prefix:
        layout = _prefix_layout(
            group,
            g,
            gplen,
            pstart,
            rlen,
            rstart,
            seg_kind[seg_of_tok],
            seg_group[seg_of_tok],
            seg_row[seg_of_tok],
            within,
            n,
            segments,
        )
    else:
        # One virtual sequence per row: [its prompt, its response], causal.
        vlen = gplen[group] + rlen  # (B,)
        width = max(int(vlen.max()) if b else 1, 1)
        j = torch.arange(width, device=dev).unsqueeze(0)  # (1, L)
        jc = torch.minimum(j, (vlen - 1).clamp(min=0).unsqueeze(1))  # (B, L) clamp padding slots
        in_prompt = jc < gplen[group].unsqueeze(1)
        gather = torch.where(
            in_prompt,
            pstart[group].unsqueeze(1) + jc,
            rstart.unsqueeze(1) + jc - gplen[group].unsqueeze(1),
        )
        gather = gather.clamp(0, max(n - 1, 0))
        # Outputs: prompt tokens read the owner's virtual sequence, response tokens their own.
        tok_row = torch.where(
            seg_kind[seg_of_tok] == 0, owner[seg_group[seg_of_tok]], seg_row[seg_of_tok]
        )
        layout = AttnLayout(gather_idx=gather, out_idx=tok_row * width + pos, segments=segments)
    # Response targets and the hidden states predicting them.
    resp_valid = mask[:, p:]  # (B, R)
    r_idx = torch.arange(response_length, device=dev).unsqueeze(0).expand(b, -1)
    pred_all = torch.where(
        r_idx == 0,
        (pstart[group] + gplen[group] - 1).unsqueeze(1).expand(b, response_length),
        rstart.unsqueeze(1) + r_idx - 1,
    )  # (B, R)
    return Packed(
        input_ids=ids.unsqueeze(0),
        position_ids=pos.unsqueeze(0),
        layout=layout,
        pred_idx=pred_all[resp_valid],
        targets=input_ids[:, p:][resp_valid],
        resp_valid=resp_valid,
        num_tokens=n,
    )


def _chunk_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    inv_temp: float,
    sum_pi_squared: bool = False,
    topk: int = 0,
    at_ids: torch.Tensor | None = None,
):
    logits = (h @ weight.t()).float()  # (C, V)
    if bias is not None:
        logits = logits + bias.float()
    logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    logp = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, dim=-1)  # (C, V)
    ent = lse - (probs * logits).sum(-1)
    out: tuple[torch.Tensor, ...] = (logp, ent)
    if sum_pi_squared:
        out += (torch.linalg.vector_norm(probs, dim=-1).square(),)  # (C,) Σ_v π_v²
    if topk:
        top_z, top_id = logits.topk(topk, dim=-1)  # (C, K) sorted, largest first
        out += (top_z - lse.unsqueeze(-1), top_id)  # normalised log-probs and their ids
    if at_ids is not None:
        out += (logits.gather(-1, at_ids) - lse.unsqueeze(-1),)  # (C, K)
    return out


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    sum_pi_squared: bool = False,
    topk: int = 0,
    logprobs_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-token ``log softmax(h Wᵀ / τ)[y]`` and entropy, ``chunk_size`` rows at a time.

    Args:
        hidden: (M, H) hidden states.
        head: the LM head.
        targets: (M,) token ids.
        temperature: τ > 0.
        sum_pi_squared: also return ``Σ_v π_v²`` of each row's next-token distribution.
        topk: also return the ``topk`` largest log-probs of each row's next-token distribution
            and their token ids (a distillation teacher's top-k), 0 = no.
        logprobs_at: (M, K) token ids: also return the log-probs of these ids at each row
            (differentiable: a student's log-probs at a teacher's top-k ids).

    Returns:
        (logp (M,), entropy (M,)) fp32, then, when asked and in this order: sum_pi_squared
        (M,); top-k log-probs (M, K) fp32 and ids (M, K) int64; log-probs at ``logprobs_at``
        (M, K) fp32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if topk < 0 or topk > head.weight.shape[0]:
        raise ValueError(f"topk={topk} must be in [0, vocabulary size {head.weight.shape[0]}]")
    inv = 1.0 / float(temperature)
    m = hidden.shape[0]
    if m <= chunk_size:
        return _chunk_stats(
            hidden, head.weight, head.bias, targets, inv, sum_pi_squared, topk, logprobs_at
        )
    grad = torch.is_grad_enabled()
    parts: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, m, chunk_size):
        args = (
            hidden[s : s + chunk_size],
            head.weight,
            head.bias,
            targets[s : s + chunk_size],
            inv,
            sum_pi_squared,
            topk,
            None if logprobs_at is None else logprobs_at[s : s + chunk_size],
        )
        parts.append(
            checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args)
        )
    return tuple(torch.cat(cols) for cols in zip(*parts))


def _padded_pred_hidden(
    decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padded fallback: ``(hidden states predicting the valid response tokens (M, H), their
    targets (M,), resp_valid (B, R))`` from one ordinary masked forward over (B, P+R)."""
    pos = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    out = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False
    )
    t = input_ids.shape[1]
    p = t - response_length
    resp_valid = attention_mask[:, p:].bool()
    hidden = out.last_hidden_state[:, p - 1 : t - 1]  # state t-1 predicts token t
    return hidden[resp_valid], input_ids[:, p:][resp_valid], resp_valid


def _decoder_hidden(decoder: nn.Module, pk: Packed) -> torch.Tensor:
    out = decoder(
        input_ids=pk.input_ids,
        position_ids=pk.position_ids,
        postrl_layout=pk.layout,
        use_cache=False,
    )
    return out.last_hidden_state[0]  # (N, H)


def _scatter(values: torch.Tensor, resp_valid: torch.Tensor) -> torch.Tensor:
    """(M, *rest) values of the valid response tokens back to (B, R, *rest), 0 elsewhere."""
    rest = values.shape[1:]
    out = torch.zeros((*resp_valid.shape, *rest), dtype=values.dtype, device=values.device)
    mask = resp_valid.view(*resp_valid.shape, *(1 for _ in rest)).expand_as(out)
    return out.masked_scatter(mask, values)


def policy_logprobs(
    decoder: nn.Module,
    head: nn.Linear,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    share_prefix: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    packed: bool = True,
    calculate_sum_pi_squared: bool = False,
    topk: int = 0,
    logprobs_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Padding-free log-probs (and entropy) of the response tokens of one micro-batch.

    ``packed=False`` is the fallback for models whose attention layers do not dispatch through
    transformers' ``AttentionInterface`` (so postrl's varlen attention cannot run): one ordinary
    forward over the padded (B, P+R) batch with its 2-D mask; ``share_prefix`` is then ignored.
    The head, temperature and chunking are the same.

    ``calculate_sum_pi_squared`` adds ``Σ_v π(v | ·)²`` per response token (B, R) fp32 at the
    same temperature (the optimal token baseline's ``sum_pi_squared``), from the same softmax as
    the entropy. ``topk`` adds the ``topk`` largest log-probs of each response position's
    next-token distribution (B, R, K) fp32 and their ids (B, R, K) int64 (a distillation
    teacher's top-k); ``logprobs_at`` (B, R, K) ids adds the log-probs of those ids (B, R, K)
    fp32, differentiable (a student's log-probs at the teacher's top-k, for ``distill.loss=gkd``).

    Returns:
        (log_probs (B, R) fp32, entropy (B, R) fp32 or None), then, when asked and in this
        order: sum_pi_squared; top-k log-probs and ids; log-probs at ``logprobs_at``. 0 on
        padding.
    """
    if packed:
        pk = pack(input_ids, attention_mask, response_length, share_prefix=share_prefix)
        resp_valid = pk.resp_valid
        if pk.num_tokens == 0:
            z = torch.zeros(resp_valid.shape, device=input_ids.device)
            out: tuple = (z, (z if calculate_entropy else None))
            if calculate_sum_pi_squared:
                out += (z,)
            if topk:
                zk = torch.zeros((*resp_valid.shape, topk), device=input_ids.device)
                out += (zk, zk.long())
            if logprobs_at is not None:
                out += (torch.zeros(logprobs_at.shape, device=input_ids.device),)
            return out
        # index_select, not hidden[pred_idx]: with prefix sharing pred_idx repeats (the prompt's
        # last state predicts every response's first token), and advanced indexing's backward
        # (index_put_ accumulate) adds repeats with racing atomics at >1 thread — run-to-run
        # different bits; index_select's backward (index_add_) is serial over indices
        hidden, targets = _decoder_hidden(decoder, pk).index_select(0, pk.pred_idx), pk.targets
    else:
        hidden, targets, resp_valid = _padded_pred_hidden(
            decoder, input_ids, attention_mask, response_length
        )
    stats = chunked_token_logprobs(
        hidden,
        head,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        sum_pi_squared=calculate_sum_pi_squared,
        topk=topk,
        logprobs_at=None if logprobs_at is None else logprobs_at[resp_valid],  # (M, K)
    )
    out = (
        _scatter(stats[0], resp_valid),
        _scatter(stats[1], resp_valid) if calculate_entropy else None,
    )
    return out + tuple(_scatter(x, resp_valid) for x in stats[2:])


def critic_values(
    decoder: nn.Module,
    value_head: nn.Linear,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    share_prefix: bool = False,
    packed: bool = True,
) -> torch.Tensor:
    """Values ``V(s_t)`` at the states that emit each response token, (B, R) fp32, 0 on padding.

    As in verl, the value of response token t is read at the hidden state that predicts it.
    ``packed=False``: the padded fallback (see :func:`policy_logprobs`).
    """
    if not packed:
        hidden, _, resp_valid = _padded_pred_hidden(
            decoder, input_ids, attention_mask, response_length
        )
        return _scatter(value_head(hidden).squeeze(-1).float(), resp_valid)
    pk = pack(input_ids, attention_mask, response_length, share_prefix=share_prefix)
    if pk.num_tokens == 0:
        return torch.zeros(pk.resp_valid.shape, device=input_ids.device)
    hidden = _decoder_hidden(decoder, pk)
    v = value_head(hidden.index_select(0, pk.pred_idx)).squeeze(-1).float()  # (M,), see above
    return _scatter(v, pk.resp_valid)
