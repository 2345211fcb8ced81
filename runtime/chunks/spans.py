"""Chunk-reuse records: which token spans of a prompt are document chunks, and in which mode.

Plain data without torch (the server builds them, the request carries them): the spans, the
mode, blend's recompute fraction, and the prefix-cache keys an assembled prompt is stored under.
It knows the prefix cache's namespace type, never tensors, the model or the scheduler.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

from runtime.cache.radix_cache import Namespace
from runtime.exceptions import ChunkReuseError

__all__ = ["CHUNK_MODES", "DEFAULT_RECOMPUTE_FRACTION", "ChunkMode", "ChunkReuse", "Span"]

ChunkMode: TypeAlias = Literal["exact", "blend"]
CHUNK_MODES: tuple[str, ...] = get_args(ChunkMode)

Span = tuple[int, int]

DEFAULT_RECOMPUTE_FRACTION = 0.15
"""Blend's share of span tokens recomputed by default (CacheBlend reports ~15% enough)."""

_SPAN_START = 1 << 40
_IN_SPAN = 1 << 41
"""Offsets of span tokens in prefix-cache keys (``ChunkReuse.cache_ids``): far above any vocab."""


@dataclass(frozen=True, slots=True)
class ChunkReuse:
    """A request's document chunks and how to reuse their KV (opt-in; see the module docstring).

    Raises:
        ChunkReuseError: on construction, for an unknown mode, a fraction outside [0, 1] or
            spans that are empty, unsorted or overlapping (``check`` tests them on a prompt).
    """

    spans: tuple[Span, ...]
    """``(start, end)`` token index pairs of the prompt, end exclusive, sorted, disjoint."""
    mode: ChunkMode = "exact"
    """``"exact"`` (block attention mask) or ``"blend"`` (approximate causal prefill)."""
    recompute_fraction: float = DEFAULT_RECOMPUTE_FRACTION
    """Blend only: the share of span tokens recomputed (CacheBlend's default is about 15%)."""

    def __post_init__(self) -> None:
        if self.mode not in CHUNK_MODES:
            raise ChunkReuseError(f"chunk mode {self.mode!r} is unknown; valid: {CHUNK_MODES}")
        fraction = self.recompute_fraction
        if isinstance(fraction, bool) or not 0.0 <= fraction <= 1.0:
            raise ChunkReuseError(f"recompute_fraction must be in [0, 1], got {fraction!r}")
        if not self.spans:
            raise ChunkReuseError("chunk reuse needs at least one span")
        prev_end = 0
        for i, span in enumerate(self.spans):
            if len(span) != 2 or not all(type(x) is int for x in span):
                raise ChunkReuseError(f"spans[{i}] must be [start, end] integers, got {span!r}")
            start, end = span
            if start < prev_end or end <= start:
                previous = f" (the previous ends at {prev_end})" if i else ""
                raise ChunkReuseError(
                    f"spans[{i}]={list(span)!r}: spans must be non-empty ([start, end) with "
                    f"end > start), sorted and disjoint{previous}"
                )
            prev_end = end

    def check(self, prompt_len: int) -> None:
        """Raise ChunkReuseError unless every span ends before the last prompt token.

        NOTE: the last prompt token is always computed (it gives the first logits), so it may
        not be inside a chunk.
        """
        end = self.spans[-1][1]
        if end > prompt_len - 1:
            raise ChunkReuseError(
                f"spans end at token {end} but the prompt has {prompt_len} tokens; the last "
                "span must end before the last prompt token (the question follows the chunks)"
            )

    @property
    def head_len(self) -> int:
        """Tokens before the first span (their KV is the plain causal KV)."""
        return self.spans[0][0]

    def cache_namespace(self, namespace: Namespace) -> Namespace:
        """The prefix-cache namespace of assembled prompts in this mode (and blend fraction):
        their KV is not the causal KV, so it never meets a plain request's."""
        tag = f"{namespace}\0chunk-{self.mode}"
        if self.mode == "blend":
            tag += f"\0{self.recompute_fraction!r}"
        return Namespace(hashlib.sha256(tag.encode()).hexdigest())

    def cache_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as the prefix cache's key: a span's first token shifted by ``_SPAN_START``,
        its other tokens by ``_IN_SPAN``, so a key prefix spells the spans it covers.

        NOTE: in exact mode the KV at position ``p`` depends only on ``ids[: p + 1]`` and the
        spans within them, which is what a key prefix pins: a later prompt that repeats an
        assembled prompt's opening (same documents at the same places: the next turn of a
        conversation) hits it in the prefix cache, whatever follows. Blend's recompute choice
        looks at the whole prompt, so there a hit reuses the earlier request's blended KV.
        """
        key = list(ids)
        for start, end in self.spans:
            if start >= len(key):
                break
            key[start] += _SPAN_START
            for i in range(start + 1, min(end, len(key))):
                key[i] += _IN_SPAN
        return key

    def spans_from(self, position: int) -> tuple[Span, ...]:
        """The spans' parts at or after ``position`` (the prefix cache's hit): a span the hit
        ends inside is clipped to its tail ``(position, end)``.

        NOTE: exact mode's KV at ``p`` in a span depends only on ``ids[start : p + 1]``, so a
        hit inside a span is exact up to ``position`` (``cache_ids`` pins the span's start)
        and only the tail is placed from the stored chunk (``ChunkAssembler``). Blend does the
        same (approximate anyway: its selection runs over the rows from ``position``).
        """
        return tuple((max(s, position), e) for s, e in self.spans if e > position)
