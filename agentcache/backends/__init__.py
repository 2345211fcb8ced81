"""Model backends behind one interface, and the factory that picks one by name or URL.

``create_backend("local")``, ``create_backend("http://host:8000/v1")``, ``create_backend("fake")``.
Implementations are imported lazily so that naming ``openai`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentcache.backends.base import (
    BaseBackend,
    Capabilities,
    GenerationOptions,
    ModelResponse,
    PromptLike,
    StreamEvent,
    ToolCall,
)
from agentcache.backends.hints import EngineHints
from agentcache.exceptions import ConfigError

__all__ = [
    "BACKENDS",
    "BaseBackend",
    "Capabilities",
    "EngineHints",
    "GenerationOptions",
    "ModelResponse",
    "PromptLike",
    "StreamEvent",
    "ToolCall",
    "create_backend",
]

BACKENDS: dict[str, str] = {
    "anthropic": "agentcache.backends.anthropic:AnthropicBackend",
    "fake": "agentcache.backends.fake:FakeBackend",
    "local": "agentcache.backends.local:LocalBackend",
    "openai": "agentcache.backends.openai:OpenAIBackend",
}
"""Registry: backend name -> ``module:class``."""

_DEFAULT_MODELS: dict[str, str] = {"local": "tiny"}


def create_backend(name_or_url: str, *, model: str | None = None, **options: Any) -> BaseBackend:
    """Create a backend by registry name, or an ``OpenAIBackend`` for an ``http(s)://`` URL.

    Args:
        name_or_url: One of ``BACKENDS`` or the base URL of an OpenAI-compatible endpoint.
        model: Model name or path; ``local`` defaults to the bundled ``tiny`` model; for a URL,
            ``None`` asks the endpoint's ``GET /models`` and uses the first model listed.
        **options: Keyword options of the chosen backend's constructor.

    Returns:
        The backend instance.

    Raises:
        ConfigError: Unknown name (the message lists the valid ones), or a missing model name
            (``openai`` and ``anthropic`` by name need one).
        BackendUnavailableError: The backend's optional dependency is not installed, or a URL's
            model list cannot be read.
    """
    is_url = name_or_url.startswith(("http://", "https://"))
    name = "openai" if is_url else name_or_url
    if is_url:
        options["base_url"] = name_or_url
    if name not in BACKENDS:
        valid = ", ".join(sorted(BACKENDS))
        raise ConfigError(
            f"unknown backend {name_or_url!r}; valid names: {valid}, or an http(s):// base URL"
        )
    module_name, _, class_name = BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if name == "fake":
        return cls(model=model or "fake-model", **options)  # type: ignore[no-any-return]
    chosen = model or _DEFAULT_MODELS.get(name)
    if chosen is None and is_url:
        return cls(None, **options)  # type: ignore[no-any-return]  # NOTE: discovers the model.
    if chosen is None:
        raise ConfigError(f"backend {name!r} needs a model: create_backend({name!r}, model=...)")
    return cls(chosen, **options)  # type: ignore[no-any-return]
