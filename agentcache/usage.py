"""One usage record for every backend: prompt, cached and output tokens, TTFT, decode rate.

Field names follow the OpenAI usage object (``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``). A field a backend does not report is ``None`` — never a
guessed 0.
This module knows nothing about HTTP or models; mapping of provider payloads lives beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage and timing of one model call.

    All token counts are in tokens of the backend's own tokenizer; ``None`` means "not reported".
    """

    prompt_tokens: int | None = None
    """All input tokens of the request, cached ones included."""
    completion_tokens: int | None = None
    """Generated (output) tokens."""
    cached_tokens: int | None = None
    """Input tokens read from a prefix/prompt cache (OpenAI ``cached_tokens``,
    Anthropic ``cache_read_input_tokens``)."""
    cache_write_tokens: int | None = None
    """Input tokens written to a provider cache (Anthropic ``cache_creation_input_tokens``)."""
    cache_write_5m_tokens: int | None = None
    """Part of ``cache_write_tokens`` written with the 5-minute TTL, where reported."""
    cache_write_1h_tokens: int | None = None
    """Part of ``cache_write_tokens`` written with the 1-hour TTL, where reported."""
    ttft_s: float | None = None
    """Time to first token, seconds, as measured by the caller or reported by the engine."""
    decode_tokens_per_s: float | None = None
    """Decode rate after the first token, tokens per second."""
    chunk_reused_tokens: int | None = None
    """Input tokens of documents whose KV the local engine reused from its chunk store in any
    order (``LocalBackend(chunk_reuse=...)``), apart from ``cached_tokens``; None when off."""
    chunk_reuse_mode: str | None = None
    """``"exact"`` or ``"blend"`` (approximate) when ``chunk_reused_tokens`` is set."""

    @property
    def hit_rate(self) -> float | None:
        """Cached prompt tokens / prompt tokens, or ``None`` when either is unknown or zero."""
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens
