"""Public names: frozen for the two top-level packages, derived for every module below them.

A change to ``AGENTCACHE_ALL`` / ``RUNTIME_ALL`` is an API change, made on purpose. The other
checks walk every module of both packages (the lists come from the code, not from this file):
each has an ``__all__`` whose names exist, and a package exports every public class or function
that it or its own modules define, so nothing public slips in unlisted.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

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
    "ChunkReuse",
    "ChunkReuseError",
    "Completion",
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "InvalidRequestError",
    "Metrics",
    "ModelLoadError",
    "PromptTooLongError",
    "TooManyChoicesError",
    "RuntimeEngineError",
    "SamplingParams",
    "SchedulerConfig",
    "StreamDelta",
    "Usage",
    "resolve_model",
}


def _module_names() -> list[str]:
    names: list[str] = []
    for package in (agentcache, runtime):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):  # NOTE: importing it runs the command line
                names.append(info.name)
    return sorted(names)


MODULES = _module_names()


def test_agentcache_all_is_frozen() -> None:
    assert set(agentcache.__all__) == AGENTCACHE_ALL


def test_runtime_all_is_frozen() -> None:
    assert set(runtime.__all__) == RUNTIME_ALL


def test_the_walk_found_both_packages_and_their_floors() -> None:
    for name in ("agentcache.agent.parsing", "runtime.engine", "runtime.cache.radix_cache"):
        assert name in MODULES
    assert "runtime.serve.app" in MODULES and "runtime.bench.load" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_every_module_lists_names_that_exist(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"


PACKAGES = [n for n in MODULES if hasattr(importlib.import_module(n), "__path__")]


@pytest.mark.parametrize("name", PACKAGES)
def test_a_package_exports_every_public_name_it_defines_or_re_exports(name: str) -> None:
    package = importlib.import_module(name)
    own = {
        n
        for n, value in vars(package).items()
        if not n.startswith("_")
        and not isinstance(value, types.ModuleType)
        and str(getattr(value, "__module__", "")).startswith(name)
    }
    # NOTE: runtime's names load lazily, so only the ones loaded so far are attributes.
    assert own <= set(package.__all__), (
        f"{name}: public but not exported: {own - set(package.__all__)}"
    )
