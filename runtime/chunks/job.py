"""One request's document chunks gathered over scheduler iterations (phase 1 of chunk reuse).

Each distinct chunk of the prompt is read from the ``ChunkStore`` when the job opens, or computed
alone at positions ``[0, n)``, at most a token budget per call (a chunk longer than the budget in
pieces into its own scratch cache, across calls) and then stored. The job holds every chunk's KV
itself, so another request's eviction between iterations loses nothing. It knows the model
runner, the chunk store and token ids, never prompt positions, a request's KV row or the scheduler
(``runtime.chunks.assembler`` places the chunks; ``runtime.scheduler.loop`` budgets the calls).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.cache.chunk_store import ChunkStore
from runtime.cache.radix_cache import Namespace
from runtime.model.kv_cache import RequestKVCache
from runtime.model.runner import ModelRunner

__all__ = ["Chunk", "ChunkJob"]

Chunk = tuple[int, ...]
"""A chunk's token ids (the chunk store's key, with the namespace)."""


class ChunkJob:
    """The KV of a prompt's chunks, gathered over calls of ``compute``.

    Args:
        runner: Runs the missed chunks alone.
        store: Read once per distinct chunk here (counting a hit or miss); a computed chunk is
            put there too (when it fits).
        namespace: The request's namespace (the chunk store's key prefix).
        chunks: The prompt's chunks in prompt order; a repeated one is read or computed once.
    """

    def __init__(
        self, runner: ModelRunner, store: ChunkStore, namespace: Namespace, chunks: Sequence[Chunk]
    ) -> None:
        self.runner, self.store, self.namespace = runner, store, namespace
        self._kv: dict[Chunk, torch.Tensor] = {}
        """Each gathered chunk's ``[L, 2, H_kv, n, D]`` KV at positions ``[0, n)``."""
        self.todo: list[Chunk] = []
        """Missed chunks not computed yet, the one under way (``_scratch``) first."""
        for chunk in dict.fromkeys(chunks):
            stored = store.get(namespace, chunk)
            if stored is None:
                self.todo.append(chunk)
            else:
                self._kv[chunk] = stored
        self.missed = frozenset(self.todo)
        """The chunks that missed the store (computed alone by this job)."""
        self.num_computed = 0
        """Tokens run through the model so far (pieces of missed chunks)."""
        self._scratch: RequestKVCache | None = None

    @property
    def is_ready(self) -> bool:
        """Whether every chunk's KV is here (phase 2 may place them)."""
        return not self.todo

    def kv(self, chunk: Chunk) -> torch.Tensor:
        """``[L, 2, H_kv, n, D]`` KV of ``chunk`` at positions ``[0, n)`` (a gathered chunk)."""
        return self._kv[chunk]

    @torch.no_grad()
    def compute(self, max_tokens: int) -> int:
        """Run missed chunks alone, at most ``max_tokens`` tokens in all: the rest of the chunk
        under way, then the next ones; each finished chunk is kept here and stored.

        Returns:
            Tokens run (0 only when ``is_ready``).
        """
        num_run = 0
        while self.todo and num_run < max_tokens:
            chunk = self.todo[0]
            if self._scratch is None:
                self._scratch = self.runner.new_cache(len(chunk))
            done = self._scratch.length
            piece = list(chunk[done : done + max_tokens - num_run])
            self.runner.forward(piece, self._scratch)  # NOTE: appends at [done, done + len)
            num_run += len(piece)
            if self._scratch.length == len(chunk):
                self._keep(chunk, self._scratch.span(0, len(chunk)))
        self.num_computed += num_run
        return num_run

    def _keep(self, chunk: Chunk, kv: torch.Tensor) -> None:
        """Hold a computed chunk's ``[L, 2, H_kv, n, D]`` KV, store it, start the next one."""
        self._kv[chunk] = kv
        self.store.put(self.namespace, chunk, kv)
        self.todo.pop(0)
        self._scratch = None
