"""KV storage of the native engine: shared prompt prefixes + per-slot completion caches.

Every running sequence ``b`` = a *prefix* (its prompt, stored once per distinct prompt however many
sequences share it) + its own completion tokens (stored in slot ``b``)::

    prefix store  pk, pv: (L, S, H_kv, T_max, D)   prompt p at row p, positions 0 .. P_p-1
    slot store    k,  v : (L, S, H_kv, T_max, D)   slot b, position P_b + j at offset j

Both stores are kept *compact*: live prefixes occupy rows ``0 .. NG-1`` and running slots
``0 .. B-1`` (holes are filled by moving the last rows), so decode reads them as views.

The n samples of a GRPO prompt reference one prefix: prefill runs once per distinct prompt
(``lookup``), and decode attention reads the prompt K/V once per group (one batched matmul of the
group's ``n·G`` queries against it) instead of once per sample. A prompt equal to a live prefix
(e.g. samples arriving a step later) reuses it and its stored last-position logits: no prefill.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

__all__ = ["KVStore", "DecodeLayout", "lazy_zeros"]

_LAZY_MIN_BYTES = 1 << 20


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zero tensor whose CPU pages are materialised only when first written.

    ``torch.zeros`` writes every byte (the KV store is re-created on every ``wake_up``: ~6 ms per
    10 MB, 32 ms of a 120 ms W1 rollout). On CPU, large stores are instead backed by an anonymous
    ``mmap``: the kernel hands out zero pages on first touch, so only the positions the engine
    writes cost anything, and the mapping is released with the tensor. Other devices and small
    tensors use ``torch.zeros``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < _LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@dataclass
class DecodeLayout:
    """Per-membership index tensors for grouped decode attention (rebuilt on join/leave).

    ``flat[b] = pid_b · nmax + rank_b`` places slot ``b``'s queries in a padded (NG, nmax) table;
    ``pre_mask`` (B, 1, 1, Pm) is 0 for prompt positions ``j < P_b`` and -inf after.
    """

    NG: int
    nmax: int
    Pm: int
    flat: torch.Tensor
    pre_mask: torch.Tensor
    identity: bool = False
    """True when slots are already grouped contiguously (``flat == arange(B)``, ``B = NG·nmax``):
    the group table is then a view, no scatter/gather needed (the W1 case)."""


class KVStore:
    """Prefix + slot K/V tensors and the prefix table (prompt → row, refcounts)."""

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, slots, kv_heads, max_len, head_dim)
        # zero pages on first touch (CPU): only the positions written cost memory and time
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)
        self.pk = lazy_zeros(shape, dtype, device)
        self.pv = lazy_zeros(shape, dtype, device)
        self.logits = lazy_zeros((slots, vocab), dtype, device)  # last-prompt-position logits
        self.keys: list[tuple[int, ...]] = []  # row -> prompt
        self.refs: list[int] = []  # row -> number of running sequences using it
        self.index: dict[tuple[int, ...], int] = {}

    @property
    def num_prefixes(self) -> int:
        """Live prefixes (rows 0 .. NG-1)."""
        return len(self.keys)

    def lookup(self, prompts: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
        """Rows for ``prompts`` (refcounts taken) and the list of rows that are new (need
        prefill)."""
        rows, new = [], []
        for p in prompts:
            r = self.index.get(p)
            if r is None:
                r = len(self.keys)
                self.index[p] = r
                self.keys.append(p)
                self.refs.append(0)
                new.append(r)
            self.refs[r] += 1
            rows.append(r)
        return rows, new

    def release(self, rows: list[int]) -> torch.Tensor | None:
        """Drop one reference per row; compact dead prefixes away. Returns the old→new row map
        (NG_old,) when rows moved, else None."""
        for r in rows:
            self.refs[r] -= 1
        dead = [r for r, c in enumerate(self.refs) if c == 0]
        if not dead:
            return None
        for r in dead:
            del self.index[self.keys[r]]
        ng_old, keep = len(self.keys), len(self.keys) - len(dead)
        holes = [r for r in dead if r < keep]
        movers = [r for r in range(keep, ng_old) if self.refs[r] > 0]
        remap = torch.arange(ng_old, device=self.k.device)
        if holes:
            dst = torch.tensor(holes, device=self.k.device)
            src = torch.tensor(movers, device=self.k.device)
            P = max(len(self.keys[m]) for m in movers)
            self.pk[:, dst, :, :P] = self.pk[:, src, :, :P]
            self.pv[:, dst, :, :P] = self.pv[:, src, :, :P]
            self.logits[dst] = self.logits[src]
            remap[src] = dst
            for h, m in zip(holes, movers, strict=True):
                self.keys[h], self.refs[h] = self.keys[m], self.refs[m]
                self.index[self.keys[h]] = h
        del self.keys[keep:]
        del self.refs[keep:]
        return remap

    def layout(self, pids: torch.Tensor, plens: torch.Tensor) -> DecodeLayout:
        """Build the grouped-attention layout for running slots with prefix rows ``pids`` (B,)."""
        B, dev = pids.shape[0], pids.device
        counts: dict[int, int] = {}
        rank = []
        for p in pids.tolist():
            rank.append(counts.get(p, 0))
            counts[p] = rank[-1] + 1
        nmax = max(counts.values()) if counts else 1
        Pm = max((len(self.keys[p]) for p in counts), default=1)
        flat = pids * nmax + torch.tensor(rank, dtype=torch.int64, device=dev)
        pre_mask = torch.zeros(B, 1, 1, Pm, dtype=self.k.dtype, device=dev)
        pre_mask.masked_fill_(
            (torch.arange(Pm, device=dev)[None, :] >= plens[:, None])[:, None, None, :],
            float("-inf"),
        )
        identity = B == len(counts) * nmax == self.num_prefixes * nmax and bool(
            torch.equal(flat, torch.arange(B, device=dev))
        )
        return DecodeLayout(self.num_prefixes, nmax, Pm, flat, pre_mask, identity)
