"""Per-request state: prompt ids, its KV cache, the pinned prefix node, output and timings.

A scheduler drives a Request step by step (admit -> prefill -> decode* -> release); this module
only holds the state and knows nothing about the model or the tree's internals.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime.cache.radix_cache import Namespace, TreeNode
from runtime.model.kv_cache import RequestKVCache
from runtime.outputs import (
    ChunkReuseUsage,
    Completion,
    FinishReason,
    Metrics,
    StreamDelta,
    TokenLogprob,
    Usage,
)
from runtime.request.detokenizer import Detokenizer
from runtime.sampling.params import SamplingParams
from runtime.sampling.sampler import LogitsProcessor, TokenCounts

if TYPE_CHECKING:
    from runtime.chunks.spans import ChunkReuse

__all__ = ["Request", "RequestStatus"]

_log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    RELEASED = "released"


@dataclass(slots=True, eq=False)
class Request:
    """Mutable state of one generation."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: Namespace
    max_total_len: int
    """Prompt + output may not exceed this many positions (the model's context)."""
    stop_ids: frozenset[int]
    detokenizer: Detokenizer
    generator: torch.Generator
    use_prefix_cache: bool = True
    status: RequestStatus = RequestStatus.WAITING
    kv: RequestKVCache | None = None
    node: TreeNode | None = None
    """The prefix-cache node pinned for this request (released exactly once)."""
    cached_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    logits_log: list[torch.Tensor] | None = None
    """When set (debug/tests), the ``[vocab]`` logits of every sampling step are appended."""
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    """Per-request edits of the logits row before sampling (see ``runtime.sampling.sampler``)."""
    token_counts: TokenCounts | None = None
    """Penalty statistics, created by the sampler when a penalty is set."""
    output_logprobs: list[TokenLogprob] | None = None
    """One entry per output id when ``params.logprobs`` is set."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One entry per prompt id when ``params.prompt_logprobs`` is set (set at prefill)."""
    outbox: queue.SimpleQueue[StreamDelta | BaseException] = field(
        default_factory=queue.SimpleQueue
    )
    """Deltas from the scheduler loop to the consumer; an exception ends the stream."""
    released: threading.Event = field(default_factory=threading.Event)
    """Set once the scheduler released everything the request pinned."""
    is_cancelled: bool = False
    t_enqueue: float = 0.0
    """``time.monotonic()`` when submitted (age bound of cache-aware ordering)."""
    waker: Callable[[], None] | None = None
    """Called (scheduler thread) after each ``post``: tells a polling consumer to read."""
    forks: list[Request] = field(default_factory=list)
    """The other choices of an ``n > 1`` request: admitted with this one, they copy its prompt KV
    after its one prefill (they never wait in the queue themselves)."""
    is_fork: bool = False
    """True for a choice that copied another's prompt KV (its prefill computed nothing)."""
    chunk_plan: ChunkReuse | None = None
    """The document spans whose KV comes from the chunk store (None: plain prefix caching)."""
    chunk_usage: ChunkReuseUsage | None = None
    """What the chunk store served, set at prefill when ``chunk_plan`` is set."""
    is_streamed: bool = True
    """False: only the last delta (the one with the Completion) is posted, for a consumer that
    reads nothing else (``Engine.generate``): no wake-up of its thread per token."""

    def post(self, item: StreamDelta | BaseException, *, wake: bool = True) -> None:
        """Hand a delta (or the error that ends the stream) to the consumer and wake it (unless
        ``wake`` is False: the caller then calls ``wake`` once it has posted a whole step's)."""
        self.outbox.put(item)
        if wake:
            self.wake()

    def wake(self) -> None:
        """Call the consumer's waker (if any) for what ``post`` handed it; never raises."""
        if self.waker is not None:
            try:
                self.waker()
            except Exception:  # noqa: BLE001 - a consumer's waker never stops the loop
                _log.exception("waker of a request failed; the consumer must poll")

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> str:
        """Append a sampled token (and its logprob); set ``finish_reason`` when it must end.

        Returns:
            The text this token made final.
        """
        self.output_ids.append(token)
        if logprob is not None:
            if self.output_logprobs is None:
                self.output_logprobs = []
            self.output_logprobs.append(logprob)
        text = self.detokenizer.push(token)
        if token in self.stop_ids or self.detokenizer.is_stopped:
            self.finish_reason = "stop"
        elif len(self.prompt_ids) + len(self.output_ids) >= self.max_total_len:
            self.finish_reason = "length"
        return text

    def completion(self) -> Completion:
        """The finished request's Completion (call after ``t_end`` is set)."""
        n_out = len(self.output_ids)
        decode_s = self.t_end - self.t_first
        return Completion(
            token_ids=list(self.output_ids),
            text=self.detokenizer.text,
            finish_reason=self.finish_reason or "length",
            usage=self.usage,
            metrics=Metrics(
                ttft_s=self.t_first - self.t_start,
                decode_tokens_per_s=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0,
                prefill_tokens_computed=0 if self.is_fork else self._num_computed(),
            ),
            logprobs=None if self.output_logprobs is None else list(self.output_logprobs),
            prompt_logprobs=self.prompt_logprobs,
        )

    @property
    def usage(self) -> Usage:
        """Token counts so far (final once finished; ``cached_len`` is set at admission)."""
        return Usage(len(self.prompt_ids), self.cached_len, len(self.output_ids), self.chunk_usage)

    def num_prompt_computed(self) -> int:
        """Prompt tokens this request ran through the model so far: those in its KV row past
        the cached prefix, less chunk-reused ones (all of ``_num_computed`` once prefilled,
        fewer when cancelled mid-prefill); 0 for a fork (it copies its head's KV) or no row."""
        if self.is_fork or self.kv is None:
            return 0
        reused = 0 if self.chunk_usage is None else self.chunk_usage.reused_tokens
        return min(self.kv.length, len(self.prompt_ids)) - self.cached_len - reused

    def _num_computed(self) -> int:
        reused = 0 if self.chunk_usage is None else self.chunk_usage.reused_tokens
        return len(self.prompt_ids) - self.cached_len - reused

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by generated ids."""
        return self.prompt_ids + self.output_ids

    @property
    def cacheable_ids(self) -> list[int]:
        """The prefix cache's key of this request's KV row (in ``cache_namespace``): its ids,
        under chunk reuse spelled with the spans (``ChunkReuse.cache_ids``)."""
        if self.chunk_plan is None:
            return self.all_ids
        return self.chunk_plan.cache_ids(self.prompt_ids) + self.output_ids

    @property
    def cache_namespace(self) -> Namespace:
        """The prefix-cache namespace of this request's KV: ``namespace``, or under chunk reuse
        its mode's own (assembled KV is not the causal KV)."""
        if self.chunk_plan is None:
            return self.namespace
        return self.chunk_plan.cache_namespace(self.namespace)
