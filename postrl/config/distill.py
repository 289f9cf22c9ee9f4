"""Typed options of on-policy distillation (the ``distill`` section of the RL config).

A teacher scores every token the student sampled; the step computes its log-probs as one more
stage beside the reference policy's (``postrl/trainer/teacher.py``), and the configured loss
(``postrl.algos.distill.DISTILL_LOSSES``) turns them into a dense per-token signal.
"""

from __future__ import annotations

from dataclasses import dataclass

from postrl.engine.specs import PolicyLossSpec

__all__ = ["DistillConfig"]


@dataclass
class DistillConfig:
    """On-policy distillation from a frozen teacher (off when neither ``teacher_path`` nor
    ``teacher_url`` is set)."""

    teacher_path: str = ""
    """Hugging Face directory of the teacher, loaded as a frozen worker group beside the
    reference policy (same backend, dp size and strategy as the reference). Its tokenizer must
    be the student's (vocabulary and special tokens; checked at startup)."""
    teacher_url: str = ""
    """Base URL of a ``postrl serve`` server holding the teacher (e.g. ``http://host:8000``):
    its ``/v1/score`` route returns the log-probs of given response tokens after given prompt
    tokens, and ``/v1/tokenizer`` its tokenizer's fingerprint (checked at startup). Exclusive
    with ``teacher_path``."""
    api_key: str = ""
    """Bearer token for ``teacher_url`` (empty: none, or the ``POSTRL_API_KEY`` variable)."""
    timeout_s: float = 120.0
    """Deadline of one scoring request to ``teacher_url`` (a step's whole batch)."""
    loss: str = "reverse_kl"
    """Distillation loss (``postrl.algos.DISTILL_LOSSES``): ``reverse_kl`` — the per-token
    reverse KL ``log π_student − log π_teacher`` of each sampled token as a per-token advantage
    term (Agarwal et al. 2024; Thinking Machines 2025); ``gkd`` — generalised JSD(β) between
    teacher and student over the teacher's top-``topk`` tokens plus one tail bucket, a term
    ``coef · agg(JSD_t)`` of the update's loss (GKD, Agarwal et al. 2024)."""
    coef: float = PolicyLossSpec.distill_coef
    """Weight ``c`` of the distillation term: ``reverse_kl``: advantages ``w · A_task − c ·
    (log π_s − log π_t)``; ``gkd``: loss ``pg_loss(w · A_task) + c · agg(JSD_t)``."""
    task_reward_weight: float = 1.0
    """Weight ``w`` of the task reward's advantages (0 = pure distillation: the reward is still
    computed and logged, but does not train)."""
    baseline: str = "none"
    """``reverse_kl``: what is subtracted from each token's ``k_t = log π_s − log π_t`` before
    it becomes an advantage: ``none``, or ``mean`` — the batch's mean ``k`` over valid tokens
    (a REINFORCE baseline: the same expected gradient, far less variance; without it nearly
    every sampled token is pushed down, since ``E[k] = KL ≥ 0``)."""
    topk: int = 32
    """``gkd``: the teacher's most likely tokens kept per position (K); the rest of both
    distributions is one tail bucket. Exact at K = vocabulary size, a lower bound of the dense
    divergence below it; ``distill/teacher_topk_mass`` says what the teacher's top-k holds."""
    beta: float = PolicyLossSpec.distill_beta
    """``gkd``: β of JSD(β) (0 = forward KL(teacher‖student), 1 = reverse KL)."""

    @property
    def enabled(self) -> bool:
        """Whether a teacher is configured."""
        return bool(self.teacher_path or self.teacher_url)
