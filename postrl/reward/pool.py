"""A pool of long-lived, killable reward worker processes (``spawn`` start method).

Why not :class:`concurrent.futures.ProcessPoolExecutor`: it cannot kill one hung task (a task
past its deadline would hold a worker forever, and shutting the executor down waits on it).
Here each worker has its own pipe and at most one task in flight, so the dispatcher knows which
process runs which task; a task past its deadline gets its process SIGKILLed and replaced
(never waited on), and a worker that dies mid-task is replaced and its task reported as
``crash``. Workers are started once and reused across calls, so the spawn cost (~0.1-0.5 s per
process) is paid once per run.

One dispatcher thread owns every process and pipe; :meth:`WorkerPool.submit` only appends to a
queue and wakes it through a self-pipe, so it is safe to call from any thread.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from postrl.reward._worker import FnSpec, worker_main

__all__ = ["Outcome", "WorkerPool", "WorkerPoolError"]

log = logging.getLogger(__name__)


class WorkerPoolError(RuntimeError):
    """The pool is closed, or its workers cannot start (the message says why)."""


@dataclass(frozen=True)
class Outcome:
    """What happened to one task: ``status`` is ok | exception | bad_type | timeout | crash."""

    status: str
    value: Any = None
    error: str | None = None


@dataclass
class _Task:
    id: int
    spec: FnSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout_s: float
    future: Future[Outcome]


class _Slot:
    """One worker process, its pipe, and the task it is running (if any)."""

    def __init__(self, ctx: Any, index: int) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=worker_main, args=(child,), daemon=True, name=f"postrl-reward-{index}"
        )
        self.proc.start()
        child.close()
        self.conn = parent
        self.ready = False
        self.task: _Task | None = None
        self.deadline = float("inf")

    def kill(self) -> None:
        """SIGKILL the process and reap it (a killed process exits at once)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=2.0)
        self.conn.close()


