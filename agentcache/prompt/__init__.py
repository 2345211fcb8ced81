"""Cache-friendly prompts: canonical segments, fingerprints, provider rendering, lint and diff.

Build with ``PromptBuilder``; inspect with ``lint`` and ``diff``; check token-level prefix
stability with ``check_token_prefix`` / ``stable_token_ids``.
"""

from __future__ import annotations

from agentcache.prompt.anthropic import Breakpoint, BreakpointPlan, plan_breakpoints
from agentcache.prompt.builder import Prompt, PromptBuilder
from agentcache.prompt.segments import Document, Segment, SegmentKind
from agentcache.prompt.tools import ToolSpec

__all__ = [
    "Breakpoint",
    "BreakpointPlan",
    "Document",
    "Prompt",
    "PromptBuilder",
    "Segment",
    "SegmentKind",
    "ToolSpec",
    "plan_breakpoints",
]
