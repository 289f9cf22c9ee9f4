"""agg_loss: hand values, split invariance (hypothesis) for every mode, missing denominators."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.algos import AGG_MODES, agg_loss, local_denominators

# Two sequences, T = 3.  Row 0: losses [1, 2, 3], mask [1, 1, 0] -> token sum 3, n = 2.
#                        Row 1: losses [4, 5, 6], mask [1, 1, 1] -> token sum 15, n = 3.
L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (3 + 15) / 5),  # 18 / 5 valid tokens = 3.6
        ("token-sum", 18.0),
        ("seq-mean-token-sum", (3 + 15) / 2),  # 9
        ("seq-mean-token-mean", (3 / 2 + 15 / 3) / 2),  # (1.5 + 5) / 2 = 3.25
        ("seq-mean-token-sum-norm", (3 + 15) / (2 * 3)),  # C = T = 3 -> 3
    ],
)
def test_hand_values(mode, expected):
    assert agg_loss(L, M, mode).item() == pytest.approx(expected, abs=1e-6)


def test_norm_length_and_global_denominators():
    # C = 10: 18 / (2 * 10) = 0.9 ; with global_num_seqs = 4: 18 / 40 = 0.45
    assert agg_loss(L, M, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(0.9)
    v = agg_loss(L, M, "seq-mean-token-sum-norm", norm_length=10, global_num_seqs=4)
    assert v.item() == pytest.approx(0.45)
    # token-mean with global 9 tokens: 18 / 9 = 2
    assert agg_loss(L, M, "token-mean", global_num_tokens=torch.tensor(9)).item() == pytest.approx(
        2.0
    )


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_raises_without_denominators_when_dp(mode):
    with pytest.raises(ValueError, match="global_num"):
        agg_loss(L, M, mode, dp_size=2)


def test_token_sum_needs_no_denominator():
    assert agg_loss(L, M, "token-sum", dp_size=4).item() == pytest.approx(18.0)


def test_all_masked_is_zero_not_nan():
    z = torch.zeros_like(M)
    for mode in AGG_MODES.names():
        v = agg_loss(L * float("nan"), z, mode)
        assert torch.isfinite(v) and v.item() == 0.0, mode


def test_masked_nan_does_not_leak():
    x = L.clone()
    x[0, 2] = float("nan")  # masked position
    for mode in AGG_MODES.names():
        assert agg_loss(x, M, mode).item() == pytest.approx(agg_loss(L, M, mode).item()), mode


@st.composite
def batches(draw):
    b = draw(st.integers(1, 9))
    t = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 10_000))
    k = draw(st.integers(1, b))
    cuts = (
        sorted(
            draw(
                st.lists(st.integers(1, max(b - 1, 1)), min_size=k - 1, max_size=k - 1, unique=True)
            )
        )
        if b > 1
        else []
    )
    return b, t, seed, cuts


@settings(max_examples=60, deadline=None)
@given(
    batches(),
    st.sampled_from(
        [
            "token-mean",
            "token-sum",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ]
    ),
)
def test_split_invariance(batch, mode):
    """Sum over shards (each given the global denominators) == whole batch, dp_size = #shards."""
    b, t, seed, cuts = batch
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.6).long()  # includes empty rows
    whole = agg_loss(loss, mask, mode, norm_length=t)
    bounds = [0, *cuts, b]
    shards = [(loss[s:e], mask[s:e]) for s, e in zip(bounds[:-1], bounds[1:])]
    den = {
        k: sum(local_denominators(m)[k] for _, m in shards)
        for k in ("global_num_tokens", "global_num_seqs")
    }
    total = sum(
        agg_loss(lm, mm, mode, dp_size=len(shards), norm_length=t, **den) for lm, mm in shards
    )
    assert torch.allclose(torch.as_tensor(total, dtype=torch.float64), whole, atol=1e-10)
