"""Typed errors raised on the driver when a worker call fails.

Every failure of a remote (or in-process) worker call surfaces as a :class:`WorkerError`
carrying the worker group's role, the rank, the method name and the remote traceback, so the
driver log says *where* it broke without attaching a debugger to a Ray actor.
"""

from __future__ import annotations

__all__ = ["ControllerError", "WorkerError", "WorkerTimeoutError", "WorkerDiedError"]


class ControllerError(RuntimeError):
    """Misuse of the controller API (bad dispatch inputs, unknown modes, closed groups)."""


class WorkerError(RuntimeError):
    """A worker call failed.

    Attributes:
        role: name of the worker group (e.g. ``"actor"``).
        rank: global rank of the failing worker (``-1`` when unknown).
        method: the worker method that was called.
        remote_traceback: the formatted traceback from the worker process ('' if none).
        exc_type: class name of the original exception.
    """

    def __init__(
        self,
        message: str,
        *,
        role: str,
        rank: int,
        method: str,
        remote_traceback: str = "",
        exc_type: str = "",
    ) -> None:
        self.role = role
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        self.message = message
        super().__init__(self._format())

    def _format(self) -> str:
        head = (
            f"[{self.role} rank {self.rank}] {self.method}: "
            f"{self.exc_type + ': ' if self.exc_type else ''}{self.message}"
        )
        if self.remote_traceback:
            return f"{head}\n--- remote traceback ---\n{self.remote_traceback.rstrip()}"
        return head

    def __reduce__(self):  # keep keyword-only fields through pickling
        return (
            _rebuild,
            (
                type(self),
                self.message,
                self.role,
                self.rank,
                self.method,
                self.remote_traceback,
                self.exc_type,
            ),
        )


def _rebuild(cls, message, role, rank, method, tb, exc_type):  # type: ignore[no-untyped-def]
    return cls(message, role=role, rank=rank, method=method, remote_traceback=tb, exc_type=exc_type)


class WorkerTimeoutError(WorkerError):
    """A worker call did not finish before its deadline (the group is shut down)."""


class WorkerDiedError(WorkerError):
    """A worker process died (killed, OOM, segfault) during or before the call."""
