"""Prefill kinds: how one request's next prompt tokens run, behind one small interface.

A plain prompt runs its next chunk on the model runner; a prompt asking for prompt logprobs runs
whole, scoring every position (``scoring.prefill_scored``); a chunk-reuse prompt gathers and
places its document chunks over iterations (``chunk_prefill.ChunkPrefill``). The executor picks
the kind with ``PrefillKinds.of`` and calls ``run``; it knows one request's row, never the queue,
sampling or the prefix cache.
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.exceptions import RuntimeEngineError
from runtime.model.runner import ModelRunner
from runtime.request.state import Request
from runtime.scheduler.chunk_prefill import ChunkPrefill
from runtime.scheduler.scoring import prefill_scored

__all__ = ["PlainPrefill", "PrefillKind", "PrefillKinds", "ScoredPrefill"]


class PrefillKind(Protocol):
    """One way to run a request's next prompt tokens into its KV row."""

    def run(self, req: Request, max_tokens: int) -> tuple[int, torch.Tensor | None]:
        """Run at most ``max_tokens`` more of ``req``'s prompt (a kind may run more at once: a
        scored prompt runs whole, a chunk assembly as one step).

        Returns:
            Prompt tokens run (at least 1, so the iteration's budget shrinks), and the
            ``[vocab]`` logits of the last position run, or None when nothing is to sample yet.

        Raises:
            Exception: whatever the forward raised; the executor fails that request alone.
        """
        ...


class PlainPrefill:
    """The next chunk of the prompt after what the row holds (cached or run before)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, req: Request, max_tokens: int) -> tuple[int, torch.Tensor | None]:
        """See ``PrefillKind.run``."""
        assert req.kv is not None, "a running request has a KV row"
        chunk = req.prompt_ids[req.kv.length : req.kv.length + max_tokens]
        return max(1, len(chunk)), self.runner.forward(chunk, req.kv)


class ScoredPrefill:
    """The whole prompt, uncached, in its own logits chunks (prompt logprobs)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, req: Request, max_tokens: int) -> tuple[int, torch.Tensor | None]:
        """See ``PrefillKind.run``; ``max_tokens`` is not a limit here (the prompt runs whole)."""
        return len(req.prompt_ids), prefill_scored(self.runner, req)


class _NoChunkStore:
    def run(self, req: Request, max_tokens: int) -> tuple[int, torch.Tensor | None]:
        raise RuntimeEngineError("this scheduler has no chunk store")


class PrefillKinds:
    """The kinds of one scheduler: which runs a request (``of``)."""

    def __init__(self, runner: ModelRunner, chunks: ChunkPrefill | None) -> None:
        self.plain = PlainPrefill(runner)
        self.scored = ScoredPrefill(runner)
        self.chunks: PrefillKind = _NoChunkStore() if chunks is None else chunks

    def of(self, req: Request) -> PrefillKind:
        """Chunk reuse, prompt scoring, or a plain prompt (the kinds never mix: admission
        refuses a chunk-reuse request with prompt logprobs)."""
        if req.chunk_plan is not None:
            return self.chunks
        if req.params.prompt_logprobs is not None:
            return self.scored
        return self.plain
