"""Fixtures for agent-loop tests: the real tiny tokenizer and an agent config."""

from __future__ import annotations

import pytest

from postrl.config.schema import AgentConfig
from postrl.testing import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level ChatML tokenizer."""
    return make_tokenizer()


@pytest.fixture
def agent_config():
    """Tool-loop config with the faithfulness check on."""
    return AgentConfig(
        default_agent_loop="tool_agent",
        max_assistant_turns=4,
        max_user_turns=4,
        max_tool_response_length=256,
        check_token_faithfulness=True,
    )