class WorkerPool:
    """``num_workers`` spawned processes serving ``(fn_spec, args, kwargs)`` tasks with deadlines.

    Args:
        num_workers: processes to keep alive.
        start_timeout_s: a worker that does not report ready within this many seconds is
            killed; after ``max_start_failures`` such (or early-exit) failures in a row, all
            queued tasks fail with :class:`WorkerPoolError`.
    """

    def __init__(
        self, num_workers: int, start_timeout_s: float = 60.0, max_start_failures: int = 3
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.start_timeout_s = start_timeout_s
        self.max_start_failures = max_start_failures
        self.stats = {"spawned": 0, "killed_timeout": 0, "crashed": 0}
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: collections.deque[_Task] = collections.deque()
        self._ids = itertools.count()
        self._slots: list[_Slot] = []
        self._start_deadlines: dict[int, float] = {}
        self._start_failures = 0
        self._closed = False
        self._broken: str | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        """Spawn the workers and the dispatcher thread (idempotent)."""
        with self._lock:
            if self._closed:
                raise WorkerPoolError("reward worker pool is closed")
            if self._thread is not None:
                return
            for i in range(self.num_workers):
                self._slots.append(self._spawn(i))
            self._thread = threading.Thread(
                target=self._run, name="postrl-reward-dispatch", daemon=True
            )
            self._thread.start()

    def submit(
        self, spec: FnSpec, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
    ) -> Future[Outcome]:
        """Queue one call; the future resolves to an :class:`Outcome` within ``timeout_s`` of
        the call reaching a worker (a queued call waits for a free worker first)."""
        self.start()
        fut: Future[Outcome] = Future()
        with self._lock:
            if self._closed:
                raise WorkerPoolError("reward worker pool is closed")
            if self._broken is not None:
                raise WorkerPoolError(self._broken)
            self._pending.append(_Task(next(self._ids), spec, args, kwargs, timeout_s, fut))
        os.write(self._wake_w, b"x")
        return fut

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the dispatcher, ask workers to exit, kill any still alive after ``timeout_s``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        for slot in self._slots:
            try:
                slot.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for slot in self._slots:
            slot.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            slot.kill()
            if slot.task is not None and not slot.task.future.done():
                slot.task.future.set_exception(WorkerPoolError("reward worker pool closed"))
        for task in self._pending:
            if not task.future.done():
                task.future.set_exception(WorkerPoolError("reward worker pool closed"))
        self._pending.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def pids(self) -> list[int | None]:
        """Current worker process ids (changes when a worker is replaced)."""
        return [s.proc.pid for s in self._slots]

    # ------------------------------------------------------------------ dispatcher
    def _spawn(self, index: int) -> _Slot:
        slot = _Slot(self._ctx, index)
        self.stats["spawned"] += 1
        self._start_deadlines[id(slot)] = time.monotonic() + self.start_timeout_s
        return slot

    def _run(self) -> None:
        while not self._closed and self._broken is None:
            self._assign()
            now = time.monotonic()
            deadlines = [s.deadline for s in self._slots if s.task is not None]
            deadlines += [self._start_deadlines.get(id(s), now) for s in self._slots if not s.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            waitables: list[Any] = [self._wake_r]
            for s in self._slots:
                waitables += [s.conn, s.proc.sentinel]
            ready = mpc.wait(waitables, timeout=wait_s)
            if self._wake_r in ready:
                self._drain_wake()
            for i, slot in enumerate(list(self._slots)):
                if slot.conn in ready or slot.proc.sentinel in ready:
                    self._service(i, slot)
            self._expire()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _assign(self) -> None:
        for i, slot in enumerate(self._slots):
            if not slot.ready or slot.task is not None:
                continue
            with self._lock:
                if not self._pending:
                    return
                task = self._pending.popleft()
            if not task.future.set_running_or_notify_cancel():
                continue
            try:
                slot.conn.send((task.id, task.spec, task.args, task.kwargs))
            except (OSError, ValueError):  # worker died between tasks: retry elsewhere
                with self._lock:
                    self._pending.appendleft(task)
                self._replace(i, slot, reason=None)
                continue
            slot.task = task
            slot.deadline = time.monotonic() + task.timeout_s

    def _service(self, i: int, slot: _Slot) -> None:
        try:
            while slot.conn.poll():
                self._handle(slot, slot.conn.recv())
        except (EOFError, OSError):
            pass
        except Exception as e:  # a return value the parent cannot unpickle
            if slot.task is not None:
                self._finish(slot, Outcome("bad_type", error=f"cannot unpickle result: {e}"))
        if not slot.proc.is_alive():
            slot.proc.join(timeout=0)
            code = slot.proc.exitcode
            if not slot.ready:
                self._start_failures += 1
                log.warning("reward worker %d exited during startup (exit code %s)", i, code)
            self._replace(i, slot, reason=f"reward worker process died (exit code {code})")

    def _handle(self, slot: _Slot, msg: Any) -> None:
        if msg[0] == "ready":
            slot.ready = True
            self._start_failures = 0
            self._start_deadlines.pop(id(slot), None)
            return
        task_id, status, payload = msg
        if slot.task is None or slot.task.id != task_id:
            return
        if status == "ok":
            self._finish(slot, Outcome("ok", value=payload))
        else:
            self._finish(slot, Outcome(status, error=str(payload)))

    def _finish(self, slot: _Slot, outcome: Outcome) -> None:
        task, slot.task, slot.deadline = slot.task, None, float("inf")
        if task is not None and not task.future.done():
            task.future.set_result(outcome)

    def _expire(self) -> None:
        now = time.monotonic()
        for i, slot in enumerate(list(self._slots)):
            if slot.task is not None and now >= slot.deadline:
                self.stats["killed_timeout"] += 1
                task, slot.task, slot.deadline = slot.task, None, float("inf")
                # replace before resolving: whoever waits on the result sees the new worker
                self._replace(i, slot, reason=None)
                if not task.future.done():
                    task.future.set_result(
                        Outcome("timeout", error=f"exceeded timeout_s={task.timeout_s:g}")
                    )
            elif not slot.ready and now >= self._start_deadlines.get(id(slot), float("inf")):
                self._start_failures += 1
                log.warning("reward worker %d did not start within %ss", i, self.start_timeout_s)
                self._replace(i, slot, reason=None)

    def _replace(self, i: int, slot: _Slot, reason: str | None) -> None:
        if slot.task is not None:
            self.stats["crashed"] += 1
            self._finish(slot, Outcome("crash", error=reason or "reward worker process died"))
        self._start_deadlines.pop(id(slot), None)
        slot.kill()
        if self._start_failures >= self.max_start_failures:
            with self._lock:
                self._broken = (
                    f"reward workers failed to start {self._start_failures} times in a row (see "
                    f"the log above); check that the reward function's module and the main "
                    f"script import cleanly in a fresh process (spawn start method)"
                )
            self._fail_pending(self._broken)
            return
        self._slots[i] = self._spawn(i)

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            tasks, self._pending = list(self._pending), collections.deque()
        for task in tasks:
            if not task.future.done():
                task.future.set_exception(WorkerPoolError(why))
