"""agentcache: cache-friendly prompts for agents and RAG, and a local runtime that reuses them.

The SDK never imports torch or transformers at import time; the local runtime (package
``runtime``) is an optional extra, imported lazily by the local backend.
"""

from __future__ import annotations

from agentcache.cache import RetrievalCache, ToolCache, cache_scope
from agentcache.exceptions import (
    AgentCacheError,
    AgentError,
    BackendError,
    BackendHTTPError,
    BackendUnavailableError,
    CacheError,
    CacheScopeError,
    CanonicalizationError,
    ConfigError,
    PromptError,
)
from agentcache.prompt import Document, Prompt, PromptBuilder
from agentcache.proxy.wrap import wrap
from agentcache.usage import Usage

__version__ = "0.1.0"

__all__ = [
    "AgentCacheError",
    "AgentError",
    "BackendError",
    "BackendHTTPError",
    "BackendUnavailableError",
    "CacheError",
    "CacheScopeError",
    "CanonicalizationError",
    "ConfigError",
    "Document",
    "Prompt",
    "PromptBuilder",
    "PromptError",
    "RetrievalCache",
    "ToolCache",
    "Usage",
    "__version__",
    "cache_scope",
    "wrap",
]
