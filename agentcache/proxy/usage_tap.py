"""Read usage from upstream answers as they pass, and account it per model (tokens and dollars).

The proxy never alters an answer: this module only looks at the bytes (a JSON body, or an SSE
stream chunk by chunk) and keeps running totals. Costs come from the dated price table in
``agentcache.pricing``; "saved" is what the same tokens would have cost with no cached input.
Knows usage payloads and prices, not HTTP.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from agentcache.pricing import cost
from agentcache.usage import Usage
from agentcache.usage_mapping import usage_from_anthropic, usage_from_openai

__all__ = ["ModelTotals", "SSEUsageTap", "UsageBook", "usage_of_body"]


def usage_of_body(provider: str, body: bytes) -> Usage | None:
    """Usage of a non-streamed answer, or None when the body carries none."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
        return None
    return usage_from_anthropic(payload) if provider == "anthropic" else usage_from_openai(payload)


def _merge(old: Usage | None, new: Usage) -> Usage:
    """Later stream events refine earlier ones; a field they leave ``None`` keeps its value."""
    if old is None:
        return new
    fields = Usage.__dataclass_fields__
    changes = {name: getattr(new, name) for name in fields if getattr(new, name) is not None}
    return replace(old, **changes)


class SSEUsageTap:
    """Feed it the SSE bytes of a streamed answer; ``usage`` holds what the stream reported.

    OpenAI sends usage in a final chunk (with ``stream_options.include_usage``); Anthropic sends
    input and cache counts in ``message_start`` and output counts in ``message_delta``.
    """

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.usage: Usage | None = None
        self.done = False
        """Whether the stream's end marker has been read (OpenAI ``data: [DONE]``, Anthropic
        ``message_stop``): every usage event comes before it."""
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        """Consume raw bytes; complete ``data:`` lines are parsed, the rest is kept."""
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        if not data:
            return
        try:
            event = json.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if event.get("type") == "message_stop":
            self.done = True
        payload: Any = event.get("message") if event.get("type") == "message_start" else event
        if not isinstance(payload, dict) or not isinstance(payload.get("usage"), dict):
            return
        mapper = usage_from_anthropic if self.provider == "anthropic" else usage_from_openai
        self.usage = _merge(self.usage, mapper(payload))


@dataclass(slots=True)
class ModelTotals:
    """Running totals for one upstream model (tokens; USD from the dated price table)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float = 0.0
    saved_usd: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0 before any prompt token)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class UsageBook:
    """Per-model totals of what passed through (thread-safe)."""

    def __init__(self) -> None:
        self._totals: defaultdict[str, ModelTotals] = defaultdict(ModelTotals)
        self._lock = threading.Lock()

    def record(self, model: str, usage: Usage | None) -> None:
        """Count one answered request of ``model`` with its usage (None: counted, no tokens)."""
        with self._lock:
            totals = self._totals[model]
            totals.requests += 1
            if usage is None:
                return
            totals.prompt_tokens += usage.prompt_tokens or 0
            totals.cached_tokens += usage.cached_tokens or 0
            totals.cache_write_tokens += usage.cache_write_tokens or 0
            actual = cost(usage, model)
            uncached = cost(replace(usage, cached_tokens=0), model)
            if actual is not None:
                totals.cost_usd += actual.total_usd
            if actual is not None and uncached is not None:
                totals.saved_usd += uncached.total_usd - actual.total_usd

    def snapshot(self) -> dict[str, ModelTotals]:
        """A copy of the totals by model."""
        with self._lock:
            return {m: replace(t) for m, t in self._totals.items()}
