"""Shared base of the remote (HTTP) backends: endpoint, API key, retry policy and connection pool.

Subclasses add the provider's request body, headers and stream decoding; ``StreamAccumulator`` is
what every stream keeps besides its provider's events (text, client-side timing, answering model).
Knows nothing about any provider's payloads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import httpx

from agentcache.backends._http import RetryPolicy
from agentcache.backends._usage import estimate_cost
from agentcache.backends.base import BaseBackend, Capabilities, ModelResponse, ToolCall
from agentcache.usage import Usage

__all__ = ["RemoteBackend", "StreamAccumulator", "with_stream_timing"]


class RemoteBackend(BaseBackend):
    """A backend that talks to an HTTP endpoint through one pooled ``httpx.Client``."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str,
        api_key: str | None,
        timeout_s: float,
        retry: RetryPolicy | None,
        transport: httpx.BaseTransport | None,
    ) -> None:
        """Set up the connection pool (no request is sent).

        Args:
            model: Model name sent with each request.
            base_url: Endpoint root; a trailing ``/`` is dropped.
            api_key: Credential for the subclass's auth header, or None for none.
            timeout_s: Per-request timeout, seconds.
            retry: Retry policy for 429/5xx and connection errors (default ``RetryPolicy()``).
            transport: httpx transport override (tests, proxies).
        """
        self._model = model
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._retry = retry or RetryPolicy()
        self._client = httpx.Client(timeout=timeout_s, transport=transport)

    @property
    def capabilities(self) -> Capabilities:
        """Remote endpoints may cache prefixes and report cached tokens when they do."""
        return Capabilities(supports_prefix_cache=True, reports_cached_tokens=True)

    @property
    def model(self) -> str:
        """The model name sent with each request."""
        return self._model

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()


def with_stream_timing(
    usage: Usage, *, start_s: float, first_s: float | None, end_s: float
) -> Usage:
    """``usage`` with TTFT and decode rate measured on the client, unless the provider sent them.

    Args:
        usage: The provider's usage (its own ``ttft_s`` / ``decode_tokens_per_s`` win).
        start_s: ``time.perf_counter()`` when the request was sent, seconds.
        first_s: When the first text or tool-call delta arrived, or None if none did.
        end_s: When the stream ended.

    Returns:
        The record with ``ttft_s = first_s - start_s`` and ``decode_tokens_per_s`` =
        (completion tokens - 1) / (end_s - first_s); None where not measurable.
    """
    ttft = None if first_s is None else first_s - start_s
    rate = None
    if first_s is not None and usage.completion_tokens and end_s > first_s:
        rate = max(usage.completion_tokens - 1, 0) / (end_s - first_s)
    return replace(
        usage,
        ttft_s=usage.ttft_s if usage.ttft_s is not None else ttft,
        decode_tokens_per_s=usage.decode_tokens_per_s or rate,
    )


@dataclass(slots=True)
class StreamAccumulator:
    """The part of a provider's stream state that every remote backend keeps the same way.

    A provider's subclass decodes its events, appends text to ``text``, sets ``model`` and calls
    ``mark_first`` on the first text or tool-call delta; ``finish`` builds the response.
    """

    start_s: float
    """``time.perf_counter()`` when the request was sent, seconds."""
    text: list[str] = field(default_factory=list)
    """Text deltas in arrival order."""
    model: str = ""
    """The model the provider says answered ('' until it says so)."""
    first_s: float | None = None
    """When the first text or tool-call delta arrived (None: none yet)."""

    def mark_first(self) -> None:
        """Record now as the first delta's arrival, once."""
        if self.first_s is None:
            self.first_s = time.perf_counter()

    def finish(
        self,
        requested_model: str,
        *,
        usage: Usage,
        tool_calls: tuple[ToolCall, ...],
        finish_reason: str | None,
    ) -> ModelResponse:
        """The stream's response: ``usage`` timed on the client (``with_stream_timing``, ending
        now) and priced at the answering model's rates (``requested_model`` if none was named)."""
        timed = with_stream_timing(
            usage, start_s=self.start_s, first_s=self.first_s, end_s=time.perf_counter()
        )
        model = self.model or requested_model
        return ModelResponse(
            text="".join(self.text),
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            usage=timed,
            cost_usd=estimate_cost(model, timed),
            model=model,
        )
