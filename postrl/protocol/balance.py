"""Sequence balancing: Karmarkar-Karp partitioning of sequence lengths.

Attention and MLP cost grow with the number of tokens a rank processes, so an even split of a
batch by *rows* can leave one dp rank with far more tokens than another. We partition the
lengths into k parts of equal row count with the largest differencing method (Karmarkar & Karp,
"The differencing method of set partitioning", 1982; the k-way, equal-cardinality variant as used
by verl's ``seqlen_balancing``) and return a permutation; ``DataProto.reorder(perm)`` followed by
an even ``chunk(k)`` then gives every rank nearly the same token load.

Karmarkar-Karp (k-way): every item starts as a *state* of k sets (equal-size variant: the k items
of each consecutive group of the sorted lengths, one per set). Repeatedly pop the two states with
the largest spread ``max(set sums) - min(set sums)`` and merge them by pairing the largest set of
one with the smallest set of the other; the last state is the partition. Pairing sets with equal
counts keeps counts equal. Cost O(n log n) for moderate k.

Imbalance metric (reported as ``balance/imbalance_before`` / ``balance/imbalance_after``):
``max_part_tokens / max(min_part_tokens, 1)`` over the k even chunks (1.0 = perfect).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import torch

__all__ = ["balanced_permutation", "imbalance", "karmarkar_karp", "partition_by_token_budget"]

_State = list[tuple[int, list[int]]]  # k sets as (sum, item indices), sorted by sum descending


def _spread(state: _State) -> int:
    return state[0][0] - state[-1][0]


def karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Partition item indices ``0..n-1`` into ``k`` parts with near-equal sums of ``seqlens``.

    Args:
        seqlens: non-negative lengths (token counts) per item.
        k: number of parts.
        equal_size: every part gets ``n / k`` items (requires ``n % k == 0``); otherwise part
            sizes are free (some parts may be empty when ``n < k``).

    Returns:
        ``k`` lists of item indices, each sorted ascending; parts ordered by their smallest index
        (empty parts last).
    """
    n = len(seqlens)
    if k < 1:
        raise ValueError(f"karmarkar_karp: k={k} must be >= 1")
    if equal_size and n % k:
        raise ValueError(
            f"karmarkar_karp: {n} items cannot form {k} parts of equal size; "
            f"pad the batch to a multiple of {k} (DataProto.pad_to_divisor) "
            "or pass equal_size=False"
        )
    if n == 0:
        return [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (seqlens[i], i))
    counter = itertools.count()
    heap: list[tuple[int, int, _State]] = []
    if equal_size:
        for g in range(0, n, k):
            state = sorted(((int(seqlens[i]), [i]) for i in order[g : g + k]), key=lambda s: -s[0])
            heapq.heappush(heap, (-_spread(state), next(counter), state))
    else:
        for i in order:
            state = [(int(seqlens[i]), [i])] + [(0, []) for _ in range(k - 1)]
            heapq.heappush(heap, (-_spread(state), next(counter), state))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # largest set of a with smallest of b, second largest with second smallest, ...
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-_spread(merged), next(counter), merged))
    parts = [sorted(items) for _, items in heap[0][2]]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def _chunk_sizes(n: int, k: int) -> list[int]:
    """Real rows per chunk after ``pad_to_divisor(k)`` + ``chunk(k)`` (pads excluded)."""
    c = math.ceil(n / k) if n else 0
    return [max(0, min(c, n - j * c)) for j in range(k)]


def _loads(seqlens: Sequence[int], order: Sequence[int], sizes: Sequence[int]) -> list[int]:
    out, pos = [], 0
    for s in sizes:
        out.append(sum(int(seqlens[i]) for i in order[pos : pos + s]))
        pos += s
    return out


def imbalance(loads: Sequence[int]) -> float:
    """``max(loads) / max(min(loads), 1)`` (1.0 = perfectly balanced)."""
    return max(loads) / max(min(loads), 1) if loads else 1.0


