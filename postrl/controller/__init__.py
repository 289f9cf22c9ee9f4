"""Single controller: one driver, role-typed worker groups, dispatch declared on the method.

``import postrl.controller`` never imports Ray; the ``ray`` backend loads on first use.

Public API::

    from postrl.controller import (
        Worker, register, Dispatch, Execute, register_dispatch_mode, make_nd_compute_dispatch,
        WorkerGroup, GroupFuture, Timeouts, ResourcePool, create_worker_group,
        create_colocated_worker_cls, balance_for_dp, WorkerError, WorkerTimeoutError,
        WorkerDiedError,
    )
"""

from postrl.controller.balance import balance_for_dp
from postrl.controller.colocate import create_colocated_worker_cls
from postrl.controller.dispatch import (
    DISPATCH_MODES,
    Dispatch,
    DispatchContext,
    DispatchMode,
    DispatchSpec,
    DpInfo,
    Execute,
    get_dispatch_spec,
    make_nd_compute_dispatch,
    register,
    register_dispatch_mode,
    split_proto,
)
from postrl.controller.errors import (
    ControllerError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from postrl.controller.factory import BACKENDS, create_worker_group
from postrl.controller.future import GroupFuture
from postrl.controller.resource_pool import ResourcePool
from postrl.controller.worker import Worker, WorkerContext
from postrl.controller.worker_group import Timeouts, WorkerGroup

__all__ = [
    "BACKENDS",
    "DISPATCH_MODES",
    "ControllerError",
    "Dispatch",
    "DispatchContext",
    "DispatchMode",
    "DispatchSpec",
    "DpInfo",
    "Execute",
    "GroupFuture",
    "ResourcePool",
    "Timeouts",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeoutError",
    "balance_for_dp",
    "create_colocated_worker_cls",
    "create_worker_group",
    "get_dispatch_spec",
    "make_nd_compute_dispatch",
    "register",
    "register_dispatch_mode",
    "split_proto",
]
