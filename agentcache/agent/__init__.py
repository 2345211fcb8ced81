"""Agents: tools from Python functions, an append-only tool-calling loop, tool-call parsing."""

from __future__ import annotations

from agentcache.agent.agent import Agent, AgentConfig, AgentResult, PlannedCall, Planner, Step
from agentcache.agent.parsing import parse_hermes
from agentcache.agent.tools import Tool, ToolOutcome, ToolRegistry

__all__ = [
    "Agent",
    "AgentConfig",
    "AgentResult",
    "PlannedCall",
    "Planner",
    "Step",
    "Tool",
    "ToolOutcome",
    "ToolRegistry",
    "parse_hermes",
]
