"""Chunk reuse beyond the prefix: assemble a prompt's document chunks from stored per-chunk KV.

A request marks token spans of its prompt as document chunks. Each chunk's KV is read from the
``ChunkStore`` (computed alone at positions ``[0, n)`` and stored on a miss), its keys re-rotated
to the chunk's place (``chunk_rotation.rerotate``), then:

- ``"exact"``: the answer of a prefill under the block attention mask (``block_attention_mask``):
  a token inside a span attends only to earlier tokens of its own span; every other token (the
  head before the first span, separators between spans, the question after the last) attends to
  every earlier token. Reused chunk KV equals that prefill's KV up to float rounding, for any
  RoPE model. NOTE: chunks do not attend to the head: under RoPE the head-to-chunk scores depend
  on where the chunk lands, so a head-attending chunk's KV could not be moved exactly. Models
  trained with block attention (Block-Attention, 2024) answer well this way; others answer worse.
- ``"blend"`` (approximate, CacheBlend's selection, EuroSys 2025): the target is the ordinary
  causal prefill. Layer 0 runs for every token after the cached head; layer 1's K/V are
  compared with the stored ones and the span tokens that deviate most (a ``recompute_fraction``
  of them), plus every non-span token after the head, run through layers 1..L-1; the other
  positions keep their stored KV. At fraction 1 it is the causal prefill. Needs the compact
  forward (it runs layer by layer).

It knows the model runner, the chunk store and a request's KV buffer, never the scheduler,
sampling or HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from runtime.cache.chunk_store import ChunkStore
from runtime.cache.radix_cache import Namespace
from runtime.chunks.job import ChunkJob
from runtime.chunks.rotation import rerotate, rotation_blocker
from runtime.chunks.rows import RowForward
from runtime.chunks.spans import ChunkMode, ChunkReuse, Span
from runtime.model.kv_cache import RequestKVCache
from runtime.model.runner import ModelRunner
from runtime.outputs import ChunkReuseUsage

__all__ = [
    "ChunkAssembler",
    "block_attention_mask",
    "chunk_reuse_blocker",
    "masked_prefill_logits",
]


def chunk_reuse_blocker(runner: ModelRunner, mode: ChunkMode) -> str | None:
    """Why ``runner``'s model cannot reuse chunk KV in ``mode``, or None when it can."""
    why = rotation_blocker(runner.model)
    if why is not None:
        return why
    config = runner.model.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None)
    is_windowed = window is not None and (
        config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    )
    if kinds != {"full_attention"} or is_windowed:
        return f"layer types {sorted(kinds)} / sliding_window={window}: the block mask is full"
    if mode == "blend" and runner.compact is None:
        return f"blend mode runs layer by layer on the compact forward ({runner.path_reason})"
    return None


def block_attention_mask(length: int, spans: Sequence[Span]) -> torch.Tensor:
    """``[length, length]`` bool mask of exact mode (True = row may attend to column).

    Causal; a token inside a span sees only earlier tokens of its own span; any other token
    sees every earlier token.
    """
    owner = torch.full((length,), -1, dtype=torch.long)  # span index of each token, -1 = none
    for i, (start, end) in enumerate(spans):
        owner[start:end] = i
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    free = (owner < 0).unsqueeze(1)  # [length, 1]
    same = owner.unsqueeze(1) == owner.unsqueeze(0)  # [length, length]
    return causal & (free | same)


@torch.no_grad()
def masked_prefill_logits(model: Any, ids: Sequence[int], spans: Sequence[Span]) -> torch.Tensor:
    """Reference: ``[n, vocab]`` logits of one transformers forward under the block mask.

    The model's own forward with a 4D boolean mask, no cache, positions ``0..n-1``.
    """
    mask = block_attention_mask(len(ids), spans)
    device = next(model.parameters()).device
    out = model(
        input_ids=torch.tensor([list(ids)], device=device),
        attention_mask=mask.view(1, 1, len(ids), len(ids)).to(device),
        position_ids=torch.arange(len(ids), device=device).unsqueeze(0),
    )
    logits: torch.Tensor = out.logits[0].float()
    return logits


