"""The environment protocol, its registry, returns, and dataset rows for environment episodes.

Contract (RAGEN / gym, text in and out)::

    obs = env.reset(seed)                    # deterministic from the seed
    obs, reward, done = env.step(action)     # action: the assistant's turn as text

An environment may also expose ``success`` (bool: the episode reached its goal; the loop reports
it as ``agent/env/success`` and validation as accuracy), ``instructions`` (text put before the
first observation in dataset rows) and ``solve()`` (the shortest action list from the current
state; :func:`env_demonstrations` needs it to write expert transcripts).

A dataset row for an episode (verl schema; :func:`env_rows` writes them)::

    data_source  "env/<name>"
    agent_name   "env_agent"
    prompt       [{"role": "user", "content": instructions + "\\n" + reset(seed)}]
    extra_info   {"env": name, "seed": seed, "env_kwargs": {...}, "split": ..., "index": i}

The loop resets the environment with the row's seed and checks that the prompt ends with that
first observation, so a row and its environment cannot drift apart silently.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from postrl.registry import Registry

__all__ = [
    "ENVS",
    "Env",
    "discounted_return",
    "env_demonstrations",
    "env_rows",
    "make_env",
    "register_env",
]

T = TypeVar("T")

#: name -> environment class (or factory) called as ``factory(**env_kwargs)``.
ENVS: Registry[Callable[..., Any]] = Registry("environment")
ENVS.add_lazy("frozenlake", "postrl.envs.frozenlake:FrozenLake")
ENVS.add_lazy("sokoban", "postrl.envs.sokoban:Sokoban")


@runtime_checkable
class Env(Protocol):
    """A text environment: one instance plays one episode at a time."""

    def reset(self, seed: int) -> str:
        """Start an episode determined by ``seed``; return the first observation."""
        ...

    def step(self, action: str) -> tuple[str, float, bool]:
        """Apply the assistant's turn ``action``; return ``(observation, reward, done)``."""
        ...


def register_env(name: str, **meta: Any) -> Callable[[T], T]:
    """Class decorator registering an environment factory under ``name``."""
    return ENVS.register(name, **meta)


def make_env(name: str, **kwargs: Any) -> Env:
    """A fresh environment ``name`` built with ``kwargs``: a registered name, or
    ``"module:Class"`` of an importable class that is not registered (unknown names list the
    choices)."""
    env = ENVS.get_or_import(name, "extra_info.env")(**kwargs)
    if not isinstance(env, Env):
        raise TypeError(
            f"environment {name!r} ({type(env).__name__}) lacks reset(seed) and/or "
            "step(action): implement both (postrl.envs.Env)"
        )
    return env


def discounted_return(rewards: list[float], gamma: float) -> float:
    """``G = Σ_t γ^t r_t`` over an episode's per-turn rewards (γ = 1: their sum)."""
    g = 0.0
    for r in reversed(rewards):
        g = float(r) + gamma * g
    return g


def _episode_seeds(n: int, seed: int, split: str) -> list[int]:
    """``n`` distinct episode seeds; train seeds are even and test seeds odd, so the splits
    never share a seed (they may still share a layout on tiny grids)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: use 'train' or 'test'")
    rng = random.Random(f"{seed}-{split}")
    picked = rng.sample(range(1 << 29), n)
    return [2 * s + (split == "test") for s in picked]


def _prompt(env: Any, obs: str) -> list[dict[str, str]]:
    head = getattr(env, "instructions", "")
    return [{"role": "user", "content": f"{head}\n{obs}" if head else obs}]


def env_rows(
    name: str,
    n: int,
    seed: int = 0,
    split: str = "train",
    env_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``n`` verl-schema rows, one episode each, of environment ``name`` (see the module
    docstring for the layout); ``seed`` picks the episodes, ``split`` keeps train/test apart."""
    kw = dict(env_kwargs or {})
    rows = []
    for i, s in enumerate(_episode_seeds(n, seed, split)):
        env = make_env(name, **kw)
        obs = env.reset(s)
        rows.append(
            {
                "data_source": f"env/{name}",
                "agent_name": "env_agent",
                "prompt": _prompt(env, obs),
                "ability": "env",
                "reward_model": {"style": "env", "ground_truth": ""},
                "extra_info": {
                    "env": name,
                    "seed": s,
                    **({"env_kwargs": kw} if kw else {}),  # parquet cannot store an empty struct
                    "split": split,
                    "index": i,
                },
            }
        )
    return rows


def env_demonstrations(
    name: str,
    n: int,
    seed: int = 0,
    noise: float = 0.0,
    max_turns: int = 8,
    env_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``n`` SFT rows ``{"messages": [...]}``: expert transcripts of train-split episodes.

    The expert plays ``env.solve()``'s first action; with probability ``noise`` per turn it
    plays a random action from the environment's ``actions`` instead (a warm-started policy
    that is imperfect, so RL has a success rate to raise). Observations after the first are
    user turns, exactly as the ``env_agent`` loop appends them. Episodes stop at ``done`` or
    after ``max_turns`` assistant turns. Drawn from a different seed stream than
    :func:`env_rows` with the same ``seed``.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise={noise!r}: must be in [0, 1]")
    kw = dict(env_kwargs or {})
    rng = random.Random(f"{seed}-demos")
    rows = []
    for s in _episode_seeds(n, seed + 7_777_777, "train"):
        env: Any = make_env(name, **kw)
        if not callable(getattr(env, "solve", None)) or not getattr(env, "actions", None):
            raise TypeError(
                f"environment {name!r} has no solve() / actions: expert demonstrations need "
                "both (write SFT rows for it by hand)"
            )
        messages = _prompt(env, env.reset(s))
        for turn in range(max_turns):
            plan = env.solve()
            if plan and rng.random() >= noise:
                action = plan[0]
            else:
                action = rng.choice(list(env.actions))
            obs, _, done = env.step(action)
            messages.append({"role": "assistant", "content": action})
            if done or turn == max_turns - 1:
                break
            messages.append({"role": "user", "content": obs})
        rows.append({"messages": messages})
    return rows
