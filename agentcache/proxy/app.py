"""``agentcache proxy``: an HTTP proxy that makes unmodified apps' requests cache-friendly.

OpenAI Chat Completions (``POST /v1/chat/completions``) and Anthropic Messages
(``POST /v1/messages``) bodies are rewritten by ``rewrite.rewrite`` and forwarded with httpx;
answers (JSON or SSE, streamed as they arrive) come back byte for byte with the upstream's
status. Every other path is forwarded untouched. A body that is not JSON is forwarded untouched
with a warning, never refused; a body over ``max_request_bytes`` is refused with 413 before it is
read in full (the limit ``agentcache serve`` applies, ``runtime.serve.body_limit``). Prefix breaks
are recorded per session (``sessions.SessionLog``) and usage is accounted per model
(``usage_tap.UsageBook``) for ``/metrics``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentcache.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from agentcache.proxy.response_cache import ResponseCache
from agentcache.proxy.rewrite import Provider, RewriteOptions, rewrite
from agentcache.proxy.sessions import SessionLog, derive_session_id
from agentcache.proxy.usage_tap import SSEUsageTap, UsageBook, usage_of_body
from runtime.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyTooLargeError, read_body

__all__ = ["SESSION_HEADER", "create_proxy_app"]

logger = logging.getLogger("agentcache.proxy")

SESSION_HEADER = "x-agentcache-session"
"""Request header naming the caller's session (else one is derived; see ``derive_session_id``)."""

# NOTE: hop-by-hop headers (RFC 9110 section 7.6.1) and those httpx/uvicorn set themselves.
_DROP_REQUEST = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te",
     "proxy-connection", "accept-encoding", SESSION_HEADER}
)  # fmt: skip
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "content-encoding"}
)
_ROUTES: dict[str, Provider] = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}


def _upstream_url(upstream: str, path: str, query: str) -> str:
    """``upstream`` + ``path``; a ``/v1`` both end and start with is written once."""
    base = upstream.rstrip("/")
    if urlsplit(base).path.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return f"{base}{path}" + (f"?{query}" if query else "")


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth.removeprefix("Bearer ").strip() or request.headers.get("x-api-key")


