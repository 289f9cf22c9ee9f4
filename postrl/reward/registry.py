"""Reward functions registered by ``data_source`` (verl's ``default_compute_score``, as a registry).

Every entry follows verl's signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)
        -> float | dict        # a dict must hold "score"; other keys are per-sample metrics

or, for entries registered with ``batch=True``::

    compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list

Entry metadata read by :class:`postrl.reward.loop.RewardLoop` (callers never special-case names):

* ``batch`` (bool): the function scores a whole list at once.
* ``inline`` (bool): the function is trusted and fast, so it runs in the caller's process
  (exceptions/NaN still isolated, but it cannot be killed on timeout). ``inline=False`` runs it
  in a killable worker process. Built-in rule scorers are inline, except ``math`` which calls
  sympy through ``math_verify`` and can hang on adversarial input. User registrations default to
  ``inline=False``.

Built-ins are registered lazily (by import path) so ``import postrl.reward`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from postrl.registry import Registry

__all__ = [
    "REWARD_FNS",
    "VERL_DATA_SOURCES",
    "register_reward_fn",
    "get_reward_fn",
    "default_compute_score",
]

#: data_source -> reward function (verl signature). See module docstring for metadata.
REWARD_FNS: Registry[Callable[..., Any]] = Registry("reward function (data_source)")


def register_reward_fn(
    data_source: str, *, batch: bool = False, inline: bool = False, override: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering a reward function for ``data_source``.

    Args:
        data_source: the ``data_source`` column value the function scores.
        batch: the function takes lists (``data_sources, solution_strs, ground_truths,
            extra_infos``) and returns a list of the same length.
        inline: run in the caller's process (only for trusted, fast, non-hanging code). The
            default runs it in a killable worker process, so it must be importable by reference
            (a module-level function, not a lambda or closure).
        override: replace an existing entry instead of raising.

    Example::

        @register_reward_fn("my_task")
        def my_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str.strip() == ground_truth)
    """
    return REWARD_FNS.register(data_source, override=override, batch=batch, inline=inline)


def get_reward_fn(data_source: str) -> Callable[..., Any]:
    """Return the function registered for ``data_source`` (unknown names list the choices)."""
    return REWARD_FNS.get(data_source)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Dispatch one sample to the per-sample function registered for ``data_source``."""
    if REWARD_FNS.meta(data_source).get("batch", False):
        raise TypeError(
            f"reward function for {data_source!r} is batch-level; call it with lists or "
            f"score through RewardLoop"
        )
    return get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info, **kwargs)


#: verl data_source -> the rule module that reproduces verl's scoring for it (verl's
#: ``default_compute_score``). verl matches every name starting with ``aime``; the registry
#: holds exact names, so the common AIME spellings are listed. postrl's own ``gsm8k`` (lenient)
#: and ``math`` (math-verify) stay as they were; verl scores ``math`` with the DAPO rule, which
#: is ``math_dapo`` here.
VERL_DATA_SOURCES = {
    "openai/gsm8k": "verl_gsm8k",
    "lighteval/MATH": "hendrycks_math",
    "DigitalLearningGmbH/MATH-lighteval": "hendrycks_math",
    "HuggingFaceH4/MATH-500": "hendrycks_math",
    "math_dapo": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    **{f"aime{y}": "math_dapo" for y in ("", "24", "25", "2024", "2025", "_2024", "_2025")},
}


def _register_builtins() -> None:
    rules = "postrl.reward.rules"
    REWARD_FNS.add_lazy("addition", f"{rules}.addition:compute_score", batch=False, inline=True)
    REWARD_FNS.add_lazy("countdown", f"{rules}.countdown:compute_score", batch=False, inline=True)
    REWARD_FNS.add_lazy("gsm8k", f"{rules}.gsm8k:compute_score", batch=False, inline=True)
    REWARD_FNS.add_lazy("math", f"{rules}.math_answer:compute_score", batch=False, inline=False)
    # verl's data sources, scored by the rule verl's default_compute_score picks for each
    for name, rule in VERL_DATA_SOURCES.items():
        REWARD_FNS.add_lazy(name, f"{rules}.{rule}:compute_score", batch=False, inline=True)
    # agentic tasks (their modules register eagerly on import; these lazy entries make them
    # available without that import)
    REWARD_FNS.add_lazy(
        "tool_arith", "postrl.data.tool_arith:compute_tool_arith_score", batch=False, inline=True
    )
    REWARD_FNS.add_lazy("code", "postrl.data.code_tasks:code_reward", batch=False, inline=False)


_register_builtins()
