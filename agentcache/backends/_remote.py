"""Shared base of the remote (HTTP) backends: endpoint, API key, retry policy and connection pool.

Subclasses add the provider's request body, headers and stream decoding. Knows nothing about any
provider's payloads.
"""

from __future__ import annotations

import httpx

from agentcache.backends._http import RetryPolicy
from agentcache.backends.base import BaseBackend, Capabilities

__all__ = ["RemoteBackend"]


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
