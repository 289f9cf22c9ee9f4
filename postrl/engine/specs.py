"""The engine's settings: plain frozen dataclasses that own their defaults.

The engine never sees the run's config; the role workers (:mod:`postrl.workers.common`) fill these
field by field from the config sections of the same names, and the config dataclasses
(:mod:`postrl.config.schema`) take their defaults from here, so each default is written once.
This module imports nothing (no torch): ``import postrl.config`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchSpec", "ModelSpec", "OptimSpec", "PolicyLossSpec"]


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to load a model (the ``model.*`` keys of the config)."""

    path: str = ""
    """Hugging Face model directory."""
    dtype: str = "auto"
    """Storage dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``."""
    compute_dtype: str = "auto"
    """Compute dtype: ``auto``, ``float32`` or ``bfloat16``."""
    trust_remote_code: bool = False
    """Pass ``trust_remote_code`` to ``from_pretrained``."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning)."""
    lora_alpha: int = 16
    """LoRA alpha."""
    lora_target_modules: str = "all-linear"
    """``all-linear`` or comma-separated module names."""
    kernels: str = "auto"
    """Training kernels: ``auto``, ``fused`` or ``torch`` (:mod:`postrl.engine.fused`)."""


@dataclass(frozen=True)
class OptimSpec:
    """AdamW and LR-schedule settings (the ``*.optim`` keys of the config; ``postrl sft`` /
    ``postrl rm`` fill it from their own options)."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """AdamW betas (two values)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warmup optimizer steps."""
    lr_scheduler: str = "constant"
    """``constant`` or ``cosine`` after warmup."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (<= 0: no clipping)."""


@dataclass(frozen=True)
class BatchSpec:
    """How an engine splits a batch (the ``actor.*`` / ``critic.*`` batching keys of the config)."""

    ppo_mini_batch_size: int = 16
    """Prompts per mini-batch (× ``rollout_n`` responses, split over dp ranks)."""
    ppo_micro_batch_size_per_gpu: int = 16
    """Rows per micro-batch when ``use_dynamic_bsz`` is False."""
    use_dynamic_bsz: bool = True
    """Micro-batches by token budget (Karmarkar–Karp) instead of a fixed row count."""
    ppo_max_token_len_per_gpu: int = 8192
    """Token budget per micro-batch."""
    ppo_epochs: int = 1
    """Passes over the batch per update."""
    shuffle: bool = False
    """Shuffle rows before splitting into mini-batches (seeded)."""


@dataclass(frozen=True)
class PolicyLossSpec:
    """The policy loss of an update (the ``actor.*`` loss keys of the config)."""

    policy_loss: str = "vanilla"
    """Registered policy loss (:data:`postrl.algos.POLICY_LOSSES`)."""
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Hyperparameters of the policy loss, bound at construction
    (:func:`postrl.algos.bind_policy_loss`: an unknown name raises with a did-you-mean)."""
    clip_ratio_low: float = 0.2
    """PPO clip ε below 1."""
    clip_ratio_high: float = 0.2
    """PPO clip ε above 1."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of token losses (:func:`postrl.algos.aggregation.agg_loss`)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (with ``entropy_target``: its starting weight)."""
    entropy_target: float = 0.0
    """Adaptive entropy control (:func:`postrl.algos.adapt_entropy_coeff`): after each update
    the bonus's weight moves by ``entropy_coeff_step`` towards holding the token-mean entropy at
    this many nats. 0 = off (a fixed ``entropy_coeff``)."""
    entropy_coeff_step: float = 0.001
    """How far one update moves the adaptive weight."""
    entropy_coeff_max: float = 0.05
    """Upper bound of the adaptive weight."""
    entropy_coeff_min: float = 0.0
    """Lower bound of the adaptive weight."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef · KL(π‖π_ref)`` to the loss (needs ``ref_log_prob``)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator (:func:`postrl.algos.kl.kl_penalty`)."""
    skip_zero_advantage: bool = False
    """Run only the rows with a non-zero advantage through the update's forward and backward
    (``actor.skip_zero_advantage``; the loss must declare ``zero_advantage_rows_free``)."""
    distill_loss: str = ""
    """A distillation loss of kind ``loss`` (:data:`postrl.algos.distill.DISTILL_LOSSES`, e.g.
    ``gkd``) added to the loss as ``distill_coef · agg(D_t)``, from the student's log-probs at
    the teacher's top-k ids (needs ``teacher_topk_ids`` / ``teacher_topk_log_probs``); empty =
    none."""
    distill_coef: float = 1.0
    """Weight of the distillation loss (``distill.coef``)."""
    distill_beta: float = 0.5
    """β of the generalised JSD (``distill.beta``)."""
