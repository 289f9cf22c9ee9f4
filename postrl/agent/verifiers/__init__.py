"""``verifiers`` environments as trajectories (the ``verifiers`` loop).

See :mod:`postrl.agent.verifiers.loop` for the contract and docs/agent.md, "verifiers
environments", for how to use it. The worker (:mod:`postrl.agent.verifiers.worker`) runs in the
verifiers venv and is started by path, never imported here.
"""

from postrl.agent.verifiers.loop import (
    VerifiersAgentLoop,
    check_verifiers_config,
    dataset_rows,
    list_tasks,
    verifiers_python,
    worker_init,
)
from postrl.agent.verifiers.process import WorkerError, WorkerProcess

__all__ = [
    "VerifiersAgentLoop",
    "WorkerError",
    "WorkerProcess",
    "check_verifiers_config",
    "dataset_rows",
    "list_tasks",
    "verifiers_python",
    "worker_init",
]
