"""``python``: runs model-written code in the :class:`~postrl.tools.sandbox.Sandbox`.

The observation is the program's stdout, then its stderr (each truncated to
``max_output_chars``: stdout keeps its head, stderr its tail, where tracebacks end), then — when
the run did not end normally — one ``[sandbox: status: reason]`` line, so the model sees why
(timeout, memory, output limit, refused ...). Each non-``ok`` status is counted as
``tool/python/status/<status>``.

Config keys: any :class:`~postrl.tools.sandbox.SandboxConfig` field (``wall_time_s``,
``memory_mb``, ``concurrency``, ``untrusted``, ...), plus ``max_output_chars`` (default 4000).
One sandbox (and so one concurrency pool) is shared by all instances of the tool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from postrl.tools.base import BaseTool, ToolResponse
from postrl.tools.sandbox import Sandbox, SandboxConfig

__all__ = ["PythonTool", "format_sandbox_output"]


def _truncate(text: str, limit: int, keep_tail: bool = False) -> str:
    if len(text) <= limit:
        return text
    note = f"... [truncated {len(text) - limit} characters]"
    return note + "\n" + text[-limit:] if keep_tail else text[:limit] + "\n" + note


def format_sandbox_output(res: Any, max_chars: int) -> str:
    """Observation text of a :class:`~postrl.tools.sandbox.SandboxResult`."""
    parts = []
    if res.stdout:
        parts.append(_truncate(res.stdout, max_chars))
    if res.stderr:
        parts.append("stderr:\n" + _truncate(res.stderr, max_chars, keep_tail=True))
    if res.status != "ok":
        parts.append(res.describe())
    return "\n".join(parts) if parts else "(no output)"


class PythonTool(BaseTool):
    """Execute Python code in the sandbox and return its output."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config, tool_schema)
        fields = {f.name for f in dataclasses.fields(SandboxConfig)}
        unknown = set(self.config) - fields - {"max_output_chars"}
        if unknown:
            raise ValueError(
                f"python tool config has unknown keys {sorted(unknown)}; valid keys: "
                f"{sorted(fields | {'max_output_chars'})}"
            )
        sb_kwargs = {k: v for k, v in self.config.items() if k in fields}
        for key in ("required_layers", "extra_ro_paths", "disabled_layers"):
            if key in sb_kwargs:
                sb_kwargs[key] = tuple(sb_kwargs[key])
        self.sandbox = Sandbox(SandboxConfig(**sb_kwargs))
        self.max_output_chars = int(self.config.get("max_output_chars", 4000))

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """``python(code: str)``."""
        return {
            "type": "function",
            "function": {
                "name": "python",
                "description": "Run a Python 3 program in a sandbox (no network, no files outside "
                "its working directory) and return what it prints.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {
                            "type": "string",
                            "description": "the program; use print() to show results",
                        }
                    },
                    "required": ["code"],
                },
            },
        }

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        """Run ``parameters['code']``; sandbox failures become observation text + metrics."""
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(
                "Error: 'code' must be a string",
                metrics={"tool/errors/bad_arguments": 1.0},
                error="bad_arguments",
            )
        res = await self.sandbox.run_python(code)
        metrics = {"tool/python/duration_s": res.duration_s}
        if res.status != "ok":
            metrics[f"tool/python/status/{res.status}"] = 1.0
        # A program that raises is a normal observation; limits/refusals are tool failures.
        failed = res.status not in ("ok", "error")
        return ToolResponse(
            format_sandbox_output(res, self.max_output_chars),
            metrics=metrics,
            error=res.status if failed else None,
        )
