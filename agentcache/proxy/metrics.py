"""Prometheus metrics of the proxy, in a per-app ``CollectorRegistry``.

Per upstream model: requests, prompt tokens, cached tokens, cache writes, hit rate, estimated
cost and saved cost (USD, from the dated price table in ``agentcache.pricing``); prefix breaks by
reason; response-cache hits. Token totals are read from the ``UsageBook`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentcache.proxy.sessions import SessionLog
from agentcache.proxy.usage_tap import UsageBook

__all__ = ["CONTENT_TYPE", "ProxyMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "agentcache_proxy"


class _BookCollector(Collector):
    def __init__(self, book: UsageBook) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
        rows = self._book.snapshot()
        families = {
            "requests": ("Answered requests (status 200) per upstream model", "requests"),
            "prompt_tokens": ("Prompt tokens reported by the upstream, cached included",
                              "prompt_tokens"),
            "cached_tokens": ("Prompt tokens the upstream served from its prompt cache",
                              "cached_tokens"),
            "cache_write_tokens": ("Prompt tokens written to the upstream's cache (Anthropic)",
                                   "cache_write_tokens"),
            "cost_usd": ("Estimated cost, USD, from the dated price table", "cost_usd"),
            "saved_usd": ("Estimated saving from cached input vs no cache, USD", "saved_usd"),
        }  # fmt: skip
        for name, (doc, attr) in families.items():
            family = CounterMetricFamily(f"{_P}_{name}", doc, labels=["model"])
            for model, totals in rows.items():
                family.add_metric([model], float(getattr(totals, attr)))
            yield family
        hit = GaugeMetricFamily(
            f"{_P}_hit_rate", "Cached prompt tokens / prompt tokens", labels=["model"]
        )
        for model, totals in rows.items():
            hit.add_metric([model], totals.hit_rate)
        yield hit


class ProxyMetrics:
    """The proxy's metrics; ``render()`` is the ``/metrics`` body."""

    def __init__(self, book: UsageBook, sessions: SessionLog) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_BookCollector(book))
        self.prefix_breaks = Counter(
            f"{_P}_prefix_breaks",
            "Requests that broke their session's previous prefix, by reason; fixed=true when the "
            "rewritten body kept it",
            ["reason", "fixed"],
            registry=self.registry,
        )
        self.errors = Counter(
            f"{_P}_errors",
            "Requests the proxy answered itself with an error instead of relaying the upstream's "
            "answer, by HTTP status (413: body over --max-request-bytes; 502: upstream "
            "unreachable or broke off)",
            ["status"],
            registry=self.registry,
        )
        self.response_cache_hits = Counter(
            f"{_P}_response_cache_hits",
            "Answers replayed from the exact response cache (no upstream call)",
            registry=self.registry,
        )

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
