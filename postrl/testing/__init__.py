"""Tiny models and helpers shipped for tests (ours and users')."""

from postrl.testing.batches import synth_batch
from postrl.testing.tiny_models import ARCHS, PRESETS, make_model, make_tokenizer

__all__ = ["ARCHS", "PRESETS", "make_model", "make_tokenizer", "synth_batch"]