class ChunkAssembler:
    """Fills a request's KV buffer from its chunks' KV and returns the last prompt logits.

    Two phases, so the scheduler can interleave decode steps: ``open`` a ``ChunkJob`` that reads
    the stored chunks and computes the missed ones over as many calls as the budget asks
    (``ChunkJob.compute``); then ``finish`` places every chunk and runs the other rows at once.
    NOTE: nothing is written to the request's KV before ``finish``: a row mid-prefill is fed a
    placeholder at ``kv.length`` by every decode step (``ModelRunner.decode``).
    """

    def __init__(self, runner: ModelRunner, store: ChunkStore) -> None:
        self.runner = runner
        self.store = store

    def open(self, namespace: Namespace, ids: list[int], plan: ChunkReuse, start: int) -> ChunkJob:
        """Phase 1's job for the chunks of ``ids`` at or after ``start`` (the prefix cache's
        hit); reads the stored ones now (``ChunkJob``)."""
        chunks = [tuple(ids[s:e]) for s, _, e in _pieces(plan, start)]
        return ChunkJob(self.runner, self.store, namespace, chunks)

    def num_finish_tokens(self, ids: list[int], plan: ChunkReuse, start: int) -> int:
        """Prompt tokens ``finish`` runs through the model (the scheduler's budget): the rows
        outside spans from ``start``; blend adds the recomputed span rows and its layer 0 over
        every row, counted as ``1 / num_layers`` of a token each."""
        num_span = sum(e - s for s, e in plan.spans_from(start))
        num_free = len(ids) - start - num_span
        if plan.mode == "exact":
            return num_free
        num_layers = self.runner.kv_shape.num_layers
        num_pick = math.ceil(plan.recompute_fraction * num_span)
        return num_free + num_pick + math.ceil((len(ids) - start) / num_layers)

    @torch.no_grad()
    def finish(
        self, job: ChunkJob, ids: list[int], plan: ChunkReuse, kv: RequestKVCache
    ) -> tuple[torch.Tensor, ChunkReuseUsage]:
        """Place the chunks of ``job`` (ready) into ``kv``, which holds ``[0, kv.length)`` from the
        prefix cache (the head, or an earlier assembled opening, maybe ending inside a span:
        then that chunk's tail is placed, ``ChunkReuse.spans_from``), run the other rows, and
        set ``kv.length = len(ids)``.

        Returns:
            ``[vocab]`` logits of the last prompt position and the request's chunk usage (span
            tokens the prefix cache served are its cached tokens, not counted here).
        """
        assert job.is_ready, "finish after every chunk was gathered"
        start = kv.length
        spans = plan.spans_from(start)
        kv.reserve(len(ids))
        missed = self._place_all(job, ids, plan, kv)
        num_missed = sum(e - s for s, e in missed)
        in_span = self._span_rows(spans, start, len(ids))
        num_recomputed = 0
        compact = self.runner.compact
        if compact is None:  # NOTE: exact only (chunk_reuse_blocker)
            logits = self._exact_stepwise(ids, spans, kv)
        elif plan.mode == "exact":
            # NOTE: the rows outside spans (the head's rest, separators, the question) run here
            fwd = RowForward(compact, kv.span(0, len(ids)), ids, start)
            logits = fwd.run((~in_span).nonzero().squeeze(1))
        else:
            num_pick = math.ceil(plan.recompute_fraction * int(in_span.sum()))
            fwd = RowForward(compact, kv.span(0, len(ids)), ids, start)
            logits, rows = fwd.blend(in_span, num_pick)
            # NOTE: a missed chunk's tokens count as missed, recomputed or not.
            stored = in_span & ~self._span_rows(missed, start, len(ids))
            num_recomputed = int(stored[rows].sum())
        kv.length = len(ids)
        num_span = sum(end - start for start, end in spans)
        usage = ChunkReuseUsage(
            mode=plan.mode,
            reused_tokens=num_span - num_missed - num_recomputed,
            recomputed_tokens=num_recomputed,
            missed_tokens=num_missed,
        )
        return logits, usage

    def _exact_stepwise(
        self, ids: list[int], spans: Sequence[Span], kv: RequestKVCache
    ) -> torch.Tensor:
        """Exact mode on any forward: the tokens before, between and after the placed chunks
        (``spans``, all at or after ``kv.length``) run causally over everything before them,
        one run of tokens at a time; ``[vocab]`` logits of the last prompt position."""
        logits = torch.empty(0)
        pos = kv.length
        for start, end in [*spans, (len(ids), len(ids))]:
            kv.length = pos
            if pos < start:
                logits = self.runner.forward(ids[pos:start], kv)  # NOTE: these see all before
            pos = end
        return logits  # NOTE: the last run ends at the last prompt token (ChunkReuse.check)

    def _span_rows(self, spans: Sequence[Span], start: int, n: int) -> torch.Tensor:
        """``[n - start]`` bool: which positions from ``start`` on lie inside a span."""
        in_span = torch.zeros(n - start, dtype=torch.bool, device=self.runner.device)
        for s, e in spans:
            in_span[s - start : e - start] = True
        return in_span

    def _place_all(
        self, job: ChunkJob, ids: list[int], plan: ChunkReuse, kv: RequestKVCache
    ) -> list[Span]:
        """Write every chunk's KV at its place from ``kv.length`` on; the placed spans whose
        chunk missed the store (a repeated chunk's first place only: it was computed once)."""
        missed, seen = [], set()
        for s, at, e in _pieces(plan, kv.length):
            chunk = tuple(ids[s:e])
            if chunk in job.missed and chunk not in seen:
                missed.append((at, e))
            seen.add(chunk)
            stored = job.kv(chunk)[:, :, :, at - s :]  # [L, 2, H_kv, e - at, D]
            span = kv.span(at, e)
            span[:, 1].copy_(stored[:, 1])
            span[:, 0].copy_(rerotate(self.runner.model, stored[:, 0], s))
        return missed


def _pieces(plan: ChunkReuse, start: int) -> list[tuple[int, int, int]]:
    """``(chunk start, place from, end)`` of each span ending after ``start``: a chunk is placed
    from ``max(chunk start, start)`` on, its keys rotated by its chunk start."""
    return [(s, max(s, start), e) for s, e in plan.spans if e > start]
