"""The ``ray`` backend: workers are Ray actors placed by a :class:`ResourcePool`.

Each rank is a thin host actor (``_WorkerHost``) that sets the torch.distributed rendezvous env
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``), initialises the process group (gloo on CPU, nccl on GPU, with the
``collective_s`` timeout) and then constructs the user's worker class inside that process.
Worker exceptions travel back as values (:class:`~postrl.controller.worker.RemoteFailure`) and
re-raise on the driver as :class:`~postrl.controller.errors.WorkerError`; a dead actor raises
:class:`~postrl.controller.errors.WorkerDiedError` as soon as Ray notices (about a second), a
stuck one :class:`~postrl.controller.errors.WorkerTimeoutError` at its deadline. Either way the
group kills every sibling actor and releases its placement groups: no orphan processes.

On GPU pools each actor sees only its own GPU (Ray sets ``CUDA_VISIBLE_DEVICES``), so the host
selects ``cuda:0`` of that view; ``LOCAL_RANK`` is the bundle index on the node.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from postrl.controller.errors import (
    ControllerError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from postrl.controller.resource_pool import ResourcePool, free_port
from postrl.controller.worker import RemoteFailure, WorkerContext, invoke, worker_context
from postrl.controller.worker_group import Timeouts, WorkerGroup
from postrl.protocol.traffic import DRIVER_TRAFFIC

__all__ = ["RayWorkerGroup", "placement_strategies", "release_resource_pool"]

logger = logging.getLogger(__name__)


class _WorkerHost:
    """Ray actor body hosting one rank's worker instance."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.role = "worker"
        self.rank = -1

    def node_info(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def setup(
        self,
        worker_cls: type,
        args: tuple,
        kwargs: dict,
        env: dict[str, str],
        init_dist: bool,
        dist_backend: str,
        pg_timeout_s: float,
    ) -> Any:
        os.environ.update(env)
        self.role, self.rank = env["POSTRL_ROLE"], int(env["RANK"])
        ctx = WorkerContext(self.rank, int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), self.role)
        try:
            import torch

            if dist_backend == "nccl" and torch.cuda.is_available():
                torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else ctx.local_rank)
            if init_dist:
                import torch.distributed as dist

                dist.init_process_group(
                    dist_backend,
                    rank=ctx.rank,
                    world_size=ctx.world_size,
                    timeout=timedelta(seconds=pg_timeout_s),
                )
        except Exception as e:
            import traceback

            return RemoteFailure(
                self.role,
                self.rank,
                "init_process_group",
                type(e).__name__,
                str(e),
                traceback.format_exc(),
            )
        with worker_context(ctx):
            out = invoke(worker_cls, "__call__", args, kwargs, role=self.role, rank=self.rank)
        if isinstance(out, RemoteFailure):
            out.method = "__init__"
            return out
        self.worker = out
        return os.getpid()

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return invoke(self.worker, method, args, kwargs, role=self.role, rank=self.rank)


_RemoteHost: Any = None


def _remote_host() -> Any:
    global _RemoteHost
    if _RemoteHost is None:
        _RemoteHost = ray.remote(max_restarts=0, max_task_retries=0)(_WorkerHost)
    return _RemoteHost


class _PoolState:
    def __init__(self, pgs: list[Any]) -> None:
        self.pgs = pgs
        self.users = 0


_POOLS: dict[ResourcePool, _PoolState] = {}


def _acquire_pool(pool: ResourcePool, timeout_s: float) -> _PoolState:
    state = _POOLS.get(pool)
    if state is None:
        pgs = [
            placement_group(
                [pool.bundle()] * n,
                strategy=pool.strategy,
                name=f"{pool.name}_node{i}_{os.getpid()}",
            )
            for i, n in enumerate(pool.process_on_nodes)
        ]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            for pg in pgs:
                remove_placement_group(pg)
            raise ControllerError(
                f"resource pool {pool.name!r} ({pool.process_on_nodes} processes x "
                f"{pool.bundle()}) could not be placed within {timeout_s:.0f}s; "
                f"cluster has {ray.available_resources()} free. Lower "
                f"num_cpus_per_process/num_gpus_per_process or the process counts"
            ) from e
        state = _POOLS[pool] = _PoolState(pgs)
    state.users += 1
    return state


def placement_strategies(pool: ResourcePool, timeout_s: float) -> list[Any]:
    """Reserve ``pool`` (one placement group per node, shared by every user of the same pool
    object) and return one ``PlacementGroupSchedulingStrategy`` per bundle, node by node: for
    actors that are not a worker group (the rollout replicas of ``fully_async``). Pair with
    :func:`release_resource_pool`; ``ControllerError`` if the cluster cannot place it within
    ``timeout_s``."""
    state = _acquire_pool(pool, timeout_s)
    return [
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b)
        for pg, n in zip(state.pgs, pool.process_on_nodes, strict=True)
        for b in range(n)
    ]


def release_resource_pool(pool: ResourcePool) -> None:
    """Drop one user of ``pool``; its placement groups are removed with the last user."""
    state = _POOLS.get(pool)
    if state is None:
        return
    state.users -= 1
    if state.users <= 0:
        for pg in state.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # cluster already gone
                logger.debug("remove_placement_group failed", exc_info=True)
        del _POOLS[pool]