def _capacity_lpt(seqlens: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Greedy longest-first into the lightest part that still has room (fixed part sizes)."""
    parts: list[list[int]] = [[] for _ in sizes]
    loads = [0] * len(sizes)
    for i in sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i)):
        j = min(
            (j for j in range(len(sizes)) if len(parts[j]) < sizes[j]), key=lambda j: (loads[j], j)
        )
        parts[j].append(i)
        loads[j] += int(seqlens[i])
    return [sorted(p) for p in parts]


def balanced_permutation(seqlens: Sequence[int], k: int) -> tuple[torch.Tensor, dict[str, float]]:
    """A permutation such that ``reorder(perm)`` then an even split into ``k`` balances tokens.

    ``n % k == 0``: equal-size Karmarkar-Karp. Otherwise the part sizes follow what
    ``pad_to_divisor(k)`` + ``chunk(k)`` produce (``ceil(n/k)`` real rows per chunk, the
    remainder last) and a capacity-aware longest-first greedy fills them. If the result is not
    better than the identity order (by :func:`imbalance`), the identity is returned, so balancing
    never makes things worse. Within a part, rows keep their original relative order.

    Returns:
        ``perm`` (LongTensor of shape (n,)) and metrics ``balance/imbalance_before``,
        ``balance/imbalance_after``, ``balance/max_tokens_before``, ``balance/max_tokens_after``
        (per-chunk token loads, pad rows excluded).
    """
    n = len(seqlens)
    if k < 1:
        raise ValueError(f"balanced_permutation: k={k} must be >= 1")
    sizes = _chunk_sizes(n, k)
    identity = list(range(n))
    before = _loads(seqlens, identity, sizes)
    if n and n % k == 0:
        parts = karmarkar_karp(seqlens, k, equal_size=True)
    else:
        parts = _capacity_lpt(seqlens, sizes)
    order = [i for p in parts for i in p]
    after = _loads(seqlens, order, sizes)
    if (imbalance(after), max(after, default=0)) > (imbalance(before), max(before, default=0)):
        order, after = identity, before
    metrics = {
        "balance/imbalance_before": float(imbalance(before)),
        "balance/imbalance_after": float(imbalance(after)),
        "balance/max_tokens_before": float(max(before, default=0)),
        "balance/max_tokens_after": float(max(after, default=0)),
    }
    return torch.tensor(order, dtype=torch.long), metrics


def _lpt(seqlens: Sequence[int], m: int) -> list[list[int]]:
    """Longest-processing-time greedy: each item (longest first) to the lightest of ``m`` parts.

    O(n log n + n log m); max load <= 4/3 of optimal (Graham, 1969).
    """
    heap = [(0, j) for j in range(m)]
    parts: list[list[int]] = [[] for _ in range(m)]
    for i in sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i)):
        load, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (load + int(seqlens[i]), j))
    return sorted((sorted(p) for p in parts), key=lambda p: (not p, p[0] if p else 0))


_KK_MAX_PARTS = 16  # free-size KK keeps m sets per item: O(n m log m); beyond this LPT is used


def partition_by_token_budget(seqlens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group items into micro-batches whose token sums stay within ``max_tokens``.

    Starts from ``m = ceil(sum / max_tokens)`` parts, balances them (free-size Karmarkar-Karp
    when ``m <= 16``, also longest-first greedy; the better one that fits wins) and adds a part
    until no part exceeds the budget, except a part holding one sequence that is itself longer
    than the budget. Empty parts are dropped. Returns index lists (each sorted), ordered by
    their smallest index; every index appears exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"partition_by_token_budget: max_tokens={max_tokens} must be >= 1")
    n = len(seqlens)
    if n == 0:
        return []

    def part_max(parts: list[list[int]]) -> int:
        return max(sum(int(seqlens[i]) for i in p) for p in parts)

    def fits(parts: list[list[int]]) -> bool:
        return all(len(p) == 1 or sum(int(seqlens[i]) for i in p) <= max_tokens for p in parts)

    m = min(n, max(1, math.ceil(sum(int(s) for s in seqlens) / max_tokens)))
    while True:
        candidates = [[p for p in _lpt(seqlens, m) if p]]
        if m <= _KK_MAX_PARTS:
            candidates.append([p for p in karmarkar_karp(seqlens, m, equal_size=False) if p])
        ok = [c for c in candidates if fits(c)]
        if ok or m >= n:
            return min(ok or candidates, key=part_max)
        m += 1
