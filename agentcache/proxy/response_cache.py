"""Optional exact response cache of the proxy (off by default).

Only deterministic requests are cached: temperature 0, or a fixed ``seed`` (OpenAI). The key is
the canonical forwarded body, the route and a hash of the caller's API key, so tenants never
share an answer. Only complete 200 answers are stored; a streamed answer is stored whole and
replayed as the same SSE bytes. Values live in any ``CacheStore`` (memory, disk, Redis) with a TTL.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response, StreamingResponse

from agentcache.cache.base import CacheStore
from agentcache.canonical import stable_hash

__all__ = ["ResponseCache"]

_VERSION = "agentcache-proxy-response-v1"
HIT_HEADER = "x-agentcache-response-cache"


class ResponseCache:
    """Exact answers for deterministic requests.

    Args:
        store: Where entries live.
        ttl_s: Seconds an entry lives (must be > 0).

    Raises:
        ValueError: ``ttl_s`` is not positive.
    """

    def __init__(self, store: CacheStore, *, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        self.store = store
        self.ttl_s = ttl_s

    @staticmethod
    def is_deterministic(body: dict[str, Any]) -> bool:
        """True for temperature 0 or a fixed seed (the same request then gets the same answer)."""
        return body.get("temperature") == 0 or body.get("seed") is not None

    @staticmethod
    def key(provider: str, path: str, body: dict[str, Any], api_key_hash: str) -> str:
        """Cache key: hash of version, route, caller's key hash and the canonical body."""
        canonical = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return stable_hash(_VERSION, provider, path, api_key_hash, canonical)

    def get(self, key: str) -> Response | None:
        """The stored answer as a response (SSE replayed as a stream), or None."""
        raw = self.store.get(key)
        if raw is None:
            return None
        head, _, data = raw.partition(b"\n")
        content_type = json.loads(head)["content_type"]
        headers = {HIT_HEADER: "hit"}
        if content_type.startswith("text/event-stream"):

            async def replay() -> Any:
                for event in data.split(b"\n\n"):
                    if event:
                        yield event + b"\n\n"

            return StreamingResponse(replay(), 200, headers, media_type=content_type)
        return Response(data, 200, headers, media_type=content_type)

    def put(self, key: str, data: bytes, content_type: str) -> None:
        """Store a complete 200 answer."""
        head = json.dumps({"content_type": content_type}).encode()
        self.store.set(key, head + b"\n" + data, ttl_s=self.ttl_s)
