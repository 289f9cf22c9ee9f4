"""On-policy distillation math (postrl/algos/distill.py): hand-derived values, loop oracles,
and the top-k generalised JSD equal to the dense one at k = V."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.algos.distill import (
    DISTILL_LOSSES,
    distill_metrics,
    generalized_jsd,
    generalized_jsd_topk,
    register_distill_loss,
    reverse_kl_advantages,
    reverse_kl_per_token,
    teacher_topk_mass,
)
from postrl.registry import RegistryError


def test_reverse_kl_advantages_by_hand():
    # s = log π_student, q = log π_teacher of the sampled tokens; third token masked.
    s = torch.tensor([[-1.0, -2.0, -0.3]])
    q = torch.tensor([[-1.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    task = torch.tensor([[0.5, 0.5, 0.5]])
    # k = s - q = [0.5, -1.5, (masked) 0]
    # A = w·A_task - c·k with w = 1, c = 2: [0.5 - 1.0, 0.5 + 3.0, 0] = [-0.5, 3.5, 0]
    adv = reverse_kl_advantages(s, q, mask, task, coef=2.0, task_weight=1.0)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 3.5, 0.0]]))
    # pure distillation (w = 0, c = 1): A = -k = [-0.5, 1.5, 0]
    adv0 = reverse_kl_advantages(s, q, mask, task, coef=1.0, task_weight=0.0)
    torch.testing.assert_close(adv0, torch.tensor([[-0.5, 1.5, 0.0]]))
    # metrics over the two valid tokens: mean k = (0.5 - 1.5) / 2 = -0.5, mean q = -1.0
    m = distill_metrics(s, q, mask)
    assert float(m["distill/reverse_kl"]) == pytest.approx(-0.5)
    assert float(m["distill/teacher_logprob"]) == pytest.approx(-1.0)


def test_reverse_kl_mean_baseline_by_hand():
    s = torch.tensor([[-1.0, -2.0, -0.3], [-0.2, -4.0, -1.0]])
    q = torch.tensor([[-1.5, -0.5, -9.0], [-0.2, -1.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    task = torch.zeros(2, 3)
    # k on valid tokens: [0.5, -1.5, -], [0.0, -3.0, 6.0]; their mean k̄ = 2.0 / 5 = 0.4
    # A = -(k - k̄): [-0.1, 1.9, 0 (masked)], [0.4, 3.4, -5.6]
    adv = reverse_kl_advantages(s, q, mask, task, coef=1.0, task_weight=0.0, baseline="mean")
    torch.testing.assert_close(adv, torch.tensor([[-0.1, 1.9, 0.0], [0.4, 3.4, -5.6]]))
    assert float(adv[mask.bool()].sum()) == pytest.approx(0.0, abs=1e-6)  # centred
    # the same as the plain estimator shifted by c·k̄ on every valid token
    plain = reverse_kl_advantages(s, q, mask, task, coef=2.0, task_weight=0.0)
    base = reverse_kl_advantages(s, q, mask, task, coef=2.0, task_weight=0.0, baseline="mean")
    torch.testing.assert_close(base - plain, 2.0 * 0.4 * mask.float())
    with pytest.raises(ValueError, match="baseline='median'"):
        reverse_kl_advantages(s, q, mask, task, baseline="median")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reverse_kl_advantages_match_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 7
    s, q = -torch.rand(b, t, generator=g) * 3, -torch.rand(b, t, generator=g) * 3
    task = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    c, w = 0.7, 0.25
    got = reverse_kl_advantages(s, q, mask, task, coef=c, task_weight=w)
    want = torch.zeros(b, t)
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                want[i, j] = w * task[i, j] - c * (s[i, j] - q[i, j])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(reverse_kl_per_token(s, q, mask), (s - q) * mask)


def test_reverse_kl_of_identical_policies_is_zero():
    lp = -torch.rand(3, 4)
    mask = torch.ones(3, 4)
    assert float(distill_metrics(lp, lp, mask)["distill/reverse_kl"]) == 0.0


def _log(p):
    return torch.tensor(p, dtype=torch.float64).log()


def test_generalized_jsd_by_hand():
    p, q = _log([0.5, 0.5]), _log([0.9, 0.1])  # teacher P, student Q
    # β = 0.5: M = 0.5 P + 0.5 Q = [0.7, 0.3]
    # KL(P‖M) = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.5(-0.336472) + 0.5(0.510826) = 0.087177
    # KL(Q‖M) = 0.9 ln(0.9/0.7) + 0.1 ln(0.1/0.3) = 0.9(0.251314) + 0.1(-1.098612) = 0.116321
    # JSD = 0.5·0.087177 + 0.5·0.116321 = 0.101749
    assert float(generalized_jsd(p, q, beta=0.5)) == pytest.approx(0.101749, abs=1e-6)
    # β = 0: forward KL(P‖Q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = -0.293893 + 0.804719
    assert float(generalized_jsd(p, q, beta=0.0)) == pytest.approx(0.510826, abs=1e-6)
    # β = 1: reverse KL(Q‖P) = 0.9 ln(1.8) + 0.1 ln(0.2) = 0.529008 - 0.160944
    assert float(generalized_jsd(p, q, beta=1.0)) == pytest.approx(0.368064, abs=1e-6)
    # β = 0.2: M = 0.2 P + 0.8 Q = [0.82, 0.18]
    # KL(P‖M) = 0.5 ln(0.5/0.82) + 0.5 ln(0.5/0.18) = -0.247346 + 0.510826 = 0.263480
    # KL(Q‖M) = 0.9 ln(0.9/0.82) + 0.1 ln(0.1/0.18) = 0.083782 - 0.058779 = 0.025003
    # JSD = 0.2·0.263480 + 0.8·0.025003 = 0.052696 + 0.020002 = 0.072698
    assert float(generalized_jsd(p, q, beta=0.2)) == pytest.approx(0.072698, abs=1e-6)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(p, q, beta=1.5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_matches_a_loop(beta):
    g = torch.Generator().manual_seed(7)
    lp = torch.log_softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), -1)
    got = generalized_jsd(lp, lq, beta=beta)
    for r in range(4):
        p, q = lp[r].exp().tolist(), lq[r].exp().tolist()
        if beta == 0.0:
            want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
        elif beta == 1.0:
            want = sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
        else:
            m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q)]
            kl_pm = sum(pi * math.log(pi / mi) for pi, mi in zip(p, m))
            kl_qm = sum(qi * math.log(qi / mi) for qi, mi in zip(q, m))
            want = beta * kl_pm + (1 - beta) * kl_qm
        assert float(got[r]) == pytest.approx(want, rel=1e-6, abs=1e-7)  # fp32 math


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_topk_equals_dense_at_k_equal_vocab(beta):
    g = torch.Generator().manual_seed(3)
    b, t, v = 3, 5, 11
    teacher = torch.log_softmax(torch.randn(b, t, v, generator=g), -1)  # (B, T, V)
    student = torch.log_softmax(torch.randn(b, t, v, generator=g), -1)  # (B, T, V)
    mask = torch.ones(b, t)
    mask[0, -1] = 0
    top_lp, top_id = teacher.topk(v, dim=-1)  # (B, T, K=V): every token, sorted
    s_at = student.gather(-1, top_id)  # (B, T, K) the student's log-probs at those ids
    got = generalized_jsd_topk(s_at, top_lp, mask, beta=beta)
    dense = generalized_jsd(teacher, student, beta=beta) * mask
    # fp32, two summation orders (sorted top-k vs the vocabulary's): 7.3e-6 apart (2e-5
    # relative) at one position on an AVX-512 Xeon, below 1e-6 on an AVX2 EPYC
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)
    assert got[0, -1] == 0.0


def test_generalized_jsd_topk_puts_the_rest_in_one_tail_bucket():
    # teacher P = [0.5, 0.3, 0.1, 0.1]; k = 2 keeps ids 0, 1 → P' = [0.5, 0.3, tail 0.2]
    # student Q = [0.2, 0.2, 0.5, 0.1]; at ids 0, 1 → Q' = [0.2, 0.2, tail 0.6]
    # β = 0: KL(P'‖Q') = 0.5 ln(0.5/0.2) + 0.3 ln(0.3/0.2) + 0.2 ln(0.2/0.6)
    #                  = 0.5·0.916291 + 0.3·0.405465 − 0.2·1.098612
    #                  = 0.458145 + 0.121640 − 0.219722 = 0.360062
    # dense KL(P‖Q) = 0.458145 + 0.121640 + 0.1 ln(0.1/0.5) + 0.1 ln(0.1/0.1) = 0.418841
    teacher = _log([0.5, 0.3, 0.1, 0.1]).view(1, 1, 4)
    student = _log([0.2, 0.2, 0.5, 0.1]).view(1, 1, 4)
    top_lp, top_id = teacher.topk(2, dim=-1)
    got = generalized_jsd_topk(student.gather(-1, top_id), top_lp, torch.ones(1, 1), beta=0.0)
    assert float(got) == pytest.approx(0.360062, abs=1e-6)
    assert float(generalized_jsd(teacher, student, beta=0.0)) == pytest.approx(0.418841, abs=1e-6)
    mass = teacher_topk_mass(top_lp, torch.ones(1, 1))
    assert float(mass) == pytest.approx(0.8, abs=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_generalized_jsd_topk_is_a_lower_bound_of_the_dense_one(beta, k):
    # a divergence of a coarse-graining (top-k + tail) never exceeds the dense divergence
    g = torch.Generator().manual_seed(11 + k)
    teacher = torch.log_softmax(torch.randn(4, 6, 13, generator=g) * 2, -1)
    student = torch.log_softmax(torch.randn(4, 6, 13, generator=g) * 2, -1)
    top_lp, top_id = teacher.topk(k, dim=-1)
    got = generalized_jsd_topk(student.gather(-1, top_id), top_lp, torch.ones(4, 6), beta=beta)
    dense = generalized_jsd(teacher, student, beta=beta)
    assert bool((got <= dense + 1e-5).all()) and bool((got >= -1e-6).all())


def test_generalized_jsd_topk_moves_the_students_outside_mass_onto_the_top_k():
    # student puts most mass outside the teacher's top-2; renormalising over the top-2 alone
    # would see student = teacher there (both uniform) and give no gradient — the tail does.
    logits = torch.tensor([[[0.0, 0.0, 3.0, 3.0]]], requires_grad=True)
    teacher = _log([0.45, 0.45, 0.05, 0.05]).float().view(1, 1, 4)
    top_lp, top_id = teacher.topk(2, dim=-1)
    s_at = torch.log_softmax(logits, -1).gather(-1, top_id)
    generalized_jsd_topk(s_at, top_lp, torch.ones(1, 1), beta=0.5).sum().backward()
    g = logits.grad[0, 0]
    assert float(g[0]) < 0 and float(g[1]) < 0  # descent raises the top-k tokens' logits
    assert float(g[2]) > 0 and float(g[3]) > 0


def test_generalized_jsd_topk_gradient_reaches_the_student_only():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(2, 3, 8, generator=g), -1)
    top_lp, top_id = teacher.topk(4, dim=-1)
    s_at = torch.log_softmax(logits, -1).gather(-1, top_id)
    generalized_jsd_topk(s_at, top_lp, torch.ones(2, 3), beta=0.5).sum().backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_distill_registry_declares_kind_and_needs():
    assert DISTILL_LOSSES.meta("reverse_kl")["kind"] == "advantage"
    assert DISTILL_LOSSES.meta("reverse_kl")["needs"] == ("old_log_probs", "teacher_log_prob")
    assert DISTILL_LOSSES.meta("gkd")["kind"] == "loss"
    with pytest.raises(RegistryError, match="did you mean 'reverse_kl'"):
        DISTILL_LOSSES.get("reverse_kll")
    with pytest.raises(ValueError, match="kind"):
        register_distill_loss("x", kind="reward")
