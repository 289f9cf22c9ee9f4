"""``GroupFuture``: the result of a non-blocking group call.

It can be awaited on the driver (:meth:`GroupFuture.result`) or passed into the next group
call, which resolves it first (the rows of the object-store data plane travel by reference
instead: ``ref_shards``, ``postrl/protocol/refs.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from postrl.controller.dispatch import DispatchContext, DispatchMode
    from postrl.controller.worker_group import WorkerGroup

__all__ = ["GroupFuture"]

_UNSET = object()


class GroupFuture:
    """Per-rank handles of one group call plus the mode's collect function."""

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        ranks: list[int],
        handles: list[Any],
        mode: DispatchMode,
        ctx: DispatchContext,
        timeout_s: float,
    ) -> None:
        self.group = group
        self.method = method
        self.ranks = ranks
        self.handles = handles
        self.mode = mode
        self.ctx = ctx
        self.timeout_s = timeout_s
        self._value: Any = _UNSET

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait (at most ``timeout_s``, default the method's deadline) and collect.

        Raises :class:`~postrl.controller.errors.WorkerError` (or its timeout/died subclasses).
        """
        if self._value is _UNSET:
            outputs = self.group._wait_checked(
                self.handles, self.ranks, self.method, timeout_s or self.timeout_s
            )
            self._value = self.mode.collect_fn(self.ctx, outputs)
        return self._value

    get = result

    def done(self) -> bool:
        """True when every rank has finished (successfully or not)."""
        return self._value is not _UNSET or self.group._handles_done(self.handles)

    def __repr__(self) -> str:
        state = "done" if self._value is not _UNSET else "pending"
        return f"GroupFuture({self.group.name}.{self.method}, ranks={self.ranks}, {state})"
