"""Helpers of the CUDA tests (a separate module: ``conftest`` names are not importable safely)."""

from __future__ import annotations

import socket

import torch

from postrl.protocol import DataProto


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for a one-rank process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synth_batch(
    num_prompts: int = 4, n: int = 4, p: int = 8, r: int = 6, seed: int = 0
) -> DataProto:
    """A GRPO-shaped batch (left-padded prompts shared by each group, right-padded responses,
    random advantages), as the rollout lays it out; byte-range token ids."""
    g = torch.Generator().manual_seed(seed)
    b = num_prompts * n
    prompts = torch.randint(0, 250, (num_prompts, p), generator=g).repeat_interleave(n, 0)
    plen = torch.randint(1, p + 1, (num_prompts,), generator=g).repeat_interleave(n)  # (B,)
    rlen = torch.randint(1, r + 1, (b,), generator=g)  # (B,)
    pmask = torch.arange(p).unsqueeze(0) >= (p - plen).unsqueeze(1)  # (B, P)
    rmask = torch.arange(r).unsqueeze(0) < rlen.unsqueeze(1)  # (B, R)
    responses = torch.randint(0, 250, (b, r), generator=g) * rmask
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
