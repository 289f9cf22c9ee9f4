"""On-policy distillation from a teacher: the per-token reverse KL term and generalised JSD.

The student samples responses; a frozen teacher scores the same tokens. Symbols: ``B`` rows,
``T`` response tokens, ``K`` teacher top-k, ``V`` vocabulary; ``s_t = log π_student(y_t | ·)``
and ``q_t = log π_teacher(y_t | ·)`` the log-probs of the sampled token ``y_t``.

Two losses, registered in :data:`DISTILL_LOSSES` (config ``distill.loss``). Each entry declares
its facts in the registry metadata instead of the trainer testing its name:

* ``kind``: ``advantage`` (a per-token term added to the advantages before the unchanged policy
  update) or ``loss`` (a term of the update's loss, computed from the student's logits);
* ``needs``: the batch fields it reads (``postrl.trainer.needs`` rows; e.g. ``old_log_probs``
  read before the update blocks old-log-prob fusion).

``reverse_kl`` — on-policy distillation as RL with a dense reward (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD), arXiv 2306.13649,
the β = 1 / λ = 1 corner; Thinking Machines, "On-Policy Distillation", 2025). The per-token
sampled estimate of the reverse KL ``KL(π_s ‖ π_t)`` at position t is ``k_t = s_t − q_t`` (its
expectation over ``y_t ~ π_s`` is the exact per-position reverse KL). It enters as a per-token
advantage::

    A_t = w · A^task_t − c · (s_t − q_t)        (masked: 0 where response_mask is 0)

with ``w`` = ``distill.task_reward_weight`` (0: pure distillation) and ``c`` = ``distill.coef``.
The policy-gradient of ``−k_t`` with discount 0 (each token judged by its own KL only, as
Thinking Machines do) is what the PPO/GRPO loss then optimises. Deviation from GKD: GKD
differentiates the divergence through the full student distribution; here the sampled-token
estimate is a reward (no extra forward, any policy loss).

``gkd`` — generalised Jensen-Shannon divergence JSD(β) between teacher ``P`` and student ``Q``
(GKD, eq. 3; the convention of TRL's ``GKDTrainer``)::

    M = β P + (1 − β) Q
    JSD(β)(P ‖ Q) = β KL(P ‖ M) + (1 − β) KL(Q ‖ M)          for 0 < β < 1
    β = 0 → KL(P ‖ Q) (forward KL),  β = 1 → KL(Q ‖ P) (reverse KL)   (the two limits used)

computed over the teacher's **top-k** tokens plus one **tail** bucket: at each position the
vocabulary is coarse-grained into ``K + 1`` categories — the teacher's ``K`` most likely tokens
and "every other token" — and both distributions are taken on that partition::

    P' = (P_{v_1}, …, P_{v_K}, 1 − Σ_k P_{v_k})      Q' = (Q_{v_1}, …, Q_{v_K}, 1 − Σ_k Q_{v_k})

with ``Q_{v_k}`` the student's full-vocabulary probabilities at the teacher's ids (the update
gathers them from its log-softmax). Deviation from GKD (which sums over the whole vocabulary):
only the teacher's top-k ids and log-probs travel with the batch (B·T·K numbers instead of
B·T·V). Properties (tested): at ``K = V`` the tail is empty and this is exactly the dense
JSD(β); for any ``K`` it is a lower bound of the dense divergence (a divergence of a
coarse-graining, the data-processing inequality); and the student's mass outside the teacher's
top-k is in the tail, so the gradient moves it onto the teacher's tokens (renormalising over the
top-k alone would not). ``distill/teacher_topk_mass`` reports ``Σ_k P_{v_k}``, what the top-k
keeps of the teacher.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from postrl.algos.utils import masked_mean
from postrl.registry import Registry

__all__ = [
    "DISTILL_LOSSES",
    "register_distill_loss",
    "reverse_kl_per_token",
    "reverse_kl_advantages",
    "generalized_jsd",
    "generalized_jsd_topk",
    "distill_metrics",
    "teacher_topk_mass",
]

DISTILL_LOSSES: Registry[Callable[..., Any]] = Registry("distillation loss")


def register_distill_loss(name: str, *, kind: str, needs: tuple[str, ...] = (), **meta: Any):
    """Register a distillation loss (config ``distill.loss``).

    Args:
        kind: ``advantage`` — ``fn(student_log_prob, teacher_log_prob, response_mask,
            task_advantages, *, coef, task_weight) -> advantages (B, T)``; ``loss`` — a term of
            the update's loss over the student's logits (``fn(student_topk_log_probs,
            teacher_topk_log_probs, response_mask, *, beta) -> per-token loss (B, T)``).
        needs: batch fields it reads (rows of ``postrl.trainer.needs``).
    """
    if kind not in ("advantage", "loss"):
        raise ValueError(f"kind={kind!r} must be 'advantage' or 'loss'")
    return DISTILL_LOSSES.register(name, kind=kind, needs=tuple(needs), **meta)


def reverse_kl_per_token(
    student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``k_t = (log π_s(y_t) − log π_t(y_t)) · m_t`` (B, T): the sampled-token estimate of the
    per-position reverse KL ``KL(π_s ‖ π_t)``, zero on masked tokens."""
    diff = student_log_prob.float() - teacher_log_prob.float()  # (B, T)
    return torch.where(response_mask.bool(), diff, torch.zeros_like(diff))


