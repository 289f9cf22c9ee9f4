"""Lending a process's idle cores to another process on the same machine.

Two processes split the cores: an **owner** (a rollout replica process with ``threads`` torch
threads of its own) and a **borrower** (the trainer). While the owner has no work, the borrower
computes on the owner's cores too; as soon as the owner has work again it gets them back within
one of the borrower's compute chunks (the borrower polls between chunks, e.g. decoder layers).
Without this, a pure-compute workload leaves the owner's cores idle whenever it waits for the
next policy version, and the borrower trains on its own cores only.

Two ``flock`` files per owner, ``<name>.busy`` and ``<name>.lent``, in one directory:

- the owner holds ``busy`` (exclusive) while it has work: its "I want my cores back";
- whoever computes on the owner's cores holds ``lent``: the owner while it works, the borrower
  while it borrows. The owner takes ``busy`` first, then waits for ``lent``; the borrower takes
  ``lent`` only when ``busy`` is free and gives it back at its next poll after ``busy`` is taken.

The kernel drops a process's locks when it dies, so a killed owner or borrower never leaves the
other waiting; the owner's wait also has a deadline, after which it works anyway (counted in
:attr:`CoreOwner.timeouts`). Torch-free: the borrower's thread switching lives with its compute
(:mod:`postrl.engine.lending`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["CoreBorrower", "CoreOwner", "lease_paths"]

_POLL_S = 0.0005
"""How often a waiting owner tries ``lent`` again (seconds)."""


def lease_paths(directory: str | Path, name: str) -> tuple[Path, Path]:
    """``(busy, lent)`` lock files of owner ``name`` in ``directory``."""
    d = Path(directory)
    return d / f"{name}.busy", d / f"{name}.lent"


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_CREAT | os.O_RDWR, 0o600)


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass
class _Lease:
    """One owner's files as the borrower holds them."""

    busy: int
    lent: int
    threads: int
    held: bool = False


def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class CoreOwner:
    """The owner's side, for an asyncio server: ``async with owner.working():`` around each
    request's compute. The first request to enter claims the cores (waits until the borrower gave
    them back: at most one of its chunks), the last to leave lends them again.

    Args:
        directory: the lease directory (shared with the borrower).
        name: this owner's name in it (e.g. ``replica-0``).
        timeout_s: the longest wait for the cores; after it the owner works anyway (counted).
    """

    def __init__(self, directory: str | Path, name: str, *, timeout_s: float = 60.0) -> None:
        busy, lent = lease_paths(directory, name)
        self._busy, self._lent = _open(busy), _open(lent)
        self.name = name
        self.timeout_s = float(timeout_s)
        self.waited_s = 0.0
        """Seconds spent waiting for the cores to come back, in total."""
        self.claims = 0
        """Times the owner claimed its cores (idle → working)."""
        self.timeouts = 0
        """Claims that gave up waiting after ``timeout_s`` and worked anyway."""
        self._users = 0
        self._held = False
        self._claim: asyncio.Task[None] | None = None

    def working(self) -> _Working:
        """Async context manager: hold the cores while at least one caller is inside."""
        return _Working(self)

    async def _claim_cores(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        got = False
        while time.monotonic() < deadline:  # the borrower probes busy only for a moment
            if _try(self._busy, fcntl.LOCK_EX):
                got = True
                break
            await asyncio.sleep(_POLL_S)
        while got and not _try(self._lent, fcntl.LOCK_EX):
            if time.monotonic() >= deadline:
                got = False
                break
            await asyncio.sleep(_POLL_S)
        self.waited_s += time.monotonic() - t0
        self.claims += 1
        if not got:
            self.timeouts += 1
            logger.warning(
                "core lease %s: the borrower kept the cores past %.0f s; working without them",
                self.name,
                self.timeout_s,
            )
        self._held = True
        self._claim = None
        if self._users == 0:  # every caller left while it waited
            self._release()

    def _release(self) -> None:
        fcntl.flock(self._lent, fcntl.LOCK_UN)
        fcntl.flock(self._busy, fcntl.LOCK_UN)
        self._held = False

    def close(self) -> None:
        """Release the lease and close its files."""
        _close(self._lent, self._busy)


class _Working:
    def __init__(self, owner: CoreOwner) -> None:
        self.owner = owner

    async def __aenter__(self) -> None:
        o = self.owner
        o._users += 1
        if not o._held and o._claim is None:
            o._claim = asyncio.get_running_loop().create_task(o._claim_cores())
        if o._claim is not None:
            try:
                await asyncio.shield(o._claim)
            except BaseException:
                await self.__aexit__(None, None, None)
                raise

    async def __aexit__(self, *exc: object) -> None:
        o = self.owner
        o._users -= 1
        if o._users == 0 and o._held and o._claim is None:
            o._release()


class CoreBorrower:
    """The borrower's side, for one thread that computes in chunks: :meth:`poll` between chunks
    returns how many extra threads it may use now; :meth:`release` when its compute ends.

    Args:
        directory: the lease directory.
        owners: ``{name: threads}`` of the owners whose cores may be borrowed.
    """

    def __init__(self, directory: str | Path, owners: dict[str, int]) -> None:
        self._owners = [
            _Lease(*(_open(p) for p in lease_paths(directory, name)), int(threads))
            for name, threads in owners.items()
        ]
        self.borrowed_s = 0.0
        """Seconds during which at least one owner's cores were borrowed, in total."""
        self._since: float | None = None

    def poll(self) -> int:
        """Borrow every idle owner's cores, give back those whose owner has work; returns the
        extra threads held now."""
        extra = 0
        for o in self._owners:
            idle = _try(o.busy, fcntl.LOCK_SH)
            if idle:
                fcntl.flock(o.busy, fcntl.LOCK_UN)
            if o.held and not idle:
                fcntl.flock(o.lent, fcntl.LOCK_UN)
                o.held = False
            elif idle and not o.held:
                o.held = _try(o.lent, fcntl.LOCK_EX)
            extra += o.threads if o.held else 0
        self._mark(extra > 0)
        return extra

    def release(self) -> None:
        """Give back everything borrowed."""
        for o in self._owners:
            if o.held:
                fcntl.flock(o.lent, fcntl.LOCK_UN)
                o.held = False
        self._mark(False)

    def _mark(self, holding: bool) -> None:
        now = time.perf_counter()
        if holding and self._since is None:
            self._since = now
        elif not holding and self._since is not None:
            self.borrowed_s += now - self._since
            self._since = None

    def close(self) -> None:
        """Release and close the lock files."""
        self.release()
        for o in self._owners:
            _close(o.busy, o.lent)
