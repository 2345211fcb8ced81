"""Result records of the local runtime: Completion, StreamDelta, Usage, Metrics, CacheStats.

Plain frozen data; they know nothing about tensors, the tree or the model. Field names follow the
OpenAI usage fields (``prompt_tokens``, ``cached_tokens``, ``completion_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from runtime.cache.records import ChunkStoreStats, DiskTierStats

__all__ = [
    "CacheStats",
    "ChunkReuseUsage",
    "ChunkStoreStats",
    "Completion",
    "DiskTierStats",
    "FinishReason",
    "Metrics",
    "StreamDelta",
    "TokenLogprob",
    "Usage",
]

FinishReason = Literal["stop", "length"]


class TokenLogprob(NamedTuple):
    """Logprob of one token under the raw model distribution (log-softmax of its logits)."""

    token_id: int
    logprob: float
    """Natural log of the token's probability; ``-inf`` when the model gives it none."""
    top: tuple[tuple[int, float], ...]
    """The most likely ``(token_id, logprob)`` pairs at that position, most likely first."""


@dataclass(frozen=True, slots=True)
class ChunkReuseUsage:
    """Document chunks of one request whose KV came from the chunk store (``runtime.chunks``).

    Counted apart from the prefix cache's ``cached_tokens``; every span token is in exactly one
    of ``reused_tokens``, ``recomputed_tokens`` and ``missed_tokens``.
    """

    mode: Literal["exact", "blend"]
    """``"exact"``: block-attention answer; ``"blend"``: an approximation of the causal one."""
    reused_tokens: int
    """Span tokens whose stored KV (re-rotated) was used as is."""
    recomputed_tokens: int
    """Blend only: span tokens loaded, then recomputed in layers 1..L-1 (0 in exact mode)."""
    missed_tokens: int
    """Span tokens of chunks not in the store: computed alone at position 0, then stored."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    """Tokens in the prompt after rendering and tokenization."""
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache, either tier (not recomputed)."""
    completion_tokens: int
    """Tokens generated, including a final stop token id if one was sampled."""
    chunk_reuse: ChunkReuseUsage | None = None
    """Set only for a request that asked for chunk reuse (never on by itself)."""


@dataclass(frozen=True, slots=True)
class Metrics:
    """Timings of one request, in seconds and tokens per second."""

    ttft_s: float
    """Time to first token: from submission to the first sampled token (queueing included), s."""
    decode_tokens_per_s: float
    """Generated tokens after the first, divided by the time spent producing them (0.0 if none)."""
    prefill_tokens_computed: int
    """Prompt tokens that went through the model (``prompt_tokens - cached_tokens``, less the
    chunk store's ``reused_tokens`` under chunk reuse)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """The full result of ``Engine.generate`` (also carried by the last ``StreamDelta``)."""

    token_ids: list[int]
    """Generated token ids (the stop token id included when one ended the request)."""
    text: str
    """Decoded text of ``token_ids`` without special tokens, cut before any stop string."""
    finish_reason: FinishReason
    """``"stop"``: a stop string, stop token id or EOS; ``"length"``: max_tokens or context full."""
    usage: Usage
    metrics: Metrics
    logprobs: list[TokenLogprob] | None = None
    """One entry per id of ``token_ids`` when ``SamplingParams.logprobs`` was set, else None."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One entry per prompt id (the first is None: nothing predicts it) when
    ``SamplingParams.prompt_logprobs`` was set, else None."""


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One increment of ``Engine.stream``: new token ids and the text they completed."""

    token_ids: list[int]
    """Token ids generated since the previous delta (may be empty on the last delta)."""
    text: str
    """Text made final since the previous delta (held back while it may start a stop string)."""
    finish_reason: FinishReason | None = None
    """Set on the last delta only."""
    completion: Completion | None = None
    """The whole Completion, on the last delta only."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One entry per id of ``token_ids`` when ``SamplingParams.logprobs`` was set, else empty."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """As ``Completion.prompt_logprobs``, on the first delta only."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Prefix cache counters since the engine started (or since ``flush_cache`` for occupancy)."""

    queried_tokens: int
    """Prompt tokens looked up in the prefix cache."""
    hit_tokens: int
    """Prompt tokens served from the prefix cache (both tiers)."""
    bytes_used: int
    """Bytes of KV blocks currently holding cached tokens."""
    bytes_total: int
    """Byte budget of the KV pool actually allocated (whole blocks)."""
    num_blocks_used: int
    """Blocks holding cached tokens (in use or evictable)."""
    num_blocks_total: int
    """Blocks in the pool."""
    num_evictions: int
    """Blocks evicted to make room, since the engine started."""
    is_enabled: bool
    """False when prefix reuse is off (``prefix_cache=False`` or an unsafe model)."""
    disabled_reason: str | None
    """Why reuse is off, when it is."""
    num_blocks_pinned: int = 0
    """Blocks pinned by running requests (not evictable now)."""
    disk_hit_tokens: int = 0
    """Of ``hit_tokens``, those whose blocks were loaded back from the disk tier."""
    disk: DiskTierStats | None = None
    """The disk tier's figures (None without one)."""
    chunk_store: ChunkStoreStats | None = None
    """The chunk store's figures (``runtime.chunks.assembler``; None from an engine without one)."""

    @property
    def memory_hit_tokens(self) -> int:
        """Of ``hit_tokens``, those served from the in-memory pool."""
        return self.hit_tokens - self.disk_hit_tokens

    @property
    def pool_fill(self) -> float:
        """Fraction of the pool's blocks holding cached tokens (0.0 for an empty pool)."""
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
