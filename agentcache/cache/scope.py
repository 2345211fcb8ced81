"""Who may share a cached result: the ``cache_scope`` context and the scope part of cache keys.

The scope rule (the one place it is written down; ``ToolCache``, ``RetrievalCache``, ``Agent`` and
the embedding cache refer here):

- By default (``scope="narrowest"``) an entry is keyed by every id the active ``cache_scope`` sets
  (tenant, user, session): two callers share it only if all of those ids are equal. With no
  ``cache_scope`` active there is one caller, the process, and its entries are its own.
- Sharing wider than that is an explicit opt-in per tool or cache: ``"session"`` (requires a
  session id), ``"user"`` (shared by a user's sessions, requires a user id), ``"tenant"``
  (shared by a tenant's users, requires a tenant id) or ``"global"`` (shared by everyone).
- An ``Agent`` passes its ``tool_scope`` to the tools it wraps; a tool already wrapped by a
  ``ToolCache`` keeps its own scope and is never wrapped again.

Freshness, the companion rule: a result whose truth depends on state (an index, a corpus, a
file) carries a version of that state in its key (``ToolCache.wrap(depends_on=...)``,
``RetrievalCache``'s index fingerprint).

The scope travels in a ``contextvars.ContextVar``: asyncio tasks inherit it when created, and a
thread sees it when started through ``contextvars.copy_context().run`` or ``asyncio.to_thread``.
This module knows nothing about stores, tools or retrievers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

from agentcache.canonical import canonical_json
from agentcache.exceptions import CacheScopeError, ConfigError

__all__ = [
    "ScopeKind",
    "ScopeValues",
    "cache_scope",
    "current_scope",
    "scope_key",
    "validate_scope_kind",
]

ScopeKind: TypeAlias = Literal["narrowest", "session", "user", "tenant", "global"]
"""How widely a cached result is shared: by callers with all the same ``cache_scope`` ids (the
default), one session, one user, one tenant or everyone."""

_KINDS: tuple[str, ...] = get_args(ScopeKind)


@dataclass(frozen=True, slots=True)
class ScopeValues:
    """The identifiers set by the enclosing ``cache_scope`` blocks (``None`` = not set)."""

    tenant: str | None = None
    user: str | None = None
    session: str | None = None


_NO_SCOPE = ScopeValues()
# NOTE: ScopeValues is frozen, so sharing one default instance is safe.
_CURRENT: ContextVar[ScopeValues] = ContextVar("agentcache_cache_scope", default=_NO_SCOPE)


@contextmanager
def cache_scope(
    *, tenant: str | None = None, user: str | None = None, session: str | None = None
) -> Iterator[ScopeValues]:
    """Set the tenant, user and/or session for cached calls made inside the block.

    Nested blocks merge: an inner ``cache_scope(user="u")`` keeps the outer tenant.

    Args:
        tenant: Tenant id; tenant-scoped entries are shared only within it.
        user: User id; user-scoped entries are keyed by (tenant, user).
        session: Session id; session-scoped entries are keyed by (tenant, user, session).

    Yields:
        The merged ``ScopeValues`` in effect inside the block.

    Raises:
        ConfigError: an id is not a non-empty string.
    """
    for name, value in (("tenant", tenant), ("user", user), ("session", session)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"cache_scope({name}=...) needs a non-empty str, got {value!r}")
    outer = _CURRENT.get()
    merged = ScopeValues(
        tenant=outer.tenant if tenant is None else tenant,
        user=outer.user if user is None else user,
        session=outer.session if session is None else session,
    )
    token = _CURRENT.set(merged)
    try:
        yield merged
    finally:
        _CURRENT.reset(token)


def current_scope() -> ScopeValues:
    """The ``ScopeValues`` set by the enclosing ``cache_scope`` blocks."""
    return _CURRENT.get()


def validate_scope_kind(kind: str) -> ScopeKind:
    """Return ``kind`` if it is a valid scope kind.

    Raises:
        ConfigError: ``kind`` is not one of narrowest, session, user, tenant, global.
    """
    if kind not in _KINDS:
        raise ConfigError(f"scope must be one of {', '.join(_KINDS)}; got {kind!r}")
    return kind  # type: ignore[return-value]


def scope_key(kind: ScopeKind, *, what: str) -> str:
    """Canonical JSON naming the entries a call in the current context may share.

    Args:
        kind: The scope the tool or retriever was declared with.
        what: Name used in the error message (for example ``"tool 'search'"``).

    Returns:
        ``"global"`` or canonical JSON of the kind and the identifiers it requires (a user scope
        includes the tenant, a session scope the tenant and user, when set); for
        ``"narrowest"`` every identifier, set or not.

    Raises:
        CacheScopeError: the identifier ``kind`` requires is not set by ``cache_scope``.
    """
    if kind == "global":
        return "global"
    values = _CURRENT.get()
    if kind == "narrowest":
        return canonical_json(
            {"kind": kind, "tenant": values.tenant, "user": values.user, "session": values.session}
        )
    if getattr(values, kind) is None:
        raise CacheScopeError(
            f"{what} is {kind}-scoped but was called without a {kind}; "
            f"wrap the call in `with cache_scope({kind}=...)` or declare a wider scope"
        )
    parts: dict[str, str | None] = {"kind": kind, "tenant": values.tenant}
    if kind in ("user", "session"):
        parts["user"] = values.user
    if kind == "session":
        parts["session"] = values.session
    return canonical_json(parts)
