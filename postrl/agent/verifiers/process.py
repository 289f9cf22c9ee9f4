"""The verifiers worker process seen from postrl: start, request/reply, deadlines, shutdown.

:class:`WorkerProcess` starts :mod:`postrl.agent.verifiers.worker` with the verifiers venv's
python in a process group of its own (the harness programs and MCP tool servers the environment
starts are in it too), sends ``init`` and waits for ``ready`` under a deadline. Requests carry
an id; one reader task hands replies to their waiters. stderr is drained into a capped tail
(logged at DEBUG, quoted in errors). When the process dies every waiter fails at once with
:class:`WorkerError` naming the exit status and the stderr tail — nothing waits on a dead
process; the next trajectory starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
from collections import deque
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["WORKER_SCRIPT", "WorkerError", "WorkerProcess"]

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
_LINE_LIMIT = 1 << 28
_STDERR_TAIL = 60
_STOP_GRACE_S = 10.0


class WorkerError(RuntimeError):
    """The verifiers worker failed to start, died, or answered a request with an error."""


class WorkerProcess:
    """One running verifiers worker (module docstring).

    Args:
        python: the verifiers venv's interpreter.
        env: extra environment variables (``PYTHONPATH``, the token route's key, ...).
        init: the ``init`` message (``env``, ``client``, ``model``).
    """

    def __init__(self, python: str, env: dict[str, str], init: dict[str, Any]) -> None:
        self.python = python
        self.env = env
        self.init = init
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] = {}
        self.stderr: deque[str] = deque(maxlen=_STDERR_TAIL)
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[Any]] = []
        self._dead: str = ""

    @property
    def alive(self) -> bool:
        """Whether the process runs and answers."""
        return self.proc is not None and self.proc.returncode is None and not self._dead

    def tail(self) -> str:
        """The last lines the worker wrote to stderr."""
        return "\n".join(self.stderr)

    async def start(self, timeout_s: float) -> dict[str, Any]:
        """Start the process and wait for ``ready`` (raises :class:`WorkerError` with the
        stderr tail if it fails or takes longer than ``timeout_s``)."""
        self.proc = await asyncio.create_subprocess_exec(
            self.python,
            str(WORKER_SCRIPT),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.env},
            start_new_session=True,
            limit=_LINE_LIMIT,
        )
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._waiters["__ready__"] = ready
        self._tasks = [
            loop.create_task(self._read_stdout()),
            loop.create_task(self._read_stderr()),
        ]
        self._write(self.init)
        try:
            self.ready = await asyncio.wait_for(ready, timeout_s)
        except TimeoutError:
            await self.close()
            raise WorkerError(
                f"the verifiers worker did not get ready in {timeout_s:g} s "
                "(rollout.agent.verifiers.startup_timeout_s); stderr tail:\n" + self.tail()
            ) from None
        except WorkerError:
            await self.close()
            raise
        return self.ready

    async def request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``msg`` (an ``id`` is added) and wait for its reply; at the deadline the
        request is cancelled in the worker and ``TimeoutError`` raised."""
        if not self.alive:
            raise WorkerError("the verifiers worker is not running:\n" + self.tail())
        rid = f"q{next(self._ids)}"
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            try:
                self._write({**msg, "id": rid})
            except Exception as e:  # the pipe broke: the worker is going away
                raise WorkerError(f"cannot write to the verifiers worker ({e!r})") from e
            return await asyncio.wait_for(fut, timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            if self.alive:
                with contextlib.suppress(Exception):
                    self._write({"op": "cancel", "id": rid})
            raise
        finally:
            self._waiters.pop(rid, None)

    def _write(self, msg: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    logger.warning("verifiers worker: not a protocol line: %r", line[:200])
                    continue
                self._deliver(msg)
        finally:
            status = await self.proc.wait()
            self._dead = f"exit status {status}"
            err = WorkerError(
                f"the verifiers worker exited ({self._dead}); stderr tail:\n" + self.tail()
            )
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(err)

    def _deliver(self, msg: dict[str, Any]) -> None:
        op, rid = msg.get("op"), msg.get("id")
        if op == "ready" or (op == "error" and rid is None):
            rid = "__ready__"
        fut = self._waiters.get(rid) if isinstance(rid, str) else None
        if fut is None or fut.done():
            if op == "error":
                logger.warning("verifiers worker: %s", msg.get("message"))
            return
        if op == "error":
            fut.set_exception(WorkerError(f"{msg.get('message')}\nstderr tail:\n{self.tail()}"))
        else:
            fut.set_result(msg)

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.stderr.append(text[:2000])
            logger.debug("verifiers worker: %s", text)

    def kill(self) -> None:
        """Kill the process group at once (no shutdown; for a worker of another event loop)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Ask the worker to stop (it tears ``env.serving()`` down), then kill its process
        group if it is still there after 10 s."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(Exception):
                self._write({"op": "shutdown"})
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
            except TimeoutError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group: harness programs, tool servers
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
