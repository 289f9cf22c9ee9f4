"""Tool config files (verl-like) -> instantiated tools.

Format (YAML or the equivalent list of dicts)::

    tools:
      - class_name: calculator                        # a registered name ...
        config: {max_digits: 2000}
      - class_name: my_pkg.tools:WeatherTool          # ... or an import path (module:Class
        config: {api_key_env: WEATHER_KEY}            #     or module.Class, as in verl)
        tool_schema:                                  # OpenAI function schema; optional for
          type: function                              # tools with a default_schema()
          function: {name: weather, description: ..., parameters: {...}}

All problems (unknown class, bad schema, duplicate tool names) are collected and raised together,
each naming the entry index and the fix.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from postrl.tools.base import TOOLS, BaseTool

__all__ = [
    "ToolConfigError",
    "create_tools",
    "load_tool_config",
    "load_tools",
    "resolve_tool_class",
]


class ToolConfigError(ValueError):
    """The tool config is invalid; the message lists every problem found."""


def resolve_tool_class(class_name: str) -> type[BaseTool]:
    """A registered tool name, ``"module:Class"`` or ``"module.Class"`` -> the class."""
    if class_name in TOOLS:
        return TOOLS.get(class_name)
    if ":" in class_name:
        module_name, _, attr = class_name.partition(":")
    elif "." in class_name:
        module_name, _, attr = class_name.rpartition(".")
    else:
        TOOLS.get(class_name)  # raises the registry's did-you-mean error
        raise AssertionError("unreachable")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise TypeError(f"{class_name!r} is not a BaseTool subclass")
    return cls


def load_tool_config(
    source: str | Path | list[dict[str, Any]] | dict[str, Any],
) -> dict[str, BaseTool]:
    """Instantiate the tools described by a YAML file path, a ``{"tools": [...]}`` mapping or
    a list of entries; returns ``{function name: tool}``."""
    if isinstance(source, (str, Path)):
        import yaml

        path = Path(source)
        if not path.exists():
            raise ToolConfigError(f"tool config file {str(path)!r} does not exist")
        source = yaml.safe_load(path.read_text()) or {}
    entries = source.get("tools", []) if isinstance(source, dict) else source
    if not isinstance(entries, list):
        raise ToolConfigError(f"tool config must be a list under 'tools:', got {type(entries)}")
    tools: dict[str, BaseTool] = {}
    errors: list[str] = []
    for i, entry in enumerate(entries):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            errors.append(f"{where}: needs 'class_name' (a registered tool name or module:Class)")
            continue
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            errors.append(
                f"{where}: unknown keys {sorted(unknown)}; allowed: class_name, config, tool_schema"
            )
        try:
            cls = resolve_tool_class(str(entry["class_name"]))
            tool = cls(config=entry.get("config") or {}, tool_schema=entry.get("tool_schema"))
        except Exception as e:  # noqa: BLE001 - collect every problem, report together
            errors.append(f"{where} ({entry['class_name']}): {type(e).__name__}: {e}")
            continue
        if tool.name in tools:
            errors.append(
                f"{where}: duplicate tool name {tool.name!r}; give one of them another "
                "tool_schema.function.name"
            )
            continue
        tools[tool.name] = tool
    if errors:
        raise ToolConfigError("invalid tool config:\n  " + "\n  ".join(errors))
    return tools


#: Alias used by the agent loop.
load_tools = load_tool_config


def create_tools(entries: list[str | dict[str, Any]]) -> dict[str, BaseTool]:
    """Tools from registered names (default settings) and/or config entries, e.g.
    ``create_tools(["calculator", {"class_name": "python", "config": {"wall_time_s": 2}}])``."""
    return load_tool_config([{"class_name": e} if isinstance(e, str) else e for e in entries])
