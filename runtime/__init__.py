"""runtime: the bundled local inference engine (transformers + torch) with an exact prefix cache.

Importable as ``runtime``; it never imports the agentcache SDK.
"""

from __future__ import annotations

from runtime.exceptions import (
    EngineBusyError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    RuntimeEngineError,
)
from runtime.models import resolve_model

__all__ = [
    "EngineBusyError",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptTooLongError",
    "RuntimeEngineError",
    "resolve_model",
]
