"""Karmarkar-Karp balancing: partitions, permutations, token budgets (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.protocol import DataProto
from postrl.protocol.balance import (
    balanced_permutation,
    imbalance,
    karmarkar_karp,
    partition_by_token_budget,
)

lengths = st.lists(st.integers(min_value=0, max_value=2000), min_size=1, max_size=64)


def _naive_loads(seqlens, k):
    c = -(-len(seqlens) // k)
    return [sum(seqlens[j * c : (j + 1) * c]) for j in range(k)]


@settings(max_examples=150, deadline=None)
@given(lengths, st.integers(1, 8))
def test_kk_equal_size_parts(seqlens, k):
    seqlens = seqlens[: len(seqlens) - len(seqlens) % k] or [1] * k
    parts = karmarkar_karp(seqlens, k, equal_size=True)
    assert len(parts) == k
    assert {len(p) for p in parts} == {len(seqlens) // k}
    assert sorted(i for p in parts for i in p) == list(range(len(seqlens)))


@settings(max_examples=150, deadline=None)
@given(lengths, st.integers(1, 8))
def test_balanced_permutation_valid_and_never_worse(seqlens, k):
    perm, m = balanced_permutation(seqlens, k)
    assert perm.dtype == torch.long and sorted(perm.tolist()) == list(range(len(seqlens)))
    before = _naive_loads(seqlens, k)
    reordered = [seqlens[i] for i in perm.tolist()]
    after = _naive_loads(reordered, k)
    assert imbalance(after) <= imbalance(before)
    assert m["balance/imbalance_before"] == pytest.approx(imbalance(before))
    assert m["balance/imbalance_after"] == pytest.approx(imbalance(after))
    assert m["balance/max_tokens_after"] == max(after)


@settings(max_examples=150, deadline=None)
@given(lengths, st.integers(1, 3000))
def test_token_budget_partition(seqlens, budget):
    parts = partition_by_token_budget(seqlens, budget)
    assert sorted(i for p in parts for i in p) == list(range(len(seqlens)))
    assert all(p for p in parts)
    for p in parts:
        assert len(p) == 1 or sum(seqlens[i] for i in p) <= budget
    if max(seqlens) <= budget:  # every part fits, so at least ceil(sum / budget) parts
        assert len(parts) >= -(-sum(seqlens) // budget)


def test_kk_hand_example():
    # lengths 8,7,6,5,4,3,2,1 into 2 equal-size parts: total 36 -> 18/18 is reachable
    # (8+5+4+1 = 18, 7+6+3+2 = 18) and KK finds it.
    parts = karmarkar_karp([8, 7, 6, 5, 4, 3, 2, 1], 2)
    sums = sorted(sum([8, 7, 6, 5, 4, 3, 2, 1][i] for i in p) for p in parts)
    assert sums == [18, 18] and all(len(p) == 4 for p in parts)


def test_sorted_batch_gets_balanced():
    # a length-sorted batch is the worst case of a naive split
    seqlens = list(range(1, 65))
    perm, m = balanced_permutation(seqlens, 4)
    assert m["balance/imbalance_before"] > 3.0
    assert m["balance/imbalance_after"] == pytest.approx(1.0)


def test_reorder_then_chunk_matches_metrics():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 50, (12,), generator=g)
    mask = (torch.arange(50)[None, :] < lens[:, None]).long()  # (12, 50)
    data = DataProto.from_dict({"attention_mask": mask})
    perm, m = balanced_permutation(lens.tolist(), 3)
    loads = [int(c.batch["attention_mask"].sum()) for c in data.reorder(perm).chunk(3)]
    assert max(loads) == m["balance/max_tokens_after"]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="pad_to_divisor"):
        karmarkar_karp([1, 2, 3], 2)
    with pytest.raises(ValueError, match="max_tokens"):
        partition_by_token_budget([1], 0)
