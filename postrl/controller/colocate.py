"""Colocation: several roles (actor + rollout + reference ...) in one worker process.

``create_colocated_worker_cls({"actor": ActorWorker, "ref": RefWorker})`` returns a worker class
whose instances hold one instance of each role (sharing the process, its devices and its
torch.distributed group, as verl's fused worker does). Every registered method ``m`` of role
``r`` is exposed as ``r_m`` with the same dispatch spec, and a group of that class also offers
``wg.r.m``. Construct with one kwargs dict per role::

    Fused = create_colocated_worker_cls({"actor": ActorWorker, "ref": RefWorker})
    wg = create_worker_group("ray", Fused, kwargs={"actor": {"lr": 1e-6}, "ref": {}}, world_size=2)
    wg.actor.compute_log_prob(batch); wg.ref_compute_ref_log_prob(batch)

The sync training mode reaches the rollout role from the actor role through
``self.colocated["rollout"]`` (each role instance gets that dict), so weights move in-process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from postrl.controller.dispatch import SPEC_ATTR, DpInfo, registered_methods
from postrl.controller.errors import ControllerError
from postrl.controller.worker import Worker

__all__ = ["create_colocated_worker_cls"]


def _forward(role: str, method: str, spec: Any) -> Callable[..., Any]:
    def fn(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], method)(*args, **kwargs)

    fn.__name__ = f"{role}_{method}"
    setattr(fn, SPEC_ATTR, spec)
    return fn


def create_colocated_worker_cls(role_classes: Mapping[str, type]) -> type[Worker]:
    """Build a worker class hosting one instance of each role class; see the module docstring."""
    if not role_classes:
        raise ControllerError("create_colocated_worker_cls needs at least one role")
    for role, cls in role_classes.items():
        if not role.isidentifier():
            raise ControllerError(f"role name {role!r} must be a Python identifier")
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise ControllerError(f"role {role!r}: {cls!r} is not a Worker subclass")
    roles = dict(role_classes)

    def __init__(self: Any, **role_kwargs: Mapping[str, Any]) -> None:
        unknown = sorted(set(role_kwargs) - set(roles))
        if unknown:
            raise ControllerError(
                f"colocated worker got kwargs for unknown role(s) {unknown}; roles: {sorted(roles)}"
            )
        self.roles = {}
        for role, cls in roles.items():
            inst = cls(**dict(role_kwargs.get(role, {})))
            inst.colocated = self.roles
            self.roles[role] = inst

    def _postrl_get_dp_info(self: Any, mesh_name: str) -> DpInfo:
        if mesh_name in self._postrl_dp:
            return self._postrl_dp[mesh_name]
        for inst in self.roles.values():
            if mesh_name in inst._postrl_dp:
                return inst._postrl_dp[mesh_name]
        return DpInfo(self.rank, self.world_size, True)

    def shutdown(self: Any) -> None:
        for inst in self.roles.values():
            close = getattr(inst, "shutdown", None)
            if callable(close):
                close()

    ns: dict[str, Any] = {
        "__init__": __init__,
        "_postrl_get_dp_info": _postrl_get_dp_info,
        "shutdown": shutdown,
        "_postrl_roles": tuple(roles),
        "__doc__": f"Colocated worker hosting roles {sorted(roles)}.",
    }
    for role, cls in roles.items():
        for method, spec in registered_methods(cls).items():
            ns[f"{role}_{method}"] = functools.update_wrapper(
                _forward(role, method, spec), getattr(cls, method), updated=()
            )
            setattr(ns[f"{role}_{method}"], SPEC_ATTR, spec)
            ns[f"{role}_{method}"].__name__ = f"{role}_{method}"
    return type("Colocated_" + "_".join(roles), (Worker,), ns)