@register_distill_loss("reverse_kl", kind="advantage", needs=("old_log_probs", "teacher_log_prob"))
def reverse_kl_advantages(
    student_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    task_advantages: torch.Tensor,
    *,
    coef: float = 1.0,
    task_weight: float = 1.0,
    baseline: str = "none",
) -> torch.Tensor:
    """``A_t = w · A^task_t − c · (k_t − b)``, ``k_t = s_t − q_t``, on valid tokens, 0 elsewhere
    (B, T).

    ``b`` is the baseline: ``none`` → 0 (the plain estimator); ``mean`` → ``k̄``, the mean of
    ``k`` over the batch's valid tokens. The expected gradient of ``−k_t`` is the same with or
    without it (``E_{y_t∼π_s}[b ∇ log π_s(y_t)] = 0`` for a ``b`` that does not depend on
    ``y_t``; the batch mean includes the token itself and the later tokens of its response,
    a bias of order 1/N for N valid tokens), but its variance is not: without it
    ``E[−k_t] = −KL ≤ 0``, so nearly every sampled token is pushed down and the mass moves to
    whatever was not sampled; centred, the tokens the teacher likes more than the student
    does are pushed up and the rest down (the baseline of REINFORCE, Williams 1992).

    Args:
        student_log_prob: (B, T) ``s_t``, the sampling policy's log-probs (π_old).
        teacher_log_prob: (B, T) ``q_t``, the teacher's log-probs of the same tokens.
        response_mask: (B, T) 1 on trained tokens.
        task_advantages: (B, T) the configured estimator's advantages of the task reward.
        coef: ``c``, weight of the distillation term (``distill.coef``).
        task_weight: ``w``, weight of the task advantages (0: pure distillation).
        baseline: ``none`` or ``mean`` (``distill.baseline``; above).
    """
    k = reverse_kl_per_token(student_log_prob, teacher_log_prob, response_mask)  # (B, T)
    if baseline == "mean":
        k = k - masked_mean(k, response_mask)  # (B, T) - () (masked tokens are zeroed below)
    elif baseline != "none":
        raise ValueError(f"baseline={baseline!r} must be 'none' or 'mean'")
    adv = task_weight * task_advantages.float() - coef * k  # (B, T)
    return torch.where(response_mask.bool(), adv, torch.zeros_like(adv))


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(P ‖ Q) = Σ_v P_v (log P_v − log Q_v)`` over the last dim (0·log 0 = 0)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def generalized_jsd(
    teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, *, beta: float = 0.5
) -> torch.Tensor:
    """JSD(β)(P ‖ Q) over the last dimension (dense; the reference of the top-k version).

    Args:
        teacher_log_probs: (..., V) normalised log-probs ``log P`` of the teacher.
        student_log_probs: (..., V) normalised log-probs ``log Q`` of the student.
        beta: β in [0, 1]; 0 = forward KL(P‖Q), 1 = reverse KL(Q‖P).

    Returns:
        (...,) the divergence at each position.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1]")
    lp, lq = teacher_log_probs.float(), student_log_probs.float()
    if beta == 0.0:
        return _kl(lp, lq)
    if beta == 1.0:
        return _kl(lq, lp)
    # log M = logsumexp(log β + log P, log(1−β) + log Q), elementwise over the two mixtures
    log_m = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log1p(-beta)]), dim=0)
    return beta * _kl(lp, log_m) + (1.0 - beta) * _kl(lq, log_m)


def _with_tail(topk_log_probs: torch.Tensor) -> torch.Tensor:
    """(..., K) normalised log-probs of K tokens → (..., K + 1) with the tail bucket
    ``log(1 − Σ_k p_k)`` appended (clamped at ``log 1e-20`` so an empty tail — K = V — keeps
    finite values and gradients)."""
    lp = topk_log_probs.float()
    kept = torch.logsumexp(lp, dim=-1, keepdim=True)  # (..., 1) log Σ_k p_k ≤ 0
    tail = (-torch.expm1(kept)).clamp_min(1e-20).log()  # (..., 1)
    return torch.cat([lp, tail], dim=-1)


@register_distill_loss(
    "gkd", kind="loss", needs=("old_log_probs", "teacher_log_prob", "teacher_topk")
)
def generalized_jsd_topk(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    beta: float = 0.5,
) -> torch.Tensor:
    """Per-token JSD(β) on the teacher's top-k tokens plus the tail bucket (module docstring).

    Args:
        student_topk_log_probs: (B, T, K) the student's full-vocabulary log-probs (log-softmax
            over V, then gathered) of the teacher's top-k token ids at each position.
        teacher_topk_log_probs: (B, T, K) the teacher's normalised log-probs of its top-k.
        response_mask: (B, T) 1 on trained tokens.
        beta: β of :func:`generalized_jsd`.

    Returns:
        (B, T) the divergence per token, 0 on masked tokens (aggregate with ``agg_loss``).
    """
    lq = _with_tail(student_topk_log_probs)  # (B, T, K + 1)
    lp = _with_tail(teacher_topk_log_probs)  # (B, T, K + 1)
    d = generalized_jsd(lp, lq, beta=beta)  # (B, T)
    return torch.where(response_mask.bool(), d, torch.zeros_like(d))


def teacher_topk_mass(
    teacher_topk_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``distill/teacher_topk_mass``: token mean of ``Σ_{k ≤ K} π_teacher(v_k | ·)``, the
    teacher's probability mass inside its top-k (1 = the top-k loses nothing), a 0-d tensor.

    Args:
        teacher_topk_log_probs: (B, T, K) the teacher's normalised log-probs of its top-k.
        response_mask: (B, T) 1 on trained tokens.
    """
    mass = teacher_topk_log_probs.float().exp().sum(-1)  # (B, T)
    return masked_mean(mass, response_mask.float()).detach()


def distill_metrics(
    student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``distill/reverse_kl`` (token mean of ``s_t − q_t``) and ``distill/teacher_logprob``
    (token mean of ``q_t``), detached 0-d tensors over valid tokens."""
    mask = response_mask.float()
    k = reverse_kl_per_token(student_log_prob, teacher_log_prob, response_mask)
    return {
        "distill/reverse_kl": masked_mean(k, mask).detach(),
        "distill/teacher_logprob": masked_mean(teacher_log_prob.float(), mask).detach(),
    }
