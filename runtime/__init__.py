"""runtime: the bundled local inference engine (transformers + torch) with an exact prefix cache.

Importable as ``runtime``; it never imports the agentcache SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from runtime.exceptions import (
    ChunkReuseError,
    EngineBusyError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    RuntimeEngineError,
    TooManyChoicesError,
)
from runtime.models import resolve_model

if TYPE_CHECKING:
    from runtime.chunks.spans import ChunkReuse
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.outputs import CacheStats, Completion, Metrics, StreamDelta, Usage
    from runtime.sampling.params import SamplingParams
    from runtime.scheduler.config import SchedulerConfig

# NOTE: torch/transformers load on first use of these names, not on `import runtime`.
_LAZY = {
    "ChunkReuse": "runtime.chunks.spans",
    "Engine": "runtime.engine",
    "EngineConfig": "runtime.config",
    "SchedulerConfig": "runtime.scheduler.config",
    "CacheStats": "runtime.outputs",
    "Completion": "runtime.outputs",
    "Metrics": "runtime.outputs",
    "StreamDelta": "runtime.outputs",
    "Usage": "runtime.outputs",
    "SamplingParams": "runtime.sampling.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")


__all__ = [
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
    "RuntimeEngineError",
    "SamplingParams",
    "SchedulerConfig",
    "StreamDelta",
    "TooManyChoicesError",
    "Usage",
    "resolve_model",
]
