"""The model data plane: loading a model, its forward passes (compact and transformers), the KV
buffers of running requests (one request's, the batch's rows, masks), the fp32 products, GGUF
blocks, the native kernels and the OpenMP pool. It knows tensors, positions and weights; it never
imports requests, the scheduler, the prefix cache, chunk reuse or the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.model.batch_kv import BatchKV
    from runtime.model.compact_llama import CompactLlama
    from runtime.model.kv_cache import RequestKVCache
    from runtime.model.loading import load_model
    from runtime.model.names import check_model_name
    from runtime.model.openmp import release_thread_workers
    from runtime.model.runner import ModelRunner

# NOTE: lazy, so importing the package loads none of its heavy submodules (torch).
_LAZY = {
    "BatchKV": "runtime.model.batch_kv",
    "CompactLlama": "runtime.model.compact_llama",
    "ModelRunner": "runtime.model.runner",
    "RequestKVCache": "runtime.model.kv_cache",
    "check_model_name": "runtime.model.names",
    "load_model": "runtime.model.loading",
    "release_thread_workers": "runtime.model.openmp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.model' has no attribute {name!r}")


__all__ = [
    "BatchKV",
    "CompactLlama",
    "ModelRunner",
    "RequestKVCache",
    "check_model_name",
    "load_model",
    "release_thread_workers",
]
