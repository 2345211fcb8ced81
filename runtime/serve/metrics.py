"""Prometheus metrics of the HTTP server, in a per-app ``CollectorRegistry``.

Per-request counters and histograms are fed by the server (chunk-reuse tokens from each
request's usage); prefix-cache and chunk-store figures, the queue and the work counters
(prefill tokens computed, tokens generated: cancelled requests' work included) are read
from ``engine.cache_stats()`` / ``engine.scheduler_stats()`` at scrape time (the engine
keeps the totals). Names follow vLLM/SGLang
(prompt/cached tokens, prefix cache queries/hits, TTFT, TPOT, running/waiting requests) under
the ``agentcache_`` prefix. It knows no HTTP and no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.outputs import CacheStats, ChunkStoreStats, Completion, DiskTierStats, Usage
from runtime.scheduler.config import SchedulerStats

__all__ = ["CONTENT_TYPE", "Outcome", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "agentcache"
Outcome = Literal[
    "stop", "length", "tool_calls", "cancelled", "invalid", "unauthorized", "rejected", "error"
]
# Bucket edges (seconds) as in vLLM's TTFT / TPOT histograms, trimmed to a CPU runtime's range.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class _CacheCollector(Collector):
    """Reads the engine's cumulative prefix-cache counters on every scrape."""

    def __init__(self, read: Callable[[], CacheStats]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        yield _counter("prefix_cache_queries", "Prompt tokens looked up", stats.queried_tokens)
        yield _counter("prefix_cache_hits", "Prompt tokens served from cache", stats.hit_tokens)
        yield _counter("prefix_cache_evictions", "KV blocks evicted", stats.num_evictions)
        yield _gauge("prefix_cache_hit_rate", "Hit tokens / queried tokens", stats.hit_rate)
        yield _gauge("kv_cache_bytes_used", "Bytes of cached KV blocks", stats.bytes_used)
        yield _gauge("kv_cache_bytes_total", "KV pool byte budget", stats.bytes_total)
        yield _gauge("kv_cache_blocks_used", "KV blocks holding tokens", stats.num_blocks_used)
        yield _gauge("kv_cache_blocks_total", "KV blocks in the pool", stats.num_blocks_total)
        yield _gauge("kv_cache_blocks_pinned", "KV blocks pinned by running requests",
                     stats.num_blocks_pinned)  # fmt: skip
        usage = stats.bytes_used / stats.bytes_total if stats.bytes_total else 0.0
        yield _gauge("kv_cache_usage_perc", "KV pool fraction in use (0-1)", usage)
        tiers = CounterMetricFamily(
            f"{PREFIX}_prefix_cache_tier_hits", "Prompt tokens served, by tier", labels=["tier"]
        )
        tiers.add_metric(["memory"], stats.memory_hit_tokens)
        tiers.add_metric(["disk"], stats.disk_hit_tokens)
        yield tiers
        if stats.disk is not None:
            yield from _disk_metrics(stats.disk)
            per_token = (
                stats.disk.bytes_written / stats.queried_tokens if stats.queried_tokens else 0.0
            )
            yield _gauge("kv_disk_bytes_written_per_prompt_token", "Disk tier bytes written / "
                         "prompt tokens looked up (write-through cost)", per_token)  # fmt: skip
        if stats.chunk_store is not None:
            yield from _chunk_store_metrics(stats.chunk_store)


def _chunk_store_metrics(store: ChunkStoreStats) -> Iterator[Metric]:
    yield _counter("chunk_store_hits", "Chunk lookups served from the chunk store", store.num_hits)
    yield _counter("chunk_store_misses", "Chunk lookups not in the chunk store (computed alone)",
                   store.num_misses)  # fmt: skip
    yield _counter("chunk_store_evictions", "Chunks evicted from the chunk store",
                   store.num_evictions)  # fmt: skip
    yield _counter("chunk_store_disk_hits", "Chunk lookups served by loading back from the "
                   "disk tier (part of the hits)", store.num_disk_hits)  # fmt: skip
    yield _gauge("chunk_store_entries", "Chunks stored now", store.num_entries)
    yield _gauge("chunk_store_bytes_used", "Bytes of stored chunks' KV blocks", store.bytes_used)
    yield _gauge("chunk_store_bytes_total", "Chunk store byte budget", store.bytes_total)


class _SchedulerCollector(Collector):
    """Reads the engine's queue and its cumulative work counters on every scrape."""

    def __init__(self, read: Callable[[], SchedulerStats]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        yield _gauge("num_requests_running", "Requests admitted", stats.num_running)
        yield _gauge("num_requests_waiting", "Requests queued", stats.num_waiting)
        yield _counter(
            "prefill_tokens_computed",
            "Prompt tokens actually computed by prefill (cached tokens excluded), by every "
            "released request: finished, cancelled or failed",
            stats.prefill_tokens_computed,
        )
        yield _counter(
            "generation_tokens",
            "Generated tokens, cancelled and failed requests' included",
            stats.generation_tokens,
        )


def _disk_metrics(disk: DiskTierStats) -> Iterator[Metric]:
    yield _gauge("kv_disk_bytes_used", "Bytes of KV block files on disk", disk.bytes_used)
    yield _gauge("kv_disk_bytes_total", "Disk tier byte budget", disk.bytes_total)
    yield _gauge("kv_disk_blocks", "KV block files on disk", disk.num_blocks)
    yield _counter("kv_disk_writes", "KV blocks written to disk", disk.num_writes)
    yield _counter("kv_disk_written_bytes", "Bytes of KV block files written", disk.bytes_written)
    yield _counter("kv_disk_dropped_writes", "Block writes dropped (write queue full, or left "
                   "at shutdown)", disk.num_dropped_writes)  # fmt: skip
    yield _counter("kv_disk_loads", "KV blocks loaded back from disk", disk.num_loads)
    yield _counter("kv_disk_load_seconds", "Time spent loading blocks on the request path",
                   disk.load_s)  # fmt: skip
    yield _counter("kv_disk_corrupt_files", "Damaged or foreign block files removed",
                   disk.num_corrupt)  # fmt: skip


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ServerMetrics:
    """All metrics of one app; each instance owns its own registry (never the global one).

    Args:
        read_cache_stats: returns the engine's current ``CacheStats``; called per scrape.
        read_scheduler_stats: returns the engine's current ``SchedulerStats``; called per scrape.
    """

    def __init__(
        self,
        read_cache_stats: Callable[[], CacheStats],
        read_scheduler_stats: Callable[[], SchedulerStats],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens of finished (or prefilled, then cancelled) requests "
            "(cached tokens included)",
            registry=reg,
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_tokens",
            "Prompt tokens of finished (or prefilled, then cancelled) requests served from the "
            "prefix cache (a part of prompt_tokens)",
            registry=reg,
        )
        self.chunk_tokens = Counter(
            f"{PREFIX}_chunk_reuse_tokens",
            "Document-span tokens of requests with chunk_reuse, by mode and by what happened to "
            "their KV: reused from the chunk store, recomputed (blend) or missed (computed alone "
            "and stored); apart from cached_tokens",
            ["mode", "kind"],
            registry=reg,
        )
        # NOTE: outcomes and TTFT count requests, whatever their n or number of prompts: an
        # invalid, refused or rejected request has no choices to count, and the n choices of a
        # prompt share one prefill, hence one first-token time.
        self.outcomes = Counter(
            f"{PREFIX}_request_outcomes",
            "Requests by outcome, one per request whatever its n: tool_calls if any choice "
            "called a tool, else the first choice's finish reason (stop, length); or cancelled, "
            "invalid, unauthorized, rejected, error",
            ["outcome"],
            registry=reg,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "TTFT of finished requests, one per request: its earliest choice's first token",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Decode time per output token after the first (TPOT), one per choice",
            buckets=_TPOT_BUCKETS,
            registry=reg,
        )
        reg.register(_CacheCollector(read_cache_stats))
        reg.register(_SchedulerCollector(read_scheduler_stats))

    def observe_request(self, completions: Sequence[Completion], outcome: Outcome) -> None:
        """Count one finished request: its outcome and TTFT once, each choice's tokens and TPOT.

        Args:
            completions: every choice of the request; the caller zeroes the prompt and cached
                tokens of all but one choice per prompt (choices share their prompt's prefill).
            outcome: the request's one outcome (see the ``outcomes`` help text).
        """
        assert completions, "a finished request has at least one choice"
        for completion in completions:
            usage, timing = completion.usage, completion.metrics
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.cached_tokens.inc(usage.cached_tokens)
            self._observe_chunks(usage)
            if timing.decode_tokens_per_s > 0:
                self.tpot.observe(1.0 / timing.decode_tokens_per_s)
        self.ttft.observe(min(c.metrics.ttft_s for c in completions))
        self.outcomes.labels(outcome=outcome).inc()

    def observe_prompt(self, usage: Usage) -> None:
        """Count the prompt and cached tokens of a request cancelled after its prefill."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self._observe_chunks(usage)

    def _observe_chunks(self, usage: Usage) -> None:
        """Count a chunk-reuse request's span tokens (nothing for other requests)."""
        chunk = usage.chunk_reuse
        if chunk is None:
            return
        kinds = (("reused", chunk.reused_tokens), ("recomputed", chunk.recomputed_tokens),
                 ("missed", chunk.missed_tokens))  # fmt: skip
        for kind, value in kinds:
            self.chunk_tokens.labels(mode=chunk.mode, kind=kind).inc(value)

    def count(self, outcome: Outcome) -> None:
        """Count one request that ended without a completion (cancelled, rejected, invalid)."""
        self.outcomes.labels(outcome=outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry (reads the engine; may block)."""
        return generate_latest(self.registry)
