"""Role workers on the single controller: actor, reference, critic and reward model.

Each is a :class:`postrl.controller.Worker` built from the full ``PostRLConfig`` that translates
config into engine arguments and exposes engine methods with ``@register`` dispatch (see
:mod:`postrl.workers.actor` for the method table).
"""

from postrl.workers.actor import ActorWorker, RefWorker
from postrl.workers.critic import CriticWorker
from postrl.workers.reward_model import RewardModelWorker

__all__ = ["ActorWorker", "RefWorker", "CriticWorker", "RewardModelWorker"]
