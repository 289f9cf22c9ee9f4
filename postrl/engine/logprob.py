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
   reduction over the same softmax: no further (chunk, V) tensor). Under
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
    group, g, gplen, pstart, rlen, rstart, tok_kind, tok_group, tok_row, within, n
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
        layout = AttnLayout(gather_idx=gather, out_idx=tok_row * width + pos)
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
):
    logits = (h @ weight.t()).float()  # (C, V)
    if bias is not None:
        logits = logits + bias.float()
    logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    logp = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, dim=-1)  # (C, V)
    ent = lse - (probs * logits).sum(-1)
    if not sum_pi_squared:
        return logp, ent
    return logp, ent, torch.linalg.vector_norm(probs, dim=-1).square()  # (C,) Σ_v π_v²


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Per-token ``log softmax(h Wᵀ / τ)[y]`` and entropy, ``chunk_size`` rows at a time.

    Args:
        hidden: (M, H) hidden states.
        head: the LM head.
        targets: (M,) token ids.
        temperature: τ > 0.
        sum_pi_squared: also return ``Σ_v π_v²`` of each row's next-token distribution.

    Returns:
        (logp (M,), entropy (M,)) fp32, plus sum_pi_squared (M,) when asked.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    inv = 1.0 / float(temperature)
    m = hidden.shape[0]
    if m <= chunk_size:
        return _chunk_stats(hidden, head.weight, head.bias, targets, inv, sum_pi_squared)
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
    out = torch.zeros(resp_valid.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(resp_valid, values)


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
) -> tuple[torch.Tensor, ...]:
    """Padding-free log-probs (and entropy) of the response tokens of one micro-batch.

    ``packed=False`` is the fallback for models whose attention layers do not dispatch through
    transformers' ``AttentionInterface`` (so postrl's varlen attention cannot run): one ordinary
    forward over the padded (B, P+R) batch with its 2-D mask; ``share_prefix`` is then ignored.
    The head, temperature and chunking are the same.

    ``calculate_sum_pi_squared`` adds a third output, ``Σ_v π(v | ·)²`` per response token
    (B, R) fp32 at the same temperature (the optimal token baseline's ``sum_pi_squared``), from
    the same softmax as the entropy.

    Returns:
        (log_probs (B, R) fp32, entropy (B, R) fp32 or None[, sum_pi_squared (B, R) fp32]);
        0 on padding.
    """
    if packed:
        pk = pack(input_ids, attention_mask, response_length, share_prefix=share_prefix)
        resp_valid = pk.resp_valid
        if pk.num_tokens == 0:
            z = torch.zeros(resp_valid.shape, device=input_ids.device)
            empty = (z, (z if calculate_entropy else None))
            return (*empty, z) if calculate_sum_pi_squared else empty
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
    )
    out = (
        _scatter(stats[0], resp_valid),
        _scatter(stats[1], resp_valid) if calculate_entropy else None,
    )
    return (*out, _scatter(stats[2], resp_valid)) if calculate_sum_pi_squared else out


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
