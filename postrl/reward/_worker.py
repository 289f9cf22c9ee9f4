"""Entry point of a reward worker process (spawned; imports nothing heavy).

Protocol over one duplex pipe:
  worker -> parent: ``("ready", pid)`` once, then ``(task_id, status, payload)`` per task with
  status ``"ok"`` (payload: the function's return value), ``"exception"`` (payload: the formatted
  traceback) or ``"bad_type"`` (payload: why the return value could not be sent back).
  parent -> worker: ``(task_id, fn_spec, args, kwargs)`` or ``None`` to exit.

``fn_spec`` is ``("path", file, name)`` (a user file, loaded with
:func:`postrl.reward.custom.load_custom_reward_fn`) or ``("ref", module, qualname)`` (an
importable function). Resolved functions are cached for the worker's lifetime.
"""

from __future__ import annotations

import importlib
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

FnSpec = tuple[str, str, str]


def resolve_fn(spec: FnSpec, cache: dict[FnSpec, Callable[..., Any]]) -> Callable[..., Any]:
    """Return the function named by ``spec`` (see module docstring), cached in ``cache``."""
    if spec in cache:
        return cache[spec]
    kind, where, name = spec
    if kind == "path":
        from postrl.reward.custom import load_custom_reward_fn

        fn = load_custom_reward_fn(where, name)
    elif kind == "ref":
        obj: Any = importlib.import_module(where)
        for part in name.split("."):
            obj = getattr(obj, part)
        fn = obj
    else:
        raise ValueError(f"unknown reward fn spec kind {kind!r}")
    cache[spec] = fn
    return fn


def worker_main(conn: Any) -> None:
    """Serve scoring tasks from ``conn`` until ``None`` arrives or the pipe closes."""
    cache: dict[FnSpec, Callable[..., Any]] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, spec, args, kwargs = msg
        try:
            value = resolve_fn(spec, cache)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - report anything the user function raises
            # drop this loop's own frame: the traceback starts in the user's code
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            conn.send((task_id, "exception", tb))
            continue
        try:
            payload = pickle.dumps((task_id, "ok", value))
        except Exception as e:  # unpicklable return value
            conn.send(
                (
                    task_id,
                    "bad_type",
                    f"return value of type {type(value).__name__} "
                    f"cannot be sent to the trainer: {e}",
                )
            )
            continue
        conn.send_bytes(payload)
