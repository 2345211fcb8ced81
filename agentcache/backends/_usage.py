"""Provider usage payloads -> ``Usage``, and cost estimates, for the remote backends.

Thin adapters: the mapping rules live in ``agentcache.usage_mapping`` and the price table in
``agentcache.pricing``; this module only picks the right function and never guesses a count.
"""

from __future__ import annotations

from typing import Any

from agentcache.pricing import cost
from agentcache.usage import Usage
from agentcache.usage_mapping import usage_from_anthropic, usage_from_openai

__all__ = ["anthropic_usage", "estimate_cost", "openai_usage"]


def openai_usage(payload: dict[str, Any]) -> Usage:
    """Map an OpenAI ``usage`` object; ``cached_tokens`` stays ``None`` when not reported."""
    return usage_from_openai(payload)


def anthropic_usage(payload: dict[str, Any]) -> Usage:
    """Map an Anthropic ``usage`` object (its ``input_tokens`` excludes cache reads/writes)."""
    return usage_from_anthropic(payload)


def estimate_cost(model: str, usage: Usage) -> float | None:
    """Price of ``usage`` on ``model`` in US dollars, or ``None`` when the model is not priced."""
    priced = cost(usage, model)
    return None if priced is None else priced.total_usd
