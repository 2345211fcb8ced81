"""Map provider usage payloads onto the one ``Usage`` record.

OpenAI Chat Completions and Responses, Anthropic Messages, DeepSeek and vLLM. A field the payload
does not carry stays ``None`` — never a guessed 0. Accepts either a whole response or its
``usage`` object. Knows field names, not prices (``pricing.py``) or HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentcache.usage import Usage

__all__ = [
    "usage_from_anthropic",
    "usage_from_deepseek",
    "usage_from_openai",
    "usage_from_vllm",
]


def _usage(payload: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = payload.get("usage")
    return inner if isinstance(inner, Mapping) else payload


def _int(mapping: Mapping[str, Any] | None, key: str) -> int | None:
    if not isinstance(mapping, Mapping):
        return None
    value = mapping.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def usage_from_openai(payload: Mapping[str, Any]) -> Usage:
    """OpenAI Chat Completions (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``) or
    Responses (``input_tokens``, ``input_tokens_details.cached_tokens``) usage.

    Source: https://platform.openai.com/docs/api-reference/chat/object and
    .../responses/object (reviewed 2026-11-29). OpenAI reports no cache writes.
    """
    u = _usage(payload)
    if "input_tokens" in u and "prompt_tokens" not in u:  # Responses API
        return Usage(
            prompt_tokens=_int(u, "input_tokens"),
            completion_tokens=_int(u, "output_tokens"),
            cached_tokens=_int(u.get("input_tokens_details"), "cached_tokens"),
        )
    return Usage(
        prompt_tokens=_int(u, "prompt_tokens"),
        completion_tokens=_int(u, "completion_tokens"),
        cached_tokens=_int(u.get("prompt_tokens_details"), "cached_tokens"),
    )


def usage_from_vllm(payload: Mapping[str, Any]) -> Usage:
    """vLLM's OpenAI-compatible usage; ``prompt_tokens_details`` is null unless the server runs
    with ``--enable-prompt-tokens-details``, so ``cached_tokens`` is then ``None``."""
    return usage_from_openai(payload)


def usage_from_deepseek(payload: Mapping[str, Any]) -> Usage:
    """DeepSeek usage: ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``.

    Source: https://api-docs.deepseek.com/guides/kv_cache (reviewed 2026-11-29).
    """
    u = _usage(payload)
    hit, miss = _int(u, "prompt_cache_hit_tokens"), _int(u, "prompt_cache_miss_tokens")
    prompt = _int(u, "prompt_tokens")
    if prompt is None and hit is not None and miss is not None:
        prompt = hit + miss
    cached = hit if hit is not None else usage_from_openai(u).cached_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=_int(u, "completion_tokens"), cached_tokens=cached
    )


def usage_from_anthropic(payload: Mapping[str, Any]) -> Usage:
    """Anthropic Messages usage.

    Anthropic's ``input_tokens`` counts only tokens after the last cache breakpoint, so
    ``prompt_tokens = input_tokens + cache_read_input_tokens + cache_creation_input_tokens``.
    ``cache_creation.ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens`` split the writes
    by TTL. Source: https://platform.claude.com/docs/en/build-with-claude/prompt-caching
    (reviewed 2026-11-29).
    """
    u = _usage(payload)
    uncached = _int(u, "input_tokens")
    read = _int(u, "cache_read_input_tokens")
    write = _int(u, "cache_creation_input_tokens")
    split = u.get("cache_creation")
    prompt = None
    if uncached is not None:
        prompt = uncached + (read or 0) + (write or 0)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=_int(u, "output_tokens"),
        cached_tokens=read,
        cache_write_tokens=write,
        cache_write_5m_tokens=_int(split, "ephemeral_5m_input_tokens"),
        cache_write_1h_tokens=_int(split, "ephemeral_1h_input_tokens"),
    )
