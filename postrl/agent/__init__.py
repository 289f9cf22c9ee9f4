"""Agent loops (single-turn, tool loop) and the manager that runs them against the rollout."""

from postrl.agent.base import (
    AGENT_LOOPS,
    AgentLoopBase,
    AgentLoopOutput,
    RolloutClientLike,
    SingleTurnAgentLoop,
    register_agent_loop,
)
from postrl.agent.manager import AgentLoopManager, derive_seed

__all__ = [
    "AGENT_LOOPS",
    "AgentLoopBase",
    "AgentLoopManager",
    "AgentLoopOutput",
    "RolloutClientLike",
    "SingleTurnAgentLoop",
    "derive_seed",
    "register_agent_loop",
]