class _Proxy:
    def __init__(
        self,
        upstream: str,
        client: httpx.AsyncClient,
        options: RewriteOptions,
        response_cache: ResponseCache | None,
        routes: dict[str, Provider],
        max_request_bytes: int,
    ) -> None:
        self.routes = routes
        self.max_request_bytes = max_request_bytes
        self.upstream = upstream
        self.client = client
        self.options = options
        self.response_cache = response_cache
        self.sessions = SessionLog()
        self.book = UsageBook()
        self.metrics = ProxyMetrics(self.book, self.sessions)

    def _bad_gateway(self, exc: Exception) -> Response:
        """The proxy's own 502 (counted in ``agentcache_proxy_errors_total``)."""
        self.metrics.errors.labels(status="502").inc()
        message = f"agentcache proxy: upstream unreachable or broke off: {type(exc).__name__}"
        return _error(502, message, type="upstream_error", code="bad_gateway")

    async def handle(self, request: Request, path: str) -> Response:
        try:
            raw = await read_body(request, self.max_request_bytes)
        except BodyTooLargeError as exc:
            message = f"agentcache proxy: {exc}"
            self.metrics.errors.labels(status="413").inc()
            return _error(413, message, type="invalid_request_error", code="request_too_large")
        provider = self.routes.get(path) if request.method == "POST" else None
        body = _json_object(raw) if provider else None
        if provider and body is None:
            logger.warning("%s: body is not a JSON object of text; forwarded untouched", path)
        if provider is None or body is None:
            return await self.forward(request, path, raw, provider=None, model="")
        try:
            sent = self._rewrite(request, provider, body)
        except RecursionError:
            # NOTE: a tool schema hundreds of levels deep parses but overflows the recursive
            # rewrite (was a 500): the upstream answers for such a body, as for non-JSON.
            logger.warning("%s: body nested too deeply to rewrite; forwarded untouched", path)
            return await self.forward(request, path, raw, provider=None, model="")
        content = json.dumps(sent, ensure_ascii=False, separators=(",", ":")).encode()
        model = str(sent.get("model") or "")
        cache_key = self._cache_key(request, provider, path, sent)
        if cache_key is not None and self.response_cache is not None:
            hit = self.response_cache.get(cache_key)
            if hit is not None:
                self.metrics.response_cache_hits.inc()
                return hit
        return await self.forward(
            request, path, content, provider=provider, model=model, cache_key=cache_key
        )

    def _rewrite(
        self, request: Request, provider: Provider, body: dict[str, Any]
    ) -> dict[str, Any]:
        """The body to send, with the session's prefix break (if any) counted."""
        session = request.headers.get(SESSION_HEADER) or derive_session_id(body, _api_key(request))
        sent = rewrite(body, provider, session_id=session, options=self.options).body
        brk = self.sessions.observe(session, body, sent)
        if brk is not None:
            self.metrics.prefix_breaks.labels(brk.reason, str(brk.fixed).lower()).inc()
        return sent

    def _cache_key(
        self, request: Request, provider: Provider, path: str, sent: dict[str, Any]
    ) -> str | None:
        if self.response_cache is None or not self.response_cache.is_deterministic(sent):
            return None
        key_hash = hashlib.sha256((_api_key(request) or "").encode()).hexdigest()
        return self.response_cache.key(provider, path, sent, key_hash)

    async def forward(
        self,
        request: Request,
        path: str,
        content: bytes,
        *,
        provider: Provider | None,
        model: str,
        cache_key: str | None = None,
    ) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        url = _upstream_url(self.upstream, path, request.url.query)
        upstream_request = self.client.build_request(
            request.method, url, headers=headers, content=content
        )
        try:
            answer = await self.client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return self._bad_gateway(exc)
        out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _DROP_RESPONSE}
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            stream = self._relay(answer, provider, model, cache_key)
            return StreamingResponse(
                stream, answer.status_code, out_headers, background=BackgroundTask(answer.aclose)
            )
        try:
            data = await answer.aread()
        except httpx.HTTPError as exc:
            return self._bad_gateway(exc)
        finally:
            await answer.aclose()
        if provider is not None and answer.status_code == 200:
            self.book.record(model, usage_of_body(provider, data))
            if cache_key is not None and self.response_cache is not None:
                self.response_cache.put(cache_key, data, out_headers.get("content-type", ""))
        return Response(data, answer.status_code, out_headers)

    async def _relay(
        self, answer: httpx.Response, provider: Provider | None, model: str, cache_key: str | None
    ) -> AsyncIterator[bytes]:
        tap = SSEUsageTap(provider or "openai")
        kept: list[bytes] = []
        counts = provider is not None and answer.status_code == 200
        recorded = False
        async for chunk in answer.aiter_bytes():
            tap.feed(chunk)
            if cache_key is not None:
                kept.append(chunk)
            if counts and tap.done and not recorded:
                # NOTE: before the end marker reaches the client: an OpenAI client stops reading
                # at [DONE] and may ask for the report while the upstream has not closed yet.
                self.book.record(model, tap.usage)
                recorded = True
            yield chunk
        if counts:
            if not recorded:
                self.book.record(model, tap.usage)
            if cache_key is not None and self.response_cache is not None:
                self.response_cache.put(cache_key, b"".join(kept), "text/event-stream")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """The body to rewrite, or None to forward it untouched: not JSON, not an object, or
    not Unicode text (an unpaired ``\\ud800`` escape parses to a lone surrogate, which the
    rewritten body could not be encoded with; the upstream then answers for it)."""
    try:
        value = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):  # NOTE: the only way in; skips the check otherwise
            json.dumps(value, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # NOTE: UnicodeEncodeError is a ValueError
        return None
    return value if isinstance(value, dict) else None


def _error(status: int, message: str, *, type: str, code: str | None) -> JSONResponse:
    """An error the proxy itself answers, in OpenAI's four-key shape (``param`` null)."""
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (e.g. 405 for a method no route takes) in the same shape."""
    assert isinstance(exc, StarletteHTTPException), "registered for HTTPException only"
    headers = getattr(exc, "headers", None)
    message = f"agentcache proxy: {exc.detail}"
    answer = _error(exc.status_code, message, type="invalid_request_error", code=None)
    if headers:
        answer.headers.update(headers)
    return answer


def create_proxy_app(
    upstream: str,
    *,
    options: RewriteOptions | None = None,
    response_cache: ResponseCache | None = None,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
    providers: Provider | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The proxy as an ASGI app.

    Args:
        upstream: Base URL of the provider or server, e.g. ``https://api.openai.com/v1``,
            ``https://api.anthropic.com`` or ``http://127.0.0.1:8000/v1``.
        options: What the rewrite may change (default: everything).
        response_cache: Exact response cache for deterministic requests; None (default) = off.
        timeout_s: Upstream read timeout, seconds.
        transport: httpx transport (tests); default: a pooled network transport.
        providers: Rewrite only this API's route (the other is forwarded untouched); default both.
        max_request_bytes: Largest body read, on every route; a larger one gets 413 (code
            ``request_too_large``) before it is read in full or sent upstream, as ``serve``
            does (``runtime.serve.body_limit``).

    Routes: ``POST /v1/chat/completions`` and ``POST /v1/messages`` (rewritten),
    ``GET /agentcache/metrics`` (Prometheus), ``GET /agentcache/report`` (breaks and totals, no
    content), everything else forwarded untouched.

    Raises:
        ValueError: ``max_request_bytes`` < 1.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes!r}")
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport, follow_redirects=False
    )
    routes = {p: v for p, v in _ROUTES.items() if providers in (None, v)}
    proxy = _Proxy(
        upstream, client, options or RewriteOptions(), response_cache, routes, max_request_bytes
    )
    app = FastAPI(title="agentcache proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.router.on_shutdown.append(client.aclose)

    @app.get("/agentcache/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/agentcache/report")
    async def report() -> Response:
        totals: dict[str, dict[str, float]] = {}
        for model, t in proxy.book.snapshot().items():
            totals[model] = {
                "requests": t.requests, "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens, "hit_rate": t.hit_rate,
                "cost_usd": t.cost_usd, "saved_usd": t.saved_usd,
            }  # fmt: skip
        return JSONResponse({"sessions": proxy.sessions.report(), "models": totals})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def everything(request: Request, path: str) -> Response:
        return await proxy.handle(request, "/" + path)

    return app
