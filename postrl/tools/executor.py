"""``ToolExecutor``: the one place the agent loop calls tools through; it never raises.

Every failure becomes an error observation (``ToolResponse.text`` starting with ``Error:``) and
a counted metric, so no trajectory wedges and nothing propagates into the rollout loop:

=============================  ==============================================================
metric                         cause
=============================  ==============================================================
``tool/errors/unknown_tool``   the model called a name no tool has
``tool/errors/bad_arguments``  arguments are not valid JSON or not a JSON object
``tool/errors/exception``      the tool raised
``tool/errors/timeout``        the tool did not finish within ``timeout_s``
``tool/errors/bad_return``     the tool returned something other than ToolResponse/str/tuple
``tool/truncated``             the observation was cut to ``max_tool_response_length`` chars
``tool/calls``, ``tool/time_s`` every call, and its wall time
=============================  ==============================================================

A tool's own metrics (``ToolResponse.metrics``) are merged into the call's metrics.

Timeouts: an ``async`` tool that awaits forever is cancelled at ``timeout_s``. A tool that
*blocks the event loop* (synchronous sleep or CPU work inside ``execute``) cannot be cancelled
from the loop; such a tool sets the class attribute ``run_in_thread = True`` and the executor
runs each call on a worker thread with its own event loop, so a hang costs one thread, never the
trainer. (Tools holding loop-bound resources, like the sandbox pool, keep the default.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any

from postrl.tools.base import BaseTool, ToolResponse

logger = logging.getLogger(__name__)

__all__ = ["ToolExecutor"]


def _error(kind: str, text: str, **extra: float) -> ToolResponse:
    return ToolResponse(f"Error: {text}", 0.0, {f"tool/errors/{kind}": 1.0, **extra}, error=kind)


class ToolExecutor:
    """Executes tool calls by name for the agent loop.

    Args:
        tools: ``{name: tool}`` (e.g. from :func:`~postrl.tools.config.load_tool_config`) or a
            list of tools (keyed by their schema's function name).
        max_tool_response_length: observation length cap, in characters.
        timeout_s: default per-call time limit.
    """

    def __init__(
        self,
        tools: dict[str, BaseTool] | list[BaseTool],
        max_tool_response_length: int = 4096,
        timeout_s: float = 30.0,
        max_response_chars: int | None = None,
    ) -> None:
        if isinstance(tools, list):
            tools = {t.name: t for t in tools}
        self.tools = dict(tools)
        self.max_tool_response_length = int(max_response_chars or max_tool_response_length)
        self.timeout_s = float(timeout_s)
        self.metrics: Counter[str] = Counter()
        """Cumulative counts/sums of every call's metrics (for health reporting)."""
        self._created: set[tuple[str, str]] = set()

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas, for ``apply_chat_template(..., tools=...)``."""
        return [t.tool_schema for t in self.tools.values()]

    async def create(
        self, instance_id: str | None = None, tools_kwargs: dict[str, dict[str, Any]] | None = None
    ) -> str:
        """Create per-trajectory state in every tool; returns the instance id.

        ``tools_kwargs`` maps tool name -> ``create_kwargs`` (verl's per-row ``tools_kwargs``).
        """
        instance_id = instance_id or uuid.uuid4().hex
        for name, tool in self.tools.items():
            kwargs = (tools_kwargs or {}).get(name) or {}
            kwargs = (
                (kwargs.get("create_kwargs") or {}) if "create_kwargs" in kwargs else kwargs
            )  # null after parquet
            await tool.create(instance_id, **kwargs)
            self._created.add((name, instance_id))
        return instance_id

    async def execute(
        self,
        call: Any,
        instance_id: str,
        instances: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> ToolResponse:
        """Agent-loop entry: ``call`` is a parsed ``ToolCall``, a ``(name, arguments)`` pair or a
        ``{"name", "arguments"}`` dict; ``instances`` (the trajectory's dict) records which tools
        were used. Same guarantees as :meth:`execute_tool_call`."""
        if isinstance(call, dict):
            name, args = call.get("name"), call.get("arguments")
        else:
            try:
                name, args = call
            except (TypeError, ValueError):
                name, args = getattr(call, "name", None), getattr(call, "arguments", None)
        if not isinstance(name, str):
            resp = self._cap(_error("bad_arguments", f"malformed tool call {call!r}"))
            resp.metrics["tool/calls"] = 1.0
            self.metrics.update(resp.metrics)
            return resp
        if instances is not None:
            instances.setdefault(name, instance_id)
        return await self.execute_tool_call(name, args, instance_id, timeout_s)

    async def release(self, instance_id: str, instances: dict[str, Any] | None = None) -> float:
        """Sum the tools' ``calc_reward`` for the trajectory and release their state.

        ``instances`` is accepted for the agent loop's signature; every tool created for
        ``instance_id`` is released. Errors are logged and counted (``tool/errors/release``),
        never raised."""
        total = 0.0
        for name, tool in self.tools.items():
            if (name, instance_id) not in self._created:
                continue
            self._created.discard((name, instance_id))
            try:
                total += float(await tool.calc_reward(instance_id))
                await tool.release(instance_id)
            except Exception:  # noqa: BLE001
                logger.exception("tool %r failed to release instance %s", name, instance_id)
                self.metrics["tool/errors/release"] += 1
        return total

    async def execute_tool_call(
        self,
        name: str,
        arguments: str | dict[str, Any] | None,
        instance_id: str,
        timeout_s: float | None = None,
    ) -> ToolResponse:
        """Run one call; any failure comes back as an error observation, never an exception."""
        t0 = time.monotonic()
        resp = await self._execute(
            name, arguments, instance_id, self.timeout_s if timeout_s is None else timeout_s
        )
        resp = self._cap(resp)
        resp.metrics["tool/calls"] = 1.0
        resp.metrics["tool/time_s"] = time.monotonic() - t0
        self.metrics.update(resp.metrics)
        return resp

    async def _execute(
        self, name: str, arguments: Any, instance_id: str, timeout_s: float
    ) -> ToolResponse:
        tool = self.tools.get(name)
        if tool is None:
            return _error(
                "unknown_tool",
                f"unknown tool {name!r}; available tools: "
                f"{', '.join(sorted(self.tools)) or '(none)'}",
            )
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return _error("bad_arguments", f"arguments of {name!r} are not valid JSON ({e})")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return _error(
                "bad_arguments",
                f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}",
            )
        try:
            if (name, instance_id) not in self._created:
                await asyncio.wait_for(tool.create(instance_id), timeout=timeout_s)
                self._created.add((name, instance_id))
            if getattr(tool, "run_in_thread", False):
                coro = asyncio.to_thread(asyncio.run, tool.execute(instance_id, arguments))
            else:
                coro = tool.execute(instance_id, arguments)
            out = await asyncio.wait_for(coro, timeout=timeout_s)
        except asyncio.TimeoutError:
            return _error("timeout", f"tool {name!r} did not finish within {timeout_s:g}s")
        except Exception as e:  # noqa: BLE001 - isolate every tool failure
            logger.warning("tool %r raised: %s", name, e, exc_info=True)
            msg = str(e)[:500]
            return _error("exception", f"tool {name!r} failed: {type(e).__name__}: {msg}")
        return self._coerce(name, out)

    @staticmethod
    def _coerce(name: str, out: Any) -> ToolResponse:
        if isinstance(out, str):
            out = ToolResponse(out)
        elif isinstance(out, tuple) and len(out) == 3:  # verl's (text, reward, metrics)
            out = ToolResponse(out[0], out[1], dict(out[2] or {}))
        if not isinstance(out, ToolResponse) or not isinstance(out.text, str):
            got = type(out.text if isinstance(out, ToolResponse) else out).__name__
            return _error("bad_return", f"tool {name!r} returned {got}, expected text")
        try:
            reward = float(out.reward_delta)
            metrics = {str(k): float(v) for k, v in (out.metrics or {}).items()}
        except (TypeError, ValueError):
            return _error("bad_return", f"tool {name!r} returned a non-numeric reward or metric")
        return ToolResponse(out.text, reward, metrics, error=out.error)

    def _cap(self, resp: ToolResponse) -> ToolResponse:
        limit = self.max_tool_response_length
        if len(resp.text) > limit:
            note = f"\n... [truncated {len(resp.text) - limit} characters]"
            resp.text = (
                resp.text[: limit - len(note)] + note
                if limit > 2 * len(note)
                else resp.text[:limit]
            )
            resp.metrics["tool/truncated"] = 1.0
        return resp
