"""``EngineHints``: what an OpenAI-compatible backend tells a self-hosted engine about the caller.

Two hints, both off by default because hosted providers refuse unknown body fields: the tenant's
prefix-cache namespace as vLLM's ``cache_salt`` body field (also honoured by ``agentcache serve``),
and a stable session id header that prefix-aware routers use to send a conversation's turns to the
replica that already caches its prefix. Both are derived from the active ``cache_scope``, so they
follow the same tenant/user/session ids as the result caches. Knows nothing about HTTP clients.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentcache.cache.scope import current_scope
from agentcache.canonical import stable_hash
from agentcache.exceptions import ConfigError

__all__ = ["EngineHints"]

_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an RFC 9110 token
_SALT_TAG = "agentcache.cache_salt.v1"
_SESSION_TAG = "agentcache.session.v1"


@dataclass(frozen=True, slots=True)
class EngineHints:
    """Per-request hints for self-hosted engines (vLLM, SGLang, ``agentcache serve``) and routers.

    Raises:
        ConfigError: ``cache_salt`` is not a bool, ``session_header`` is not a valid header
            name, or ``salt_secret`` is given without ``cache_salt``.
    """

    cache_salt: bool = False
    """Send ``cache_salt`` (vLLM >= 0.9, ``agentcache serve``) when a ``cache_scope`` tenant is
    set: 32 hex characters of SHA-256 over the tenant id (and ``salt_secret``). Requests of other
    tenants then never reuse this tenant's cached prefix, closing the timing side channel between
    tenants. No tenant set: no field (the engine's shared namespace)."""

    salt_secret: str | None = None
    """Mixed into every salt so that a tenant's salt cannot be computed from its id alone."""

    session_header: str | None = None
    """Header name (e.g. ``"x-session-id"``) carrying 32 hex characters of SHA-256 over the active
    ``cache_scope`` (tenant, user, session) when a session is set, for session-affinity or
    prefix-aware routing (vLLM production-stack router, SGLang router). ``None``: no header."""

    def __post_init__(self) -> None:
        if not isinstance(self.cache_salt, bool):
            raise ConfigError(
                f"cache_salt is a switch (True: salt by the cache_scope tenant), got "
                f"{self.cache_salt!r}; the salt comes from cache_scope(tenant=...)"
            )
        header = self.session_header
        if header is not None and (not isinstance(header, str) or not _HEADER_NAME.match(header)):
            raise ConfigError(f"session_header must be an HTTP header name, got {header!r}")
        if self.salt_secret is not None and not self.cache_salt:
            raise ConfigError("salt_secret is only used with cache_salt=True; set both or neither")

    def body_fields(self) -> dict[str, str]:
        """Body fields for the current ``cache_scope``: ``{}`` or ``{"cache_salt": ...}``."""
        tenant = current_scope().tenant
        if not self.cache_salt or tenant is None:
            return {}
        return {"cache_salt": stable_hash(_SALT_TAG, self.salt_secret or "", tenant)[:32]}

    def headers(self) -> dict[str, str]:
        """Request headers for the current ``cache_scope`` (``{}`` without a session id)."""
        scope = current_scope()
        if self.session_header is None or scope.session is None:
            return {}
        parts = (scope.tenant or "", scope.user or "", scope.session)
        return {self.session_header: stable_hash(_SESSION_TAG, *parts)[:32]}
