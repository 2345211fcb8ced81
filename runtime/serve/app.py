"""OpenAI-compatible HTTP front-end over an Engine (FastAPI): chat, completions, models, metrics,
vLLM's tokenize/detokenize and prefix-cache reset, the OpenAPI schema, opt-in CORS.

Thin by design: it validates bodies, maps the API key and ``cache_salt`` to a private prefix
cache namespace, runs every blocking engine call in worker threads and turns deltas into JSON or
SSE. Admission, scheduling, batching and caching live in the engine: its scheduler queue is the
one place that admits or refuses a request (``EngineBusyError``), which the app maps to 429.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import anyio
from anyio.to_thread import run_sync
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from runtime.exceptions import (
    ChunkReuseError,
    EngineBusyError,
    InvalidRequestError,
    PromptTooLongError,
    SamplingError,
    TooManyChoicesError,
)
from runtime.outputs import Completion, StreamDelta
from runtime.serve.api_error import ApiError, error_body
from runtime.serve.auth import KeyRing, tenant_salt
from runtime.serve.body_checks import (
    MAX_JSON_DEPTH,
    SURROGATE_ESCAPE,
    json_depth,
    refuse_lone_surrogates,
    too_deep,
)
from runtime.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyTooLargeError, read_body
from runtime.serve.engine_call import EngineCall
from runtime.serve.engine_protocol import ServingEngine
from runtime.serve.failsafe import ErrorShield
from runtime.serve.metrics import CONTENT_TYPE, Outcome, ServerMetrics
from runtime.serve.openapi import body_schema, openapi_schema
from runtime.serve.protocol import (
    CacheResetRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)
from runtime.serve.request_plan import RequestPlan, chat_plan, completion_plan
from runtime.serve.streams import ChoiceStream, final_json
from runtime.serve.tokenize import detokenize_body, tokenize_body, tokenizer_info_body

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "WEIGHTS_HEADER",
    "create_app",
    "tenant_salt",
]

WEIGHTS_HEADER = "X-Agentcache-Weights"
"""Response header of completions: the engine's ``weights`` (``"float32"``, ``"q4_1"``, ...)."""
RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 (engine queue full), in whole seconds (RFC 9110 delay-seconds).

NOTE: a hint, not a promise: the queue gains room each time the scheduler admits a waiting
request (a running one finished), and when that is depends on output lengths the server cannot
know; 1 is the smallest whole second. The ``openai`` client waits what it says before it
retries (it honours up to two minutes), instead of its own backoff (0.5 s doubling to 8 s)."""


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its engine call, even if never iterated, then
    hands the stream's outcome to ``on_done``."""

    def __init__(
        self,
        stream: ChoiceStream,
        call: EngineCall,
        on_done: Callable[[Outcome | None], None],
        headers: dict[str, str],
    ) -> None:
        super().__init__(stream.events(), media_type="text/event-stream", headers=headers)
        self._stream = stream
        self._call = call
        self._on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._call.aclose()
            self._on_done(self._stream.outcome)


