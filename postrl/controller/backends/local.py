"""The ``local`` backend: workers are plain objects in the driver process.

The embedded default: no Ray, no subprocess, breakpoints and pdb work inside worker methods.
``world_size`` may exceed 1 to exercise dispatch/collect in-process (every rank is an object
in the same process, called one after another); such workers must not use collectives. With
``init_dist=True`` (world size 1 only) a single-process gloo/nccl group is initialised so code
written for torch.distributed runs unchanged.

Calls run synchronously, so deadlines cannot interrupt them: a stuck local call is stuck in your
own process, where a debugger can see it. Errors surface as
:class:`~postrl.controller.errors.WorkerError` with the original exception as ``__cause__``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from postrl.controller.errors import ControllerError
from postrl.controller.worker import RemoteFailure, WorkerContext, invoke, worker_context
from postrl.controller.worker_group import Timeouts, WorkerGroup

__all__ = ["LocalWorkerGroup"]

logger = logging.getLogger(__name__)


class LocalWorkerGroup(WorkerGroup):
    """In-process worker group; see the module docstring. Arguments as ``create_worker_group``."""

    backend_name = "local"

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
        init_dist: bool = False,
        resource_pool: Any = None,
    ) -> None:
        name = name or worker_cls.__name__
        super().__init__(
            worker_cls,
            world_size=world_size,
            name=name,
            timeouts=timeouts,
            shutdown_on_error=shutdown_on_error,
        )
        if init_dist:
            if world_size != 1:
                raise ControllerError(
                    f"local backend: init_dist needs world_size=1 (got {world_size}); "
                    "use backend='ray' for real ranks"
                )
            self._init_single_process_group()
        self.workers: list[Any] = []
        for rank in range(world_size):
            with worker_context(WorkerContext(rank, world_size, rank, name)):
                out = invoke(
                    worker_cls, "__call__", tuple(args), dict(kwargs or {}), role=name, rank=rank
                )
            if isinstance(out, RemoteFailure):
                out.method = "__init__"
                self._closed = True
                raise out.to_error()
            self.workers.append(out)

    def _init_single_process_group(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        from postrl.controller.resource_pool import free_port

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=self.timeouts.collective_s),
        )
        self._owns_pg = True

    def _launch(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        return invoke(self.workers[rank], method, args, kwargs, role=self.name, rank=rank)

    def _wait(
        self, handles: list[Any], ranks: list[int], method: str, timeout_s: float
    ) -> list[Any]:
        for h in handles:
            if isinstance(h, RemoteFailure):
                raise h.to_error()
        return list(handles)

    def _handles_done(self, handles: list[Any]) -> bool:
        return True

    def _shutdown_workers(self) -> None:
        for w in self.workers:
            close = getattr(w, "shutdown", None)
            if callable(close):
                try:
                    close()
                except Exception:  # best effort: we are already tearing down
                    logger.exception("%s: worker shutdown() raised", self.name)
        self.workers = []
        if getattr(self, "_owns_pg", False):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
