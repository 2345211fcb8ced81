"""Freeze the public names of both packages: a change here is an API change, made on purpose."""

from __future__ import annotations

import agentcache
import runtime

AGENTCACHE_ALL = {
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
}

RUNTIME_ALL = {
    "CacheStats",
    "Completion",
    "Engine",
    "EngineBusyError",
    "InvalidRequestError",
    "Metrics",
    "ModelLoadError",
    "PromptTooLongError",
    "RuntimeEngineError",
    "SamplingParams",
    "StreamDelta",
    "Usage",
    "resolve_model",
}


def test_agentcache_all_is_frozen() -> None:
    assert set(agentcache.__all__) == AGENTCACHE_ALL


def test_runtime_all_is_frozen() -> None:
    assert set(runtime.__all__) == RUNTIME_ALL


def test_every_exported_name_exists() -> None:
    for module in (agentcache, runtime):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names missing attributes: {missing}"
