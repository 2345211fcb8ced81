"""Exception tree of the agentcache SDK.

Every error the SDK raises on purpose derives from ``AgentCacheError``. User and configuration
mistakes also derive from ``ValueError`` or ``TypeError`` so generic handlers still catch them.

    AgentCacheError
    ├── ConfigError (ValueError)            bad option or configuration
    ├── PromptError (ValueError)            a prompt cannot be built or rendered
    │   ├── CanonicalizationError (TypeError)  a value has no canonical JSON form
    │   └── PromptTypeError (TypeError)     a prompt part or prompt has the wrong type
    ├── EmptyCorpusError (ValueError)       nothing to index (no documents, or all empty)
    ├── CacheError                          tool / retrieval result caches
    │   ├── CacheScopeError (ValueError)    a scoped tool called without its scope
    │   └── CacheIntegrityError             a store's internal invariant does not hold
    ├── BackendError                        a model backend failed
    │   ├── BackendHTTPError                a remote endpoint answered 4xx/5xx
    │   └── BackendUnavailableError         an optional dependency or model is missing
    └── AgentError                          the agent loop gave up (e.g. step limit)
"""

from __future__ import annotations

__all__ = [
    "AgentCacheError",
    "AgentError",
    "BackendError",
    "BackendHTTPError",
    "BackendUnavailableError",
    "CacheError",
    "CacheIntegrityError",
    "CacheScopeError",
    "CanonicalizationError",
    "ConfigError",
    "EmptyCorpusError",
    "PromptError",
    "PromptTypeError",
]


class AgentCacheError(Exception):
    """Root of every error raised on purpose by agentcache."""


class ConfigError(AgentCacheError, ValueError):
    """An option or configuration value is invalid."""


class PromptError(AgentCacheError, ValueError):
    """A prompt cannot be built or rendered."""


class CanonicalizationError(PromptError, TypeError):
    """A value has no canonical JSON form (the message names the offending path)."""


class PromptTypeError(PromptError, TypeError):
    """A prompt part (document, message, tool) or a whole prompt has the wrong type."""


class EmptyCorpusError(AgentCacheError, ValueError):
    """A retriever or document index was given no (non-empty) documents to index."""


class CacheError(AgentCacheError):
    """A tool or retrieval result cache failed."""


class CacheScopeError(CacheError, ValueError):
    """A tenant-, user- or session-scoped cache was used without that scope set."""


class CacheIntegrityError(CacheError):
    """A cache store's internal invariant does not hold (reported by ``check_integrity()``)."""


class BackendError(AgentCacheError):
    """A model backend failed to produce a completion."""


class BackendHTTPError(BackendError):
    """A remote endpoint answered with an HTTP error.

    Attributes:
        status_code: The HTTP status code of the final attempt.
        body: The response body text (truncated to 2,000 characters).
    """

    def __init__(self, message: str, *, status_code: int, body: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body[:2000]


class BackendUnavailableError(BackendError):
    """An optional dependency, model or endpoint needed by a backend is missing."""


class AgentError(AgentCacheError):
    """The agent loop could not finish (for example it hit its step limit)."""