class _Server:
    """State and handlers of one app."""

    def __init__(
        self,
        engine: ServingEngine,
        *,
        api_keys: Sequence[str],
        admin_keys: Sequence[str],
        max_request_bytes: int,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes!r}")
        self.engine = engine
        self.max_request_bytes = max_request_bytes
        self.metrics = ServerMetrics(engine.cache_stats, engine.scheduler_stats)
        self.keys = KeyRing(
            api_keys, admin_keys=admin_keys, on_refused=lambda: self.metrics.count("unauthorized")
        )

    def queue_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)`` requests in the engine now (blocking: worker thread)."""
        stats = self.engine.scheduler_stats()
        return stats.num_running, stats.num_waiting

    async def read_body(self, request: Request) -> bytes:
        """The body, refused before it is read in full when it exceeds ``max_request_bytes``.

        NOTE: the size cap is the only pre-tokenization length check. No character bound on the
        prompt is safe: one unknown-word token (WordLevel/WordPiece ``[UNK]``) or a normalizer
        that drops characters lets any number of characters fit in a few tokens.

        Raises:
            ApiError: 413 when ``Content-Length`` or the bytes received exceed the limit.
        """
        try:
            return await read_body(request, self.max_request_bytes)
        except BodyTooLargeError as exc:
            raise ApiError(413, str(exc), code="request_too_large") from exc

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        """Read and validate a JSON body.

        Raises:
            ApiError: 413 on a body over the size limit, 400 on malformed JSON or invalid
                fields, 404 on an unknown model.
        """
        return self.validate(await self.read_body(request), model)

    def validate(self, raw: bytes, model: type[BaseModel]) -> Any:
        """``parse`` of a body already read (same errors but the 413)."""
        try:
            body = json.loads(raw)
        except RecursionError as exc:
            raise too_deep() from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
        if json_depth(body) > MAX_JSON_DEPTH:
            raise too_deep()
        if SURROGATE_ESCAPE.search(raw):
            refuse_lone_surrogates(body)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        name = getattr(parsed, "model", None)
        if name is not None and name != self.engine.model_id:
            raise _unknown_model(name, self.engine.model_id)
        return parsed

    @property
    def _headers(self) -> dict[str, str]:
        """Headers of every completion: ``X-Agentcache-Weights`` names how the model holds its
        weights (``float32``, ``q4_1``, ...: a quantized model answers as another model)."""
        return {WEIGHTS_HEADER: str(getattr(self.engine, "weights", "float32"))}

    async def serve(self, request: Request, plan: RequestPlan) -> Response:
        """Admit, run and answer one planned request (JSON or SSE)."""
        call = EngineCall(lambda: self._open_streams(plan))
        is_handed_off = False
        try:
            first = await _unless_disconnected(request, call.start)
            if plan.stream:
                stream = ChoiceStream(plan, call, first)
                is_handed_off = True
                return _SSEResponse(stream, call, lambda out: self._record(call, out, plan.n),
                                    self._headers)  # fmt: skip
            completions = await _unless_disconnected(request, lambda: call.drain(first))
            body, finish = final_json(plan, completions)
            self._record(call, finish, plan.n)
            return JSONResponse(body, headers=self._headers)
        except _Disconnected:
            await call.aclose()
            self._record(call, None, plan.n)
            return Response(status_code=499)
        except EngineBusyError as exc:
            self.metrics.count("rejected")
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise ApiError(
                429, str(exc), type="server_error", code="server_busy", headers=retry
            ) from exc
        except PromptTooLongError as exc:
            raise ApiError(
                400, str(exc), param=plan.prompt_param, code="context_length_exceeded"
            ) from exc
        except TooManyChoicesError as exc:  # NOTE: more than the batch's rows or KV budget
            raise ApiError(400, str(exc), param="n", code="invalid_value") from exc
        except ChunkReuseError as exc:  # NOTE: a model that cannot move stored keys
            raise ApiError(400, str(exc), param="chunk_reuse", code="invalid_value") from exc
        except InvalidRequestError as exc:  # NOTE: the prompt is all the engine checks here
            raise ApiError(400, str(exc), param=plan.prompt_param, code="invalid_value") from exc
        except SamplingError as exc:
            self.metrics.count("error")
            raise ApiError(
                500, f"generation failed: {exc}", type="server_error", code="sampling_failed"
            ) from exc
        finally:
            if not is_handed_off:
                await call.aclose()

    def _open_streams(self, plan: RequestPlan) -> list[Iterator[StreamDelta]]:
        """One engine stream per choice, prompt-major (worker thread; blocking).

        Each prompt is one engine request whose ``n`` choices share its prefill. If opening a
        later prompt fails, the streams already open are closed before the error propagates.
        """
        streams: list[Iterator[StreamDelta]] = []
        try:
            for spec in plan.engine_requests():
                streams.extend(self.engine.submit(spec))
        except BaseException:
            for stream in streams:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            raise
        return streams

    def _record(self, call: EngineCall, outcome: Outcome | None, n: int) -> None:
        """Count one answered request: its outcome (once, whatever ``n``) as returned by whoever
        answered it.

        The ``n`` choices of a prompt share its prefill: its prompt tokens are counted once. A
        cancelled request's prompt tokens count once its prefill ran (``call`` closed), as the
        engine's prefix-cache queries/hits do, so the two stay comparable.
        """
        completions = call.completions
        if outcome is None:
            self.metrics.count("cancelled")
            for index, usage in enumerate(call.prefilled_usages):
                if usage is not None and index % n == 0:
                    self.metrics.observe_prompt(usage)
            return
        if not completions or any(c is None for c in completions) or outcome == "error":
            self.metrics.count("error")
            return
        choices: list[Completion] = []
        for index, completion in enumerate(completions):
            assert completion is not None
            if index % n:
                usage = dataclasses.replace(
                    completion.usage, prompt_tokens=0, cached_tokens=0, chunk_reuse=None
                )
                completion = dataclasses.replace(completion, usage=usage)
            choices.append(completion)
        self.metrics.observe_request(choices, outcome)


class _Disconnected(Exception):
    """The client went away before the response started."""


async def _unless_disconnected(request: Request, work: Callable[[], Any]) -> Any:
    """Run ``work()``; cancel it (after the current engine step) if the client disconnects."""
    result: list[Any] = []
    errors: list[BaseException] = []

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:  # re-raised below, outside the task group
            errors.append(exc)
        group.cancel_scope.cancel()
    if errors:
        raise errors[0]
    if not result:
        raise _Disconnected()
    return result[0]


def create_app(
    engine: ServingEngine,
    *,
    api_key: str | Sequence[str] | None = None,
    admin_key: str | None = None,
    metrics_key: str | None = None,
    cors_origins: Sequence[str] = (),
    default_max_tokens: int = 256,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """Build the FastAPI app serving ``engine``.

    Args:
        engine: the loaded engine (``runtime.Engine`` or anything with its serving methods).
        api_key: one key or several; when set, every ``/v1`` call, ``/tokenize``,
            ``/detokenize``, ``/tokenizer_info`` and ``/openapi.json`` need ``Bearer <key>``
            (else 401). Each key is its own prefix-cache tenant and may reset its own
            namespace; ``/metrics`` and the global cache reset then need ``admin_key`` (403
            naming ``--admin-key`` without one; see ``KeyRing``).
        admin_key: the key that alone opens ``/metrics`` and the global cache reset (every
            tenant's prefixes, in memory and on the disk tier).
        metrics_key: the older name of ``admin_key`` (same rights; both may be given).
        cors_origins: origins allowed by CORS (``"*"`` for any); empty: no CORS headers.
        default_max_tokens: ``max_tokens`` when a request gives none (capped by the context).
        max_request_bytes: largest body read; larger ones get 413 before any parsing or
            tokenizing (checked on ``Content-Length`` first, then on the bytes received).

    Returns:
        The app; ``app.state.server`` holds the metrics. How many requests run and wait is the
        engine's to decide (``SchedulerConfig.max_batch_size`` / ``max_waiting``); a full queue
        is answered with 429.

    Raises:
        ValueError: an empty key or one with whitespace; ``max_request_bytes`` < 1.
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    server = _Server(
        engine,
        api_keys=keys,
        admin_keys=[k for k in (admin_key, metrics_key) if k is not None],
        max_request_bytes=max_request_bytes,
    )
    # NOTE: FastAPI's own /openapi.json would be open to anyone; ours checks the key.
    app = FastAPI(
        title="agentcache runtime", version="1", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.openapi = partial(openapi_schema, app)  # type: ignore[method-assign]
    app.state.server = server
    _add_error_handlers(app, server)
    _add_generation_routes(app, server, default_max_tokens=default_max_tokens)
    _add_utility_routes(app, server)
    app.add_middleware(ErrorShield, on_error=lambda exc: server.metrics.count("error"))
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    return app


def _add_error_handlers(app: FastAPI, server: _Server) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError), f"unexpected {type(exc).__name__}"
        if exc.status_code in (400, 413):
            server.metrics.count("invalid")
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        status = int(getattr(exc, "status_code", 500))
        detail = str(getattr(exc, "detail", "error"))
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        # NOTE: Starlette's 405 carries the route's methods as ``Allow`` (RFC 9110 15.5.6: a
        # 405 must send it); keep the headers the exception brings.
        headers = getattr(exc, "headers", None)
        return JSONResponse(error_body(detail, type=kind), status_code=status, headers=headers)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(404, on_http_error)
    app.add_exception_handler(405, on_http_error)


def _add_generation_routes(app: FastAPI, server: _Server, *, default_max_tokens: int) -> None:
    engine = server.engine

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        key = server.keys.check_api(request)
        req = await server.parse(request, ChatCompletionRequest)
        salt = tenant_salt(key, req.cache_salt)
        plan = await chat_plan(engine, req, salt, default_max_tokens=default_max_tokens)
        return await server.serve(request, plan)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        key = server.keys.check_api(request)
        req = await server.parse(request, CompletionRequest)
        salt = tenant_salt(key, req.cache_salt)
        plan = await completion_plan(engine, req, salt, default_max_tokens=default_max_tokens)
        return await server.serve(request, plan)


def _add_utility_routes(app: FastAPI, server: _Server) -> None:
    engine = server.engine

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.keys.check_api(request)
        return JSONResponse({"object": "list", "data": [_model_card(engine)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        server.keys.check_api(request)
        if model_id != engine.model_id:
            raise _unknown_model(model_id, engine.model_id)
        return JSONResponse(_model_card(engine))

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        server.keys.check_api(request)
        req = await server.parse(request, TokenizeRequest)
        return JSONResponse(await run_sync(tokenize_body, engine, req))

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        server.keys.check_api(request)
        req = await server.parse(request, DetokenizeRequest)
        return JSONResponse(await run_sync(detokenize_body, engine, req))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        server.keys.check_api(request)
        return JSONResponse(tokenizer_info_body(engine))

    async def reset_cache(request: Request) -> Response:
        scope, key = server.keys.check_reset(request)
        salt, raw = None, await server.read_body(request)
        if raw.strip():  # NOTE: vLLM's clients send no body; ours may name a cache_salt
            body = server.validate(raw, CacheResetRequest)
            if body.cache_salt is not None and scope == "all":
                raise ApiError(400, "cache_salt names a tenant's namespace; the admin reset "
                               "drops every namespace (send it with an API key)",
                               param="cache_salt", code="invalid_value")  # fmt: skip
            salt = body.cache_salt
        if scope == "all":
            freed = await run_sync(partial(engine.flush_cache, include_disk=True))
        else:
            freed = await run_sync(engine.flush_namespace, tenant_salt(key, salt))
        return JSONResponse({"status": "ok", "scope": scope, "num_blocks_freed": freed})

    # NOTE: vLLM's path for the same action, so its clients and scripts work unchanged.
    app.post("/v1/admin/cache/reset")(reset_cache)
    app.post("/reset_prefix_cache")(reset_cache)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        server.keys.check_api(request)
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health() -> Response:
        running, waiting = await run_sync(server.queue_counts)
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        server.keys.check_metrics(request)
        return Response(await run_sync(server.metrics.render), media_type=CONTENT_TYPE)


def _model_card(engine: ServingEngine) -> dict[str, Any]:
    return {
        "id": engine.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "agentcache",
        "max_model_len": engine.max_context_len,
        # NOTE: our extension: a quantized model is another model than its fp32 original
        "weights": getattr(engine, "weights", "float32"),
        # NOTE: an fp16 KV cache rounds what attention reads: answers differ in the last bits
        "kv_cache_dtype": getattr(engine, "kv_dtype", None),
    }


def _unknown_model(name: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"model {name!r} does not exist; this server serves {served!r}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )
