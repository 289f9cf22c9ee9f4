"""PODS rollout down-sampling: the max-variance subset equals brute force over every subset."""

from __future__ import annotations

import itertools

import pytest
import torch

from postrl.algos.downsample import downsample_groups, max_variance_subset, random_subset


def _var(x: torch.Tensor) -> float:
    return float((x * x).mean() - x.mean() ** 2)


@pytest.mark.parametrize("n,m", [(6, 3), (7, 2), (8, 5), (5, 5), (4, 1)])
def test_max_variance_matches_brute_force(n, m):
    g = torch.Generator().manual_seed(n * 10 + m)
    scores = torch.cat(
        [
            torch.rand(20, n, generator=g, dtype=torch.float64),  # continuous rewards
            torch.randint(0, 2, (20, n), generator=g).double(),  # binary rewards
        ]
    )
    idx = max_variance_subset(scores, m)
    assert idx.shape == (40, m)
    for row, cols in zip(scores, idx):
        assert len(set(cols.tolist())) == m
        best = max(_var(row[list(c)]) for c in itertools.combinations(range(n), m))
        assert _var(row[cols]) == pytest.approx(best, abs=1e-12)


def test_binary_group_keeps_a_balanced_subset():
    # 2 correct of 16: the best 4-subset holds both correct answers and two wrong ones
    s = torch.zeros(1, 16, dtype=torch.float64)
    s[0, [3, 11]] = 1.0
    cols = max_variance_subset(s, 4)[0].tolist()
    assert {3, 11} <= set(cols) and len(set(cols)) == 4


def test_equal_rewards_keep_the_first_columns():
    assert max_variance_subset(torch.ones(2, 5), 3).tolist() == [[0, 1, 2], [0, 1, 2]]


def test_random_subset_is_seeded_distinct_and_sorted():
    s = torch.zeros(3, 8)
    a = random_subset(s, 4, torch.Generator().manual_seed(1))
    b = random_subset(s, 4, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert all(len(set(r.tolist())) == 4 and r.tolist() == sorted(r.tolist()) for r in a)


def test_downsample_groups_on_an_interleaved_batch():
    # two groups of 4, rows interleaved; failed rewards are taken last
    inv = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    scores = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 5.0, 0.0, 1.0])
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    rows = downsample_groups(scores, inv, 2, 2, valid=valid)
    # group 0 (rows 0,2,4,6): one 1 and one 0 -> rows 0 and 2; group 1 (rows 1,3,5,7): the
    # failed row 5 gets the group's mean and is not an extreme
    assert rows.tolist()[:2] == [0, 2]
    assert 5 not in rows.tolist() and len(rows) == 4
    assert set(rows.tolist()[2:]) <= {1, 3, 7} and 3 in rows.tolist()


def test_bad_shapes_and_rules_are_named():
    with pytest.raises(ValueError, match="m=5 must be in"):
        max_variance_subset(torch.zeros(1, 4), 5)
    with pytest.raises(ValueError, match="not all 2"):
        downsample_groups(torch.zeros(4), torch.tensor([0, 0, 0, 1]), 2, 1)
    with pytest.raises(ValueError, match="expected one of"):
        downsample_groups(torch.zeros(4), torch.tensor([0, 0, 1, 1]), 2, 1, rule="top")
    with pytest.raises(ValueError, match="needs a generator"):
        downsample_groups(torch.zeros(4), torch.tensor([0, 0, 1, 1]), 2, 1, rule="random")
