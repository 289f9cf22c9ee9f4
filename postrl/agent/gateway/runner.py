"""Running the user's agent once per trajectory: a shell command or an async function.

:func:`run_command` starts ``rollout.agent.gateway.command`` with ``sh -c`` in a new process
group, the four ``POSTRL``/``OPENAI`` variables added to the trainer's environment; stdout and
stderr are read as they come (the last ``limit`` bytes of each are kept, the rest counted), and
at the deadline the whole group is killed (SIGTERM, then SIGKILL after 2 s).
:func:`run_entrypoint` awaits ``module:function(base_url=..., api_key=..., task=...,
task_path=..., reward_url=...)`` under the same deadline.

Both return an :class:`AgentRun`: exit code, captured output, whether the deadline passed, the
error — never raise for the agent's faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["AgentRun", "load_entrypoint", "reward_from_stdout", "run_command", "run_entrypoint"]

_KILL_GRACE_S = 2.0


@dataclass
class AgentRun:
    """What one agent run did.

    ``returncode`` is None for an entrypoint (or a killed process); ``error`` names the failure
    (``timeout``, ``exit 3``, ``exception: ...``), empty on success; ``result`` is an
    entrypoint's return value.
    """

    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    dropped_bytes: int = 0
    timed_out: bool = False
    error: str = ""
    result: Any = None


def reward_from_stdout(stdout: str) -> float | None:
    """The reward of a last stdout line ``{"reward": r}`` (None when the last line is not one)."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        obj = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    r = obj.get("reward") if isinstance(obj, dict) else None
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        return None
    return float(r) if r == r and abs(r) != float("inf") else None


class _Tail:
    """The last ``limit`` bytes of a stream, and how many were dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        self.buf += data
        extra = len(self.buf) - self.limit
        if extra > 0:
            del self.buf[:extra]
            self.dropped += extra

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


async def _pump(stream: asyncio.StreamReader | None, tail: _Tail) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        tail.add(chunk)


def _kill_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def run_command(
    command: str, env: dict[str, str], timeout_s: float, limit: int, cwd: str | None = None
) -> AgentRun:
    """Run ``command`` (see the module docstring); ``env`` is added to ``os.environ``."""
    out, err = _Tail(limit), _Tail(limit)
    proc = await asyncio.create_subprocess_shell(
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
        cwd=cwd,
        start_new_session=True,  # its own process group: the deadline kills its children too
    )
    pumps = asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err))
    run = AgentRun()
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
    except asyncio.TimeoutError:
        run.timed_out, run.error = True, f"timeout after {timeout_s:g} s"
    except asyncio.CancelledError:
        await _stop(proc)
        pumps.cancel()
        raise
    if run.timed_out:
        await _stop(proc)
    else:
        _kill_group(proc, signal.SIGKILL)  # children it left behind hold the pipes open
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(pumps, _KILL_GRACE_S)
    run.returncode = proc.returncode
    if not run.timed_out and proc.returncode != 0:
        run.error = f"exit {proc.returncode}"
    run.stdout, run.stderr = out.text(), err.text()
    run.dropped_bytes = out.dropped + err.dropped
    return run


async def _stop(proc: asyncio.subprocess.Process) -> None:
    _kill_group(proc, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), _KILL_GRACE_S)
    except asyncio.TimeoutError:
        _kill_group(proc, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), _KILL_GRACE_S)


def load_entrypoint(spec: str) -> Any:
    """The async function named ``module:function`` (``ValueError`` naming what is wrong)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(
            f"rollout.agent.gateway.entrypoint={spec!r}: expected 'module:function', e.g. "
            "'my_agents.solver:run'"
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module next to the run, as `python -m` finds it
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"rollout.agent.gateway.entrypoint={spec!r}: {module}.{name} is not an async "
            "function (define it with `async def`)"
        )
    return fn


async def run_entrypoint(fn: Any, kwargs: dict[str, Any], timeout_s: float) -> AgentRun:
    """Await ``fn(**kwargs)`` under the deadline; an exception is the run's error."""
    run = AgentRun()
    try:
        run.result = await asyncio.wait_for(fn(**kwargs), timeout_s)
    except asyncio.TimeoutError:
        run.timed_out, run.error = True, f"timeout after {timeout_s:g} s"
    except Exception as e:
        run.error = f"exception: {type(e).__name__}: {e}"
    return run