class RayWorkerGroup(WorkerGroup):
    """A worker group of Ray actors; arguments as ``create_worker_group``.

    Starts Ray with defaults if it is not running (``ray.init()``); tests and launchers should
    call ``ray.init`` themselves to choose resources.
    """

    backend_name = "ray"

    def __init__(
        self,
        worker_cls: type,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        *,
        world_size: int = 1,
        name: str | None = None,
        timeouts: Timeouts | None = None,
        shutdown_on_error: bool = True,
        init_dist: bool = True,
        resource_pool: ResourcePool | None = None,
    ) -> None:
        name = name or worker_cls.__name__
        super().__init__(
            worker_cls,
            world_size=world_size,
            name=name,
            timeouts=timeouts,
            shutdown_on_error=shutdown_on_error,
        )
        if not ray.is_initialized():
            logger.info("ray is not initialised; starting a local Ray instance")
            ray.init()
        self.pool = resource_pool or ResourcePool(
            process_on_nodes=(world_size,), name=f"{name}_pool"
        )
        self.hosts: list[Any] = []
        self.pids: list[int] = []
        self._pool_state: _PoolState | None = None
        try:
            self._start(args, dict(kwargs or {}), init_dist)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, args: tuple, kwargs: dict, init_dist: bool) -> None:
        t0 = time.monotonic()
        self._pool_state = _acquire_pool(self.pool, self.timeouts.init_s)
        share = self.pool.max_colocate_count
        opts: dict[str, Any] = {"num_cpus": self.pool.num_cpus_per_process / share}
        if self.pool.use_gpu:
            opts["num_gpus"] = self.pool.num_gpus_per_process / share
        placement: list[tuple[int, int]] = []  # (local_rank, local_world) per global rank
        for pg, n in zip(self._pool_state.pgs, self.pool.process_on_nodes):
            for b in range(n):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=b
                )
                self.hosts.append(
                    _remote_host().options(scheduling_strategy=strategy, **opts).remote()
                )
                placement.append((b, n))
        remaining = max(1.0, self.timeouts.init_s - (time.monotonic() - t0))
        master_addr, master_port = self._wait(
            [self.hosts[0].node_info.remote()], [0], "node_info", remaining
        )[0]
        backend = "nccl" if self.pool.use_gpu else "gloo"
        refs = []
        for rank, host in enumerate(self.hosts):
            env = {
                "MASTER_ADDR": str(master_addr),
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(placement[rank][0]),
                "LOCAL_WORLD_SIZE": str(placement[rank][1]),
                "POSTRL_ROLE": self.name,
            }
            refs.append(
                host.setup.remote(
                    self.worker_cls,
                    args,
                    kwargs,
                    env,
                    init_dist,
                    backend,
                    self.timeouts.collective_s,
                )
            )
        remaining = max(1.0, self.timeouts.init_s - (time.monotonic() - t0))
        self.pids = self._wait(refs, list(range(self.world_size)), "__init__", remaining)
        logger.info(
            "%s: %d ray workers up in %.1fs", self.name, self.world_size, time.monotonic() - t0
        )

    # ------------------------------------------------------------------ hooks
    def _launch(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        DRIVER_TRAFFIC.count("out", f"{self.name}.{method}", (args, kwargs))
        return self.hosts[rank].execute.remote(method, *args, **kwargs)

    def _wait(
        self, handles: list[Any], ranks: list[int], method: str, timeout_s: float
    ) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        index = {h: j for j, h in enumerate(handles)}
        results: list[Any] = [None] * len(handles)
        pending = list(handles)
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = (
                ray.wait(pending, num_returns=1, timeout=max(0.0, remaining))
                if remaining > 0
                else ([], pending)
            )
            if not ready:
                stuck = sorted(ranks[index[h]] for h in pending)
                raise WorkerTimeoutError(
                    f"no result after {timeout_s:.1f}s from rank(s) {stuck}; "
                    "raise the deadline via @register(timeout_s=...) or "
                    f"Timeouts(per_method={{{method!r}: ...}}) if this is expected",
                    role=self.name,
                    rank=stuck[0],
                    method=method,
                    exc_type="Timeout",
                )
            for h in ready:
                j = index[h]
                try:
                    value = ray.get(h)
                except RayActorError as e:
                    raise WorkerDiedError(
                        f"worker process died ({type(e).__name__}): "
                        f"{str(e).splitlines()[0] if str(e) else ''}",
                        role=self.name,
                        rank=ranks[j],
                        method=method,
                        exc_type=type(e).__name__,
                    ) from e
                except RayError as e:
                    raise WorkerError(
                        str(e),
                        role=self.name,
                        rank=ranks[j],
                        method=method,
                        exc_type=type(e).__name__,
                    ) from e
                if isinstance(value, RemoteFailure):
                    raise value.to_error()
                DRIVER_TRAFFIC.count("in", f"{self.name}.{method}", value)
                results[j] = value
        return results

    def _handles_done(self, handles: list[Any]) -> bool:
        ready, _ = ray.wait(list(handles), num_returns=len(handles), timeout=0)
        return len(ready) == len(handles)

    def _shutdown_workers(self) -> None:
        for host in self.hosts:
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # already dead or cluster gone
                logger.debug("ray.kill failed", exc_info=True)
        self.hosts = []
        if self._pool_state is not None:
            self._pool_state = None
            release_resource_pool(self.pool)
