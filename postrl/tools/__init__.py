"""postrl.tools — tools with OpenAI schemas, the tool executor, call parsers and the sandbox.

Public API::

    from postrl.tools import (BaseTool, ToolResponse, TOOLS, register_tool, load_tool_config,
                              ToolExecutor, TOOL_PARSERS, get_tool_parser, Sandbox, SandboxConfig)

See ``docs/tools.md`` for the tool config format, the sandbox's isolation layers and metrics.
"""

from postrl.tools.base import TOOLS, BaseTool, ToolResponse, register_tool, validate_tool_schema
from postrl.tools.config import (
    ToolConfigError,
    create_tools,
    load_tool_config,
    load_tools,
    resolve_tool_class,
)
from postrl.tools.executor import ToolExecutor
from postrl.tools.parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    ParseError,
    ParseResult,
    ToolCall,
    get_tool_parser,
)
from postrl.tools.sandbox import IsolationReport, Sandbox, SandboxConfig, SandboxResult

__all__ = [
    "TOOLS",
    "TOOL_PARSERS",
    "BaseTool",
    "HermesToolParser",
    "IsolationReport",
    "ParseError",
    "ParseResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "ToolCall",
    "ToolConfigError",
    "ToolExecutor",
    "ToolResponse",
    "create_tools",
    "get_tool_parser",
    "load_tools",
    "load_tool_config",
    "register_tool",
    "resolve_tool_class",
    "validate_tool_schema",
]
