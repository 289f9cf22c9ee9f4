"""Runnable demos built from the library, outside its layers (they may import ``postrl.testing``).

- :mod:`postrl.recipes.quickstart`: ``make quickstart`` — a tiny model learns addition with GRPO
  on a laptop CPU (``python -m postrl.recipes.quickstart --run-dir DIR``).
"""
