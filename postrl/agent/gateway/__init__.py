"""Bring your own agent: an OpenAI-compatible gateway per trajectory (the ``gateway`` loop).

See :mod:`postrl.agent.gateway.loop` for the contract and docs/agent.md, "Bring your own
agent", for how to use it.
"""

from postrl.agent.gateway.loop import GatewayAgentLoop, check_gateway_config
from postrl.agent.gateway.server import GatewayServer
from postrl.agent.gateway.session import GatewayChatBody, GatewaySession
from postrl.agent.gateway.transcript import ContextOverflowError, Segment, Transcript

__all__ = [
    "ContextOverflowError",
    "GatewayAgentLoop",
    "GatewayChatBody",
    "GatewayServer",
    "GatewaySession",
    "Segment",
    "Transcript",
    "check_gateway_config",
]
