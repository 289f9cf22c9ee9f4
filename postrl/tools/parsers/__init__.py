"""Tool-call parsers: decoded assistant text -> tool calls + parse errors (never an exception).

Registry ``TOOL_PARSERS`` maps a format name (the value of ``rollout.agent.tool_parser`` and
``postrl serve --tool-parser``) to a parser class; each family lives in one module:

=================  =====================================================  ==================
name               models                                                 module
=================  =====================================================  ==================
``hermes``         Qwen2.5, Qwen3 (≤ 2507), Hermes-2/3-Pro                 ``hermes``
``qwen3_coder``    Qwen3-Coder, Qwen3.5+ (XML function/parameter)          ``qwen3_coder``
``gpt-oss``        gpt-oss-20b/120b (harmony channels)                     ``gpt_oss``
``llama3_json``    Llama 3.1 / 3.2 / 3.3 (JSON, ``<|python_tag|>``)        ``llama3``
``mistral``        Mistral / Mixtral / Nemo / Small / Magistral            ``mistral``
``deepseek_v3``    DeepSeek-V3, R1 (and the V3.1 form)                     ``deepseek``
``deepseek_v31``   DeepSeek-V3.1 (and the V3 form)                         ``deepseek``
``glm45``          GLM-4.5 / 4.6 / 4.7                                     ``glm``
``kimi_k2``        Kimi K2                                                 ``kimi``
=================  =====================================================  ==================

Every parser has ``parse(text, tools=None) -> ParseResult`` (calls, errors, ``content`` with the
calls removed, ``reasoning``) and ``stream(tools=None) -> StreamingToolParser`` (feed text
deltas; the concatenated result equals ``parse`` of the whole text). ``tools`` (OpenAI tool
schemas) type the parameter values of the XML-style formats. See ``docs/tools.md``.
"""

from postrl.tools.parsers import (  # noqa: F401  (each module registers its parser)
    deepseek,
    glm,
    gpt_oss,
    hermes,
    kimi,
    llama3,
    mistral,
    qwen3_coder,
)
from postrl.tools.parsers.base import (
    TOOL_PARSERS,
    ParseError,
    ParseResult,
    StreamDelta,
    StreamingToolParser,
    ToolCall,
    ToolParser,
    coerce_value,
    get_tool_parser,
)
from postrl.tools.parsers.deepseek import DeepSeekV3ToolParser
from postrl.tools.parsers.glm import GLM45ToolParser
from postrl.tools.parsers.gpt_oss import GptOssToolParser
from postrl.tools.parsers.hermes import HermesToolParser
from postrl.tools.parsers.kimi import KimiK2ToolParser
from postrl.tools.parsers.llama3 import Llama3JsonToolParser
from postrl.tools.parsers.mistral import MistralToolParser
from postrl.tools.parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "GLM45ToolParser",
    "GptOssToolParser",
    "HermesToolParser",
    "KimiK2ToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParseError",
    "ParseResult",
    "Qwen3CoderToolParser",
    "StreamDelta",
    "StreamingToolParser",
    "ToolCall",
    "ToolParser",
    "coerce_value",
    "get_tool_parser",
]
