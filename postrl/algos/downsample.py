"""Rollout down-sampling: generate ``n`` responses per prompt, train on ``m < n`` of them.

PODS (Xu et al. 2025, "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM Reinforcement
Learning", arXiv 2504.13818): generation is cheap and parallel, the update is not, so sample a
large group and update on the subset that carries the most signal. Their max-variance rule picks
the ``m`` responses whose rewards have the largest variance; for any reward values the optimum
is the ``k`` highest and the ``m − k`` lowest rewards of the group for some ``k`` (their
Lemma 3.1), so it is found by trying the ``m + 1`` splits of the sorted group.

Every function is tensor-in / tensor-out on (G, n) score matrices (one row per group).
"""

from __future__ import annotations

import torch

__all__ = ["DOWNSAMPLE_RULES", "max_variance_subset", "random_subset", "downsample_groups"]


def max_variance_subset(scores: torch.Tensor, m: int) -> torch.Tensor:
    """Column indices of the max-variance ``m``-subset of each row.

    Args:
        scores: (G, n) rewards, one group per row (``n >= m``).
        m: responses kept per group, ``1 <= m <= n``.

    Returns:
        (G, m) long indices into the rows of ``scores``: the ``m − k*`` lowest then the ``k*``
        highest rewards, ``k*`` maximising the subset's variance
        ``E[x²] − E[x]²`` (ties: the smallest ``k``). A row whose rewards are all equal keeps
        its first ``m`` columns (the stable sort leaves equal rewards in column order).
    """
    g, n = scores.shape
    if not 1 <= m <= n:
        raise ValueError(f"max_variance_subset: m={m} must be in [1, n={n}]")
    s, order = torch.sort(scores.to(torch.float64), dim=1, stable=True)
    zero = s.new_zeros(g, 1)
    low = torch.cat([zero, s.cumsum(1)], 1)  # low[:, j]  = sum of the j lowest
    low2 = torch.cat([zero, (s * s).cumsum(1)], 1)
    high = torch.cat([zero, s.flip(1).cumsum(1)], 1)  # high[:, k] = sum of the k highest
    high2 = torch.cat([zero, (s * s).flip(1).cumsum(1)], 1)
    k = torch.arange(m + 1, device=s.device)
    total = high[:, k] + low[:, m - k]  # (G, m+1): k highest + (m − k) lowest
    total2 = high2[:, k] + low2[:, m - k]
    var = total2 / m - (total / m) ** 2
    best = var.argmax(1, keepdim=True)  # (G, 1)
    j = torch.arange(m, device=s.device).expand(g, m)
    pos = torch.where(j < m - best, j, n - m + j)  # bottom m−k, then the top k
    return order.gather(1, pos)


def random_subset(scores: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
    """``m`` uniformly random columns per row (PODS's control arm), sorted ascending."""
    g, n = scores.shape
    if not 1 <= m <= n:
        raise ValueError(f"random_subset: m={m} must be in [1, n={n}]")
    keys = torch.rand(g, n, generator=generator)
    return keys.argsort(1)[:, :m].sort(1).values


DOWNSAMPLE_RULES = ("max_variance", "random")


def downsample_groups(
    scores: torch.Tensor,
    inv: torch.Tensor,
    num_groups: int,
    m: int,
    rule: str = "max_variance",
    valid: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Rows to keep from a flat batch of equal-size groups.

    Args:
        scores: (B,) sequence rewards.
        inv: (B,) dense group ids in ``0..num_groups-1`` (``algos.utils.group_ids``); every group
            has the same size ``n = B / num_groups``.
        num_groups: G.
        m: rows kept per group.
        rule: ``max_variance`` (PODS) or ``random``.
        valid: optional (B,) bool, False for a failed reward: such a row is given its group's
            mean valid reward, so ``max_variance`` (which takes the extremes) picks it last.
        generator: RNG of ``random``.

    Returns:
        (G·m,) long row indices, group by group in ascending group id, ascending within a group.
    """
    b = scores.numel()
    if num_groups <= 0 or b % num_groups:
        raise ValueError(f"downsample_groups: {b} rows do not split into {num_groups} equal groups")
    n = b // num_groups
    counts = torch.bincount(inv, minlength=num_groups)
    if bool((counts != n).any()):
        raise ValueError(
            f"downsample_groups: group sizes {sorted(set(counts.tolist()))} are not all {n}"
        )
    rows = torch.argsort(inv, stable=True).reshape(num_groups, n)  # (G, n) batch row ids
    s = scores.reshape(-1).to(torch.float64)[rows]
    if valid is not None:
        ok = valid.reshape(-1)[rows]
        fill = (torch.where(ok, s, 0).sum(1) / ok.sum(1).clamp(min=1)).unsqueeze(1)
        s = torch.where(ok, s, fill)
    if rule == "max_variance":
        cols = max_variance_subset(s, m)
    elif rule == "random":
        if generator is None:
            raise ValueError("downsample_groups: rule='random' needs a generator")
        cols = random_subset(s, m, generator)
    else:
        raise ValueError(f"downsample rule {rule!r}: expected one of {DOWNSAMPLE_RULES}")
    return rows.gather(1, cols).sort(1).values.reshape(-1)
