"""Transparent caching for apps that do not use the SDK: ``agentcache proxy`` and client wrappers.

``rewrite`` (no HTTP) canonicalizes what carries no meaning and plans cache markers; ``sessions``
explains prefix breaks. The HTTP proxy (``create_proxy_app``, needs the ``proxy`` extra:
FastAPI, uvicorn, prometheus-client) is imported lazily so this package imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentcache.proxy.rewrite import RewriteOptions, RewriteResult, rewrite
from agentcache.proxy.sessions import PrefixBreak, SessionLog, derive_session_id

if TYPE_CHECKING:
    from agentcache.proxy.app import create_proxy_app

__all__ = [
    "PrefixBreak",
    "RewriteOptions",
    "RewriteResult",
    "SessionLog",
    "create_proxy_app",
    "derive_session_id",
    "rewrite",
]


def __getattr__(name: str) -> Any:
    if name == "create_proxy_app":
        from agentcache.proxy.app import create_proxy_app

        return create_proxy_app
    raise AttributeError(f"module 'agentcache.proxy' has no attribute {name!r}")
