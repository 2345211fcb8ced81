"""Environment variables of the SDK: the only module that reads ``os.environ``.

Names are ``AGENTCACHE_*`` plus the providers' own ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``.
Each getter reads the environment at call time (no caching), so tests can monkeypatch it.
This module knows nothing about backends or caches beyond the names of their settings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

__all__ = ["api_key", "base_url", "cache_dir", "default_model", "redis_url"]

Provider = Literal["openai", "anthropic"]

_PROVIDER_KEYS: dict[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}


def _get(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def cache_dir() -> Path:
    """Directory of the persistent tool/retrieval caches.

    ``AGENTCACHE_CACHE_DIR`` if set, else ``AGENTCACHE_HOME`` if set (the one root of all of
    agentcache's state: pulled models, kernels, these caches), else the platform's user cache dir
    + ``agentcache`` (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux, ``~/Library/Caches`` on macOS,
    ``%LOCALAPPDATA%`` on Windows). The directory is not created here.
    """
    explicit = _get("AGENTCACHE_CACHE_DIR") or _get("AGENTCACHE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "agentcache"
    if sys.platform == "win32":
        local = _get("LOCALAPPDATA")
        return (Path(local) if local else Path.home() / "AppData" / "Local") / "agentcache"
    xdg = _get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "agentcache"


def base_url() -> str | None:
    """``AGENTCACHE_BASE_URL``: an OpenAI-compatible endpoint used instead of the local runtime."""
    return _get("AGENTCACHE_BASE_URL")


def redis_url() -> str | None:
    """``AGENTCACHE_REDIS_URL``: the Redis server of ``create_store("redis")`` (``redis://...``)."""
    return _get("AGENTCACHE_REDIS_URL")


def default_model() -> str | None:
    """``AGENTCACHE_MODEL``: model name or path used when the caller gives none."""
    return _get("AGENTCACHE_MODEL")


def api_key(provider: Provider) -> str | None:
    """API key for ``provider``: ``AGENTCACHE_API_KEY`` first, then the provider's own variable.

    Args:
        provider: ``"openai"`` (also used for any OpenAI-compatible server) or ``"anthropic"``.

    Returns:
        The key, or ``None`` when neither variable is set (local servers often need none).
    """
    return _get("AGENTCACHE_API_KEY") or _get(_PROVIDER_KEYS[provider])
