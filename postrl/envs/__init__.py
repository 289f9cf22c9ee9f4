"""Gym-style multi-turn environments for RL on text (RAGEN's StarPO setting).

An environment is anything with ``reset(seed) -> observation`` and
``step(action_text) -> (observation, reward, done)``, registered by name::

    from postrl.envs import register_env

    @register_env("my_env")
    class MyEnv:
        def reset(self, seed: int) -> str: ...
        def step(self, action: str) -> tuple[str, float, bool]: ...

The ``env_agent`` loop (:mod:`postrl.agent.env_loop`) plays one episode per trajectory; rows
name the environment and its seed in ``extra_info`` (``postrl data frozenlake ...`` writes
them). Shipped: ``frozenlake`` and ``sokoban`` on tiny grids, deterministic from the seed.
See docs/agent.md, "Environments".
"""

from postrl.envs.base import (
    ENVS,
    Env,
    discounted_return,
    env_demonstrations,
    env_rows,
    make_env,
    register_env,
)

__all__ = [
    "ENVS",
    "Env",
    "discounted_return",
    "env_demonstrations",
    "env_rows",
    "make_env",
    "register_env",
]
