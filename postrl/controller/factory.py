"""``create_worker_group``: the one constructor the trainer calls (``trainer.backend`` picks it)."""

from __future__ import annotations

from typing import Any

from postrl.controller.resource_pool import ResourcePool
from postrl.controller.worker_group import Timeouts, WorkerGroup
from postrl.registry import Registry

__all__ = ["BACKENDS", "create_worker_group"]

BACKENDS: Registry[type] = Registry("controller backend")
BACKENDS.add_lazy("local", "postrl.controller.backends.local:LocalWorkerGroup")
BACKENDS.add_lazy("ray", "postrl.controller.backends.ray:RayWorkerGroup", extra="ray")


def create_worker_group(
    backend: str,
    worker_cls: type,
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    world_size: int | None = None,
    resource_pool: ResourcePool | None = None,
    name: str | None = None,
    timeouts: Timeouts | None = None,
    shutdown_on_error: bool = True,
    init_dist: bool | None = None,
) -> WorkerGroup:
    """Start ``world_size`` workers of ``worker_cls`` on ``backend`` (``"local"`` or ``"ray"``).

    Args:
        backend: registered backend name (``BACKENDS``); unknown names list the choices.
        worker_cls: a :class:`~postrl.controller.worker.Worker` subclass (or a colocated class).
        args, kwargs: constructor arguments, identical on every rank (a worker reads
            ``self.rank`` to specialise).
        world_size: number of workers; defaults to ``resource_pool.world_size`` or 1.
        resource_pool: placement (ray); ignored by ``local``.
        name: role name used in errors, logs and ``POSTRL_ROLE``.
        timeouts: deadlines for calls, start-up and collectives.
        shutdown_on_error: shut the group down on any failed call (always on death/timeout).
        init_dist: initialise torch.distributed in each worker; default ``True`` for ray,
            ``False`` for local.
    """
    cls = BACKENDS.get(backend)
    if world_size is None:
        world_size = resource_pool.world_size if resource_pool is not None else 1
    if resource_pool is not None and resource_pool.world_size != world_size:
        raise ValueError(
            f"world_size={world_size} but "
            f"resource_pool.process_on_nodes={resource_pool.process_on_nodes} "
            f"holds {resource_pool.world_size} processes; make them equal"
        )
    opts: dict[str, Any] = dict(
        world_size=world_size,
        name=name,
        timeouts=timeouts,
        shutdown_on_error=shutdown_on_error,
        resource_pool=resource_pool,
    )
    if init_dist is not None:
        opts["init_dist"] = init_dist
    return cls(worker_cls, tuple(args), dict(kwargs or {}), **opts)
