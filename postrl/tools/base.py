"""Tool interface: ``BaseTool`` with an OpenAI function-calling schema, and the tool registry.

A tool's life per trajectory (verl's ``BaseTool`` contract)::

    iid = await tool.create(instance_id, **create_kwargs)     # per-trajectory state
    resp = await tool.execute(iid, {"expression": "2**100"})  # -> ToolResponse, any number
                                                              #    of times
    bonus = await tool.calc_reward(iid)                       # optional tool-level reward
    await tool.release(iid)                                   # free the state

Users add tools by subclassing ``BaseTool`` and either registering a name with
:func:`register_tool` or naming the class by import path (``"my_pkg.tools:MyTool"``) in a tool
config file (see :mod:`postrl.tools.config`). The agent loop never special-cases a tool name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrl.registry import Registry

__all__ = ["TOOLS", "BaseTool", "ToolResponse", "register_tool", "validate_tool_schema"]

#: name -> BaseTool subclass. Built-ins are registered lazily by import path.
TOOLS: Registry[type[BaseTool]] = Registry("tool")


def register_tool(name: str, *, override: bool = False):
    """Class decorator registering a :class:`BaseTool` subclass under ``name``."""
    return TOOLS.register(name, override=override)


@dataclass
class ToolResponse:
    """What one tool call returns to the agent loop.

    Attributes:
        text: the observation shown to the model (already truncated by the executor).
        reward_delta: step reward contributed by this call (0.0 for most tools).
        metrics: numeric per-call metrics, ``<component>/<name>`` keys (e.g.
            ``tool/errors/timeout``).
    """

    text: str
    reward_delta: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """Set by the executor when the call failed: the failure kind (``timeout``, ...)."""


def validate_tool_schema(schema: dict[str, Any]) -> list[str]:
    """Return problems with an OpenAI function-calling schema (empty list when valid).

    Expected shape::

        {"type": "function",
         "function": {"name": str, "description": str,
                      "parameters": {"type": "object", "properties": {...}, "required": [...]}}}
    """
    errors: list[str] = []
    if not isinstance(schema, dict):
        return [f"tool_schema must be a mapping, got {type(schema).__name__}"]
    if schema.get("type") != "function":
        errors.append(f"tool_schema.type must be 'function', got {schema.get('type')!r}")
    fn = schema.get("function")
    if not isinstance(fn, dict):
        return errors + ["tool_schema.function must be a mapping with name/description/parameters"]
    if not isinstance(fn.get("name"), str) or not fn.get("name"):
        errors.append("tool_schema.function.name must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        errors.append("tool_schema.function.parameters must be a JSON schema with type 'object'")
    else:
        props = params.get("properties", {})
        missing = [r for r in params.get("required", []) if r not in props]
        if missing:
            errors.append(
                f"tool_schema.function.parameters.required names {missing} which are "
                f"not in properties {sorted(props)}"
            )
    return errors


class BaseTool:
    """Base class of tools; subclasses implement :meth:`execute` (and optionally the rest).

    Args:
        config: tool settings from the tool config file (``config:`` block).
        tool_schema: OpenAI function-calling schema; ``None`` uses :meth:`default_schema`.
    """

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        self.config = dict(config or {})
        schema = tool_schema or self.default_schema()
        problems = validate_tool_schema(schema)
        if problems:
            raise ValueError(f"{type(self).__name__}: invalid tool schema: " + "; ".join(problems))
        self.tool_schema = schema
        self._instances: dict[str, dict[str, Any]] = {}

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """Schema used when the config gives none; built-in tools override this."""
        raise ValueError(f"{cls.__name__} has no default tool_schema; give one in the tool config")

    @property
    def name(self) -> str:
        """The function name the model calls (``tool_schema.function.name``)."""
        return self.tool_schema["function"]["name"]

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        """Start per-trajectory state (``kwargs`` come from the row's ``tools_kwargs``)."""
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        """Run the tool once; must return a :class:`ToolResponse` (or a plain string)."""
        raise NotImplementedError

    async def calc_reward(self, instance_id: str) -> float:
        """Tool-level reward for the trajectory (default 0)."""
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Free the per-trajectory state."""
        self._instances.pop(instance_id, None)


# Built-in tools: registered by import path, imported on first use (their modules do not
# self-register, so importing them directly is fine too).
TOOLS.add_lazy("calculator", "postrl.tools.calculator:CalculatorTool")
TOOLS.add_lazy("python", "postrl.tools.python_tool:PythonTool")
TOOLS.add_lazy("search", "postrl.tools.search:SearchTool", extra="search")
