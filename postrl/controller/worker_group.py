"""``WorkerGroup``: driver-side handle of a group of role workers (backend-neutral part).

Every ``@register``-ed method of the worker class becomes a group method of the same name that
dispatches (split), executes on the ranks and collects (join)::

    actor_wg = create_worker_group("ray", ActorWorker, world_size=4, name="actor")
    log_probs = actor_wg.compute_log_prob(batch)      # DataProto in, DataProto out

Non-blocking methods (``blocking=False``) return a :class:`GroupFuture` that may be passed
into the next group call (it is resolved first). Backends implement four hooks: ``_launch``,
``_wait``, ``_handles_done`` and ``_shutdown_workers``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from postrl.controller.dispatch import (
    Dispatch,
    DispatchContext,
    DispatchMode,
    DispatchSpec,
    DpInfo,
    Execute,
    registered_methods,
)
from postrl.controller.errors import (
    ControllerError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from postrl.controller.future import GroupFuture

__all__ = ["Timeouts", "WorkerGroup"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """Deadlines (seconds) for everything the driver waits on.

    Attributes:
        call_s: default deadline of one group call (a method's ``@register(timeout_s=...)``
            overrides it; ``per_method`` overrides both).
        init_s: worker start-up (process launch, model construction, rendezvous).
        collective_s: torch.distributed process-group timeout (collectives that never complete).
        per_method: per-method overrides for this group, e.g. ``{"update_actor": 3600}``.
    """

    call_s: float = 1800.0
    init_s: float = 300.0
    collective_s: float = 1800.0
    per_method: Mapping[str, float] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(
            (self.call_s, self.init_s, self.collective_s, tuple(sorted(self.per_method.items())))
        )


class _RoleView:
    """``wg.actor.compute_log_prob`` -> ``wg.actor_compute_log_prob`` for colocated groups."""

    def __init__(self, group: WorkerGroup, role: str, methods: list[str]) -> None:
        self._group, self._role, self._methods = group, role, methods

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._methods:
            raise AttributeError(
                f"role {self._role!r} has no registered method {name!r}; it has {self._methods}"
            )
        return getattr(self._group, f"{self._role}_{name}")

    def __dir__(self) -> list[str]:
        return list(self._methods)


class WorkerGroup:
    """Backend-neutral group of ``world_size`` workers of one class; see the module docstring.

    Args:
        worker_cls: a :class:`~postrl.controller.worker.Worker` subclass.
        world_size: number of workers.
        name: role name used in errors and logs.
        timeouts: deadlines (:class:`Timeouts`).
        shutdown_on_error: shut every worker down when any call fails (dead and timed-out
            workers always shut the group down: collectives would hang otherwise).
    """

    backend_name: ClassVar[str] = "base"

    def __init__(
        self,
        worker_cls: type,
        *,
        world_size: int,
        name: str,
        timeouts: Timeouts | None = None,
        shutdown_on_error: bool = True,
    ) -> None:
        if world_size < 1:
            raise ControllerError(f"world_size={world_size} must be >= 1")
        self.worker_cls = worker_cls
        self.world_size = world_size
        self.name = name
        self.timeouts = timeouts or Timeouts()
        self.shutdown_on_error = shutdown_on_error
        self._specs = registered_methods(worker_cls)
        self._dp_cache: dict[str, list[DpInfo]] = {}
        self._closed = False
        self._bind_methods()

    # ------------------------------------------------------------------ binding
    def _bind_methods(self) -> None:
        for method, spec in self._specs.items():
            if hasattr(type(self), method) or method in self.__dict__:
                raise ControllerError(
                    f"{self.worker_cls.__name__}.{method} clashes with a WorkerGroup attribute; "
                    "rename the method"
                )
            setattr(self, method, self._make_method(method, spec))
        for role in getattr(self.worker_cls, "_postrl_roles", ()):
            prefix = f"{role}_"
            methods = [m[len(prefix) :] for m in self._specs if m.startswith(prefix)]
            if hasattr(self, role):
                raise ControllerError(
                    f"role name {role!r} clashes with a group attribute; rename the role"
                )
            setattr(self, role, _RoleView(self, role, methods))

    def _make_method(self, method: str, spec: DispatchSpec) -> Callable[..., Any]:
        def group_method(*args: Any, **kwargs: Any) -> Any:
            fut = self._call(method, spec, args, kwargs)
            return fut.result() if spec.blocking else fut

        group_method.__name__ = method
        group_method.__doc__ = getattr(getattr(self.worker_cls, method), "__doc__", None)
        return group_method

    @property
    def methods(self) -> dict[str, DispatchSpec]:
        """Registered methods of the worker class and their specs."""
        return dict(self._specs)

    # ------------------------------------------------------------------ calls
    def submit(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture:
        """Call registered ``method`` without blocking, whatever its spec says."""
        if method not in self._specs:
            raise ControllerError(
                f"{self.name}: {method!r} is not a registered method; "
                f"registered: {sorted(self._specs)}"
            )
        return self._call(method, self._specs[method], args, kwargs)

    def execute(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        *,
        dispatch_mode: str | DispatchMode = Dispatch.ONE_TO_ALL,
        execute_mode: str = Execute.ALL,
        blocking: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """Call any worker method (registered or not) with an explicit dispatch mode."""
        spec = DispatchSpec(dispatch_mode, execute_mode, blocking, timeout_s)
        fut = self._call(method, spec, tuple(args), dict(kwargs or {}))
        return fut.result() if blocking else fut

    def timeout_for(self, method: str, spec: DispatchSpec | None = None) -> float:
        """Deadline of ``method``: group override > ``@register(timeout_s)`` > group default."""
        if method in self.timeouts.per_method:
            return float(self.timeouts.per_method[method])
        if spec is not None and spec.timeout_s is not None:
            return float(spec.timeout_s)
        return float(self.timeouts.call_s)

    def _call(self, method: str, spec: DispatchSpec, args: tuple, kwargs: dict) -> GroupFuture:
        self._check_open()
        mode = spec.mode
        args = tuple(a.result() if isinstance(a, GroupFuture) else a for a in args)
        kwargs = {k: v.result() if isinstance(v, GroupFuture) else v for k, v in kwargs.items()}
        ctx = DispatchContext(self.world_size, method, self.name, self.backend_name, self.dp_info)
        calls = list(mode.dispatch_fn(ctx, args, kwargs))
        if len(calls) != self.world_size:
            raise ControllerError(
                f"dispatch mode {mode.name!r} returned {len(calls)} calls "
                f"for world size {self.world_size}"
            )
        ranks = [
            r
            for r, c in enumerate(calls)
            if c is not None and (spec.execute_mode == Execute.ALL or r == 0)
        ]
        if not ranks:
            raise ControllerError(
                f"{self.name}.{method}: dispatch mode {mode.name!r} addressed no rank"
            )
        ctx.ranks = ranks
        handles = [self._launch(r, method, calls[r][0], calls[r][1]) for r in ranks]  # type: ignore[index]
        return GroupFuture(self, method, ranks, handles, mode, ctx, self.timeout_for(method, spec))

    def dp_info(self, mesh_name: str) -> list[DpInfo]:
        """Per-rank :class:`DpInfo` the workers registered for ``mesh_name`` (queried once)."""
        if mesh_name not in self._dp_cache:
            ranks = list(range(self.world_size))
            handles = [self._launch(r, "_postrl_get_dp_info", (mesh_name,), {}) for r in ranks]
            self._dp_cache[mesh_name] = self._wait_checked(
                handles, ranks, "_postrl_get_dp_info", self.timeouts.init_s
            )
        return list(self._dp_cache[mesh_name])

    def _wait_checked(
        self, handles: list[Any], ranks: list[int], method: str, timeout_s: float
    ) -> list[Any]:
        try:
            return self._wait(handles, ranks, method, timeout_s)
        except WorkerError as e:
            fatal = isinstance(e, (WorkerDiedError, WorkerTimeoutError)) or self.shutdown_on_error
            if fatal and not self._closed:
                logger.error(
                    "%s: %s failed on rank %s; shutting the group down", self.name, method, e.rank
                )
                self.shutdown()
            raise

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise ControllerError(
                f"worker group {self.name!r} is shut down (after an error or shutdown()); "
                "create a new one"
            )

    @property
    def closed(self) -> bool:
        """True after :meth:`shutdown`."""
        return self._closed

    def shutdown(self) -> None:
        """Stop every worker (idempotent). No worker process outlives this call."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_workers()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, {self.worker_cls.__name__} x {self.world_size})"
        )

    # ------------------------------------------------------------------ backend hooks
    def _launch(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _wait(
        self, handles: list[Any], ranks: list[int], method: str, timeout_s: float
    ) -> list[Any]:
        raise NotImplementedError

    def _handles_done(self, handles: list[Any]) -> bool:
        raise NotImplementedError

    def _shutdown_workers(self) -> None:
        raise NotImplementedError
