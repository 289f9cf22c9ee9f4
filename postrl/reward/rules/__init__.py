"""Built-in rule-based reward functions (registered lazily in :mod:`postrl.reward.registry`).

Each module exposes ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
returning ``{"score": float, "acc": float}`` (``acc`` is 1.0 only for a correct answer, so it
stays a clean accuracy even when a format bonus is configured).
"""
