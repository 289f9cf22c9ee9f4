"""Synthetic RL batches in the trainer's layout, for tests of engines and workers."""

from __future__ import annotations

import torch

from postrl.protocol import DataProto

__all__ = ["synth_batch"]


def synth_batch(
    num_prompts: int = 4, n: int = 4, p: int = 8, r: int = 6, seed: int = 0, vocab: int = 250
) -> DataProto:
    """A GRPO-shaped batch: ``num_prompts`` left-padded prompts × ``n`` right-padded responses.

    Rows of a group share their prompt (ids and padding), as the rollout produces them.
    """
    g = torch.Generator().manual_seed(seed)
    b = num_prompts * n
    prompts = torch.randint(0, vocab, (num_prompts, p), generator=g).repeat_interleave(
        n, 0
    )  # (B, P)
    plen = torch.randint(1, p + 1, (num_prompts,), generator=g).repeat_interleave(n)  # (B,)
    rlen = torch.randint(1, r + 1, (b,), generator=g)
    cols_p = torch.arange(p).unsqueeze(0)
    cols_r = torch.arange(r).unsqueeze(0)
    pmask = cols_p >= (p - plen).unsqueeze(1)
    rmask = cols_r < rlen.unsqueeze(1)
    responses = torch.randint(0, vocab, (b, r), generator=g) * rmask
    prompts = prompts * pmask
    am = torch.cat([pmask, rmask], 1).long()
    adv = torch.randn(b, 1, generator=g).expand(b, r) * rmask
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": am,
            "position_ids": (am.cumsum(1) - 1).clamp(min=0),
            "response_mask": rmask.long(),
            "advantages": adv.contiguous(),
        },
        meta_info={"temperature": 1.0},
    )
