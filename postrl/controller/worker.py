"""``Worker``: the base class of every role (actor, rollout, reference, critic, reward).

A worker knows its rank and world size (from the backend, or the ``RANK``/``WORLD_SIZE`` env
vars torch.distributed uses), registers per-mesh data-parallel coordinates so the driver can
*ask* the topology instead of assuming it, and exposes ``@register``-ed methods that a
:class:`~postrl.controller.worker_group.WorkerGroup` binds.

Subclasses may forget ``super().__init__()``: the rank context is attached in ``__new__``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from postrl.controller.dispatch import DpInfo
from postrl.controller.errors import WorkerError
from postrl.protocol.refs import keep_remote, materialise_args

__all__ = ["Worker", "WorkerContext", "worker_context", "RemoteFailure", "invoke"]


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker instance sits: ``rank`` of ``world_size`` in group ``role``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    role: str = "worker"

    @classmethod
    def from_env(cls) -> WorkerContext:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``POSTRL_ROLE`` (defaults 0/1/0)."""
        env = os.environ
        return cls(
            int(env.get("RANK", 0)),
            int(env.get("WORLD_SIZE", 1)),
            int(env.get("LOCAL_RANK", 0)),
            env.get("POSTRL_ROLE", "worker"),
        )


_CONTEXT: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar(
    "postrl_worker_ctx", default=None
)


@contextlib.contextmanager
def worker_context(ctx: WorkerContext) -> Iterator[None]:
    """Make workers constructed inside this block take ``ctx`` (used by the backends)."""
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


class Worker:
    """Base class of role workers; see the module docstring."""

    _postrl_ctx: WorkerContext
    _postrl_dp: dict[str, DpInfo]

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        obj = super().__new__(cls)
        obj._postrl_ctx = _CONTEXT.get() or WorkerContext.from_env()
        obj._postrl_dp = {}
        return obj

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """Global rank within the worker group."""
        return self._postrl_ctx.rank

    @property
    def world_size(self) -> int:
        """Number of workers in the group."""
        return self._postrl_ctx.world_size

    @property
    def local_rank(self) -> int:
        """Index of this worker on its node."""
        return self._postrl_ctx.local_rank

    @property
    def role(self) -> str:
        """The worker group's name."""
        return self._postrl_ctx.role

    @property
    def device(self) -> torch.device:
        """``cuda:<current>`` when a GPU is visible to this process, else ``cpu``."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ topology
    def register_dp_info(
        self, mesh_name: str, *, dp_rank: int, dp_size: int, is_collect: bool = True
    ) -> None:
        """Declare this worker's data-parallel coordinates for ``mesh_name`` (e.g. ``"actor"``).

        Call in ``__init__`` (or after building a device mesh). ``is_collect`` marks the one
        replica per dp rank whose output the driver keeps (e.g. tp rank 0).
        """
        if not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"register_dp_info({mesh_name!r}): "
                f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})"
            )
        self._postrl_dp[mesh_name] = DpInfo(dp_rank, dp_size, is_collect)

    def _postrl_get_dp_info(self, mesh_name: str) -> DpInfo:
        """Registered :class:`DpInfo` for ``mesh_name``.

        Pure data parallel if none was registered."""
        info = self._postrl_dp.get(mesh_name)
        return info if info is not None else DpInfo(self.rank, self.world_size, True)


@dataclass
class RemoteFailure:
    """A worker-side exception, returned as a value so it survives any transport.

    Downstream calls that receive a ``RemoteFailure`` as an argument (a failed non-blocking
    result fed into the next call) return it unchanged, so the driver reports the origin.
    """

    role: str
    rank: int
    method: str
    exc_type: str
    message: str
    traceback: str
    exc: BaseException | None = None  # only kept in-process (local backend), for pdb

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "exc": None}

    def to_error(self) -> WorkerError:
        """The driver-side :class:`WorkerError`."""
        err = WorkerError(
            self.message,
            role=self.role,
            rank=self.rank,
            method=self.method,
            remote_traceback=self.traceback,
            exc_type=self.exc_type,
        )
        if self.exc is not None:
            err.__cause__ = self.exc
        return err


def invoke(worker: Any, method: str, args: tuple, kwargs: dict, *, role: str, rank: int) -> Any:
    """Call ``worker.method(*args, **kwargs)``; exceptions come back as :class:`RemoteFailure`.

    A :class:`~postrl.protocol.refs.RefShard` argument (rows by reference) is materialised here,
    on the worker, and the answer's tensors stay here (:func:`~postrl.protocol.refs.keep_remote`):
    the method body is the one the driver plane calls."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, RemoteFailure):
            return v
    try:
        args, kwargs, by_ref = materialise_args(args, kwargs)  # rows by reference: fetch here
        out = getattr(worker, method)(*args, **kwargs)
        return keep_remote(out) if by_ref else out  # ...and their results stay here
    except Exception as e:
        return RemoteFailure(
            role, rank, method, type(e).__name__, str(e), traceback.format_exc(), e
        )
