"""Optional reward shaping applied by the trainer on top of a task score.

Overlong-response shaping (DAPO) lives in :mod:`postrl.algos`; only format shaping is here.
"""

from __future__ import annotations

import re

__all__ = ["format_reward"]


def format_reward(solution_str: str, pattern: str | re.Pattern[str], bonus: float = 0.1) -> float:
    """``bonus`` if ``pattern`` matches ``solution_str`` (``re.search``, DOTALL), else 0.0.

    Example: ``format_reward(text, r"<think>.*</think>\\s*<answer>.*</answer>")``.
    """
    rx = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.DOTALL)
    return float(bonus) if rx.search(solution_str) else 0.0
