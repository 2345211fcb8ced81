"""Cache-friendly prompts: canonical segments, fingerprints, provider rendering, lint and diff.

Build with ``PromptBuilder``; inspect with ``lint`` and ``diff``; check token-level prefix
stability with ``check_token_prefix`` / ``stable_token_ids``.
"""

from __future__ import annotations

from agentcache.prompt.anthropic import Breakpoint, BreakpointPlan, plan_breakpoints
from agentcache.prompt.builder import Prompt, PromptBuilder
from agentcache.prompt.diff import DiffResult, diff
from agentcache.prompt.lint import Finding, lint
from agentcache.prompt.segments import Document, Segment, SegmentKind
from agentcache.prompt.token_prefix import (
    TemplateRewritesHistoryError,
    TokenPrefixReport,
    check_token_prefix,
    stable_token_ids,
)
from agentcache.prompt.tools import ToolSpec

__all__ = [
    "Breakpoint",
    "BreakpointPlan",
    "DiffResult",
    "Document",
    "Finding",
    "Prompt",
    "PromptBuilder",
    "Segment",
    "SegmentKind",
    "TemplateRewritesHistoryError",
    "TokenPrefixReport",
    "ToolSpec",
    "check_token_prefix",
    "diff",
    "lint",
    "plan_breakpoints",
    "stable_token_ids",
]
