"""Shared base of the remote (HTTP) backends: endpoint, API key, retry policy and connection pool.

Subclasses add the provider's request body, headers and stream decoding. Knows nothing about any
provider's payloads.
"""

from __future__ import annotations

from dataclasses import replace

import httpx

from agentcache.backends._http import RetryPolicy
from agentcache.backends.base import BaseBackend, Capabilities
from agentcache.usage import Usage

__all__ = ["RemoteBackend", "with_stream_timing"]


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
