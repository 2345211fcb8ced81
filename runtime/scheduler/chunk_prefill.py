"""A chunk-reuse request's prefill spread over scheduler iterations, within their budget.

Phase 1 opens the request's ``ChunkJob`` (``ChunkAssembler.open``: stored chunks read once) and
computes its missed chunks alone, at most the tokens it is given per call; phase 2
(``ChunkAssembler.finish``) places every chunk and runs the other rows at once, waiting for a
whole iteration's budget when the rest of one is too small. It holds the job of the one request
mid-prefill; it knows neither the queue, the batch rows, sampling nor the prefix cache
(``runtime.scheduler.loop`` budgets the calls and finishes the request).
"""

from __future__ import annotations

import torch

from runtime.cache.chunk_store import ChunkStore
from runtime.chunks.assembler import ChunkAssembler
from runtime.chunks.job import ChunkJob
from runtime.request.state import Request

__all__ = ["ChunkPrefill"]


class ChunkPrefill:
    """Drives one chunk-reuse request's assembly over calls of ``step``.

    Args:
        assembler: Opens the request's ``ChunkJob`` and places its chunks.
        chunk_tokens: A whole iteration's prefill budget (``prefill_chunk_tokens``, tokens):
            phase 2 that needs more tokens than a call gives waits for a call given this many.
    """

    def __init__(self, assembler: ChunkAssembler, chunk_tokens: int) -> None:
        self.assembler = assembler
        self.chunk_tokens = chunk_tokens
        self._job: ChunkJob | None = None
        """The chunks gathered so far of the request mid-prefill (phase 1), None between them."""

    @property
    def store(self) -> ChunkStore:
        """The chunk store the jobs read and fill."""
        return self.assembler.store

    def run(self, req: Request, max_tokens: int) -> tuple[int, torch.Tensor | None]:
        """The next step of ``req``'s assembly (``runtime.chunks``): phase 1 computes missed
        chunks alone (at most ``max_tokens``), phase 2 places every chunk in ``req``'s row, runs
        the rest of the prompt and sets ``req.chunk_usage``. It waits for a whole iteration's
        budget if it needs more than ``max_tokens`` (then reports them run, to end this
        iteration's prefill).

        Returns:
            Prompt tokens run, and the last ``[vocab]`` logits once assembled (else None).
        """
        assert req.chunk_plan is not None and req.kv is not None, "a chunk request with a row"
        ids, plan, start = req.prompt_ids, req.chunk_plan, req.kv.length
        job = self._job
        if job is None:
            job = self._job = self.assembler.open(req.namespace, ids, plan, start)
        if not job.is_ready:
            return job.compute(max_tokens), None
        num_run = self.assembler.num_finish_tokens(ids, plan, start)
        if num_run > max_tokens and max_tokens < self.chunk_tokens:
            return max_tokens, None
        logits, req.chunk_usage = self.assembler.finish(job, ids, plan, req.kv)
        self._job = None
        return num_run, logits

    def drop(self) -> int:
        """Forget the open job (its request was released: finished, cancelled or failed).

        Returns:
            Chunk tokens the job ran through the model (work done; 0 without a job). The chunks
            it finished stay in the store.
        """
        job, self._job = self._job, None
        return 0 if job is None else job.num_computed
