"""Typed options of the supervised programs ``postrl sft`` and ``postrl rm``.

Loaded like the RL config (:func:`postrl.config.loader.load_options`: YAML plus ``key=value``
overrides, unknown keys with a did-you-mean, every error at once) and documented in
``docs/config.md`` from the docstrings below (:mod:`postrl.config.docs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from postrl.engine.specs import ModelSpec, OptimSpec

__all__ = ["RMConfig", "SFTConfig", "TrainFileOptions"]


@dataclass
class TrainFileOptions:
    """Options shared by ``postrl sft`` and ``postrl rm`` (supervised runs over one data file)."""

    model_path: str = ""
    """HF model directory to start from (required)."""
    train_file: str = ""
    """Parquet or jsonl rows (required)."""
    out_dir: str = ""
    """Where the trained HF model (and a metrics JSON) is written (required)."""
    epochs: int = 1
    """Passes over the data."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = run all epochs)."""
    lr: float = 1e-4
    """Peak AdamW learning rate (linear warmup, then cosine to 10%)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    seed: int = 0
    """Shuffling and init seed."""
    num_threads: int = 0
    """torch threads (0 = leave the default)."""
    log_every: int = 20
    """Log the loss every this many steps."""


@dataclass
class SFTConfig(TrainFileOptions):
    """Options of ``postrl sft`` (also the keyword arguments of ``run_sft``); ``train_file``
    rows hold ``messages`` or ``prompt`` + ``response``."""

    weight_decay: float = OptimSpec.weight_decay
    """AdamW weight decay."""
    batch_tokens: int = 2048
    """Tokens per optimizer step (packed)."""
    max_length: int = 512
    """Rows longer than this are truncated (and the tail's loss dropped)."""
    lora_rank: int = ModelSpec.lora_rank
    """LoRA rank (0 = full fine-tuning)."""
    target_loss: float = 0.0
    """Train on past ``max_steps`` until the mean loss of the last 10 steps is at or below
    this, at the schedule's final learning rate (0 = off): a warm-up that stops at a loss, not
    at a step count, so a seed (or a CPU's rounding) that leaves a loss plateau late still ends
    where the others do. A run that reaches it within ``max_steps`` is unchanged."""
    target_extra_steps: int = 200
    """Most steps past ``max_steps`` that ``target_loss`` may add (the metrics report
    ``sft/extra_steps``; a warning names a target still not met)."""


@dataclass
class RMConfig(TrainFileOptions):
    """Options of ``postrl rm`` (also the keyword arguments of ``run_rm``). ``model_path``: a
    causal LM (its backbone gets a new score head) or a reward model; ``train_file`` rows hold
    ``prompt``, ``chosen``, ``rejected``; ``out_dir`` receives an HF ``*ForSequenceClassification``
    model with one label."""

    batch_size: int = 32
    """Pairs per optimizer step."""
    max_length: int = 512
    """Tokens kept per rendered conversation (the last ones, as at scoring time)."""
    eval_fraction: float = 0.1
    """Share of the pairs held out for the preference accuracy."""
