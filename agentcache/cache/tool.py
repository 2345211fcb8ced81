"""``ToolCache``: cache a tool's results by (name, version, canonical arguments, state, scope).

Sync tools stay sync and async tools stay async. Exceptions are never cached; tools declared with
``side_effects=True`` are never cached at all. Scope and freshness follow the rules written in
``agentcache.cache.scope``. Knows nothing about how results are stored (a ``CacheStore``) or how
the agent renders them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeAlias, TypeVar, cast

from agentcache.cache._results import ResultCacheCore
from agentcache.cache.base import CacheStats, CacheStore, validate_ttl
from agentcache.cache.keys import arguments_json, signature_fingerprint, tool_key
from agentcache.cache.scope import ScopeKind, scope_key, validate_scope_kind
from agentcache.canonical import canonical_json
from agentcache.exceptions import CanonicalizationError, ConfigError

__all__ = ["DEPENDS_ON_ATTR", "DependsOn", "ToolCache", "cached_tool_scope"]

P = ParamSpec("P")
R = TypeVar("R")

DependsOn: TypeAlias = str | Callable[[], Any]
"""A version of the state a tool's answer depends on: a fingerprint, or a callable returning one
(any canonical JSON value), called on every call."""

DEPENDS_ON_ATTR = "__agentcache_depends_on__"
"""Attribute a tool function may carry (a ``DependsOn``) to bind its own state version; ``wrap``
adds it to the key (``DocumentIndex.search_tool`` sets it)."""
_WRAPPED_ATTR = "__agentcache_tool__"


def cached_tool_scope(fn: Callable[..., Any]) -> ScopeKind | None:
    """The scope ``fn`` was wrapped with if it is a ``ToolCache`` wrapper, else ``None``."""
    spec = getattr(fn, _WRAPPED_ATTR, None)
    return spec.scope if isinstance(spec, _ToolSpec) else None


@dataclass(frozen=True, slots=True)
class _ToolSpec:
    namespace: str
    name: str
    version: str
    scope: ScopeKind
    ttl_s: float | None
    signature: inspect.Signature
    depends_on: tuple[DependsOn, ...]

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        what = f"tool {self.name!r}"
        scope_json = scope_key(self.scope, what=what)
        args_json = arguments_json(self.signature, args, kwargs, what=what)
        return tool_key(
            self.namespace, self.name, self.version, args_json, scope_json, self._state_json(what)
        )

    def _state_json(self, what: str) -> str:
        versions = [dep() if callable(dep) else dep for dep in self.depends_on]
        try:
            return canonical_json(versions)
        except CanonicalizationError as exc:
            raise CanonicalizationError(
                f"{what}: depends_on gave a value with no canonical form: {exc}"
            ) from exc


class ToolCache:
    """Result cache for tools (plain Python functions, sync or async).

    Args:
        store: Where entries live (``MemoryStore``, ``DiskStore`` or any ``CacheStore``).
        namespace: Key prefix; two ``ToolCache`` objects on one store share entries only if their
            namespaces match (default ``"tools"``).
        allow_pickle: Also cache results that only pickle can reproduce. Off by default because
            unpickling runs code named by the stored bytes: enable it only for a store that no one
            else can write. JSON-like values, tuples, dataclasses and pydantic models need no
            pickle (see ``agentcache.cache._codec``).

    Results: a hit returns a freshly decoded value equal to (and of the same types as) the original,
    so it re-renders to the same bytes; mutating it does not change the cache.
    """

    def __init__(
        self, store: CacheStore, *, namespace: str = "tools", allow_pickle: bool = False
    ) -> None:
        self.namespace = namespace
        self._core = ResultCacheCore(store, allow_pickle=allow_pickle)

    @property
    def store(self) -> CacheStore:
        """The underlying store."""
        return self._core.store

    def wrap(
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        version: str | None = None,
        scope: ScopeKind = "narrowest",
        depends_on: DependsOn | None = None,
        ttl_s: float | None = None,
        side_effects: bool = False,
    ) -> Callable[P, R]:
        """Return ``fn`` with cached results; same signature, sync or async like ``fn``.

        Args:
            fn: The tool. Its arguments must have canonical JSON forms (``agentcache.canonical``).
            name: Tool name in the key (default ``module.qualname`` of ``fn``).
            version: Bump it when the tool's behaviour changes. Default: a fingerprint of the
                qualified name and signature, so a body-only change keeps old entries.
            scope: Who shares entries (rule in ``agentcache.cache.scope``). Default
                ``"narrowest"``: keyed by every id the active ``cache_scope`` sets;
                ``"session"``, ``"user"``, ``"tenant"`` and ``"global"`` opt in to wider sharing.
            depends_on: The version of the state the answer depends on (an index, a corpus, a
                file): a fingerprint, or a callable returning one that runs on every call; it is
                part of the key, so a changed state never serves an old result. A
                ``__agentcache_depends_on__`` attribute on ``fn`` is added too.
            ttl_s: Seconds an entry stays valid (default: until evicted).
            side_effects: ``True`` returns ``fn`` itself, never cached.

        Returns:
            The wrapper. Each call raises ``CacheScopeError`` if ``scope`` needs an id the
            current ``cache_scope`` does not set, ``CanonicalizationError`` (naming the argument)
            for an argument with no canonical form, and ``TypeError`` if the arguments do not
            fit the signature; in each case the tool does not run.

        Raises:
            ConfigError: invalid ``scope``, ``name``, ``version`` or a signature-less callable;
                ``fn`` is already a ``ToolCache`` wrapper (a tool is never wrapped twice).
            ValueError: ``ttl_s`` is not positive.
        """
        if side_effects:
            return fn
        spec = self._spec(fn, name=name, version=version, scope=scope, ttl_s=ttl_s)
        spec = dataclasses.replace(spec, depends_on=_depends_on(fn, depends_on))
        core = self._core
        what = f"tool {spec.name!r}"
        if inspect.iscoroutinefunction(fn):
            async_fn = cast(Callable[..., Any], fn)

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                key = spec.key(args, kwargs)
                compute = functools.partial(async_fn, *args, **kwargs)
                return await core.run_async(key, compute, ttl_s=spec.ttl_s, what=what)

            setattr(async_wrapper, _WRAPPED_ATTR, spec)
            return cast(Callable[P, R], async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            key = spec.key(args, kwargs)
            compute = functools.partial(fn, *args, **kwargs)
            return cast(R, core.run_sync(key, compute, ttl_s=spec.ttl_s, what=what))

        setattr(wrapper, _WRAPPED_ATTR, spec)
        return wrapper

    def cached(
        self,
        *,
        name: str | None = None,
        version: str | None = None,
        scope: ScopeKind = "narrowest",
        depends_on: DependsOn | None = None,
        ttl_s: float | None = None,
        side_effects: bool = False,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator form of ``wrap`` (same options): ``@tool_cache.cached(scope="tenant")``."""

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            return self.wrap(
                fn,
                name=name,
                version=version,
                scope=scope,
                depends_on=depends_on,
                ttl_s=ttl_s,
                side_effects=side_effects,
            )

        return decorate

    def stats(self) -> CacheStats:
        """Hits (calls served without running a tool) and misses (tool runs) of this object.

        ``entries`` and ``bytes`` are the whole store's. Cheap: two counters plus the store's own
        stats (for ``DiskStore`` two small SQLite reads).
        """
        return self._core.stats()

    def _spec(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None,
        version: str | None,
        scope: str,
        ttl_s: float | None,
    ) -> _ToolSpec:
        validate_ttl(ttl_s)
        kind = validate_scope_kind(scope)
        if cached_tool_scope(fn) is not None:
            raise ConfigError(
                f"{fn!r} is already cached by a ToolCache (scope {cached_tool_scope(fn)!r}); "
                "a tool is never wrapped twice: use the wrapper as it is"
            )
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"tool name must be a non-empty str, got {name!r}")
        if version is not None and not isinstance(version, str):
            raise ConfigError(f"tool version must be a str, got {version!r}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot read the signature of {fn!r}: {exc}") from exc
        default_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
        return _ToolSpec(
            namespace=self.namespace,
            name=name or default_name,
            version=version if version is not None else signature_fingerprint(fn),
            scope=kind,
            ttl_s=ttl_s,
            signature=signature,
            depends_on=(),
        )


def _depends_on(fn: Callable[..., Any], depends_on: DependsOn | None) -> tuple[DependsOn, ...]:
    deps = [getattr(fn, DEPENDS_ON_ATTR, None), depends_on]
    for dep in deps:
        if dep is not None and not (isinstance(dep, str) or callable(dep)):
            raise ConfigError(f"depends_on must be a str or a callable, got {dep!r}")
    return tuple(dep for dep in deps if dep is not None)
