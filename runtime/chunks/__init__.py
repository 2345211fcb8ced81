"""Chunk reuse beyond the prefix: torch-free span records (``spans``), the assembler, a request's
chunk job, the row forward and exact RoPE re-rotation.

It knows the model runner, the chunk store and a request's KV buffer; it never imports the
scheduler, sampling or the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.chunks.assembler import ChunkAssembler, chunk_reuse_blocker
    from runtime.chunks.job import ChunkJob
    from runtime.chunks.rotation import rerotate, rotation_blocker
    from runtime.chunks.rows import RowForward
    from runtime.chunks.spans import CHUNK_MODES, DEFAULT_RECOMPUTE_FRACTION, ChunkMode, ChunkReuse

# NOTE: lazy, so importing the package loads none of its heavy submodules (torch).
_LAZY = {
    "CHUNK_MODES": "runtime.chunks.spans",
    "ChunkAssembler": "runtime.chunks.assembler",
    "ChunkJob": "runtime.chunks.job",
    "ChunkMode": "runtime.chunks.spans",
    "ChunkReuse": "runtime.chunks.spans",
    "DEFAULT_RECOMPUTE_FRACTION": "runtime.chunks.spans",
    "RowForward": "runtime.chunks.rows",
    "chunk_reuse_blocker": "runtime.chunks.assembler",
    "rerotate": "runtime.chunks.rotation",
    "rotation_blocker": "runtime.chunks.rotation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.chunks' has no attribute {name!r}")


__all__ = [
    "CHUNK_MODES",
    "ChunkAssembler",
    "ChunkJob",
    "ChunkMode",
    "ChunkReuse",
    "DEFAULT_RECOMPUTE_FRACTION",
    "RowForward",
    "chunk_reuse_blocker",
    "rerotate",
    "rotation_blocker",
]
