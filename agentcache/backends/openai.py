"""Backend for any OpenAI-compatible Chat Completions endpoint (ours, vLLM, llama.cpp, OpenAI...).

Streams over SSE with ``stream_options.include_usage`` so the final chunk carries usage including
``prompt_tokens_details.cached_tokens``. Knows the wire format only; the request body comes from
the prompt's own ``to_openai`` renderer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentcache import env
from agentcache.backends._http import (
    RetryPolicy,
    decode_json_event,
    error_message,
    iter_sse,
    open_stream,
)
from agentcache.backends._remote import RemoteBackend, StreamAccumulator
from agentcache.backends._usage import openai_usage
from agentcache.backends.base import (
    GenerationOptions,
    ModelResponse,
    PromptInput,
    StreamEvent,
    ToolCall,
    as_prompt,
)
from agentcache.backends.hints import EngineHints
from agentcache.exceptions import BackendError, BackendHTTPError, BackendUnavailableError
from agentcache.prompt.render import order_openai_body
from agentcache.usage import Usage

__all__ = ["OpenAIBackend"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"


class OpenAIBackend(RemoteBackend):
    """Chat Completions over httpx, streaming, with bounded retries on 429/5xx."""

    name = "openai"

    def __init__(
        self,
        model: str | None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        extra_body: dict[str, Any] | None = None,
        engine_hints: EngineHints | None = None,
    ) -> None:
        """Create the backend.

        Args:
            model: Model name sent as ``model``; ``None`` asks the endpoint's ``GET /models``
                once, here, and uses the first model it lists (servers such as ``agentcache
                serve``, vLLM and llama.cpp list the model they serve).
            base_url: Endpoint root ending in ``/v1``; default ``AGENTCACHE_BASE_URL`` or OpenAI.
            api_key: Bearer token; default from ``agentcache.env.api_key("openai")`` (may be none
                for local servers).
            timeout_s: Per-request timeout, seconds.
            retry: Retry policy for 429/5xx and connection errors.
            transport: httpx transport override (tests, proxies).
            extra_body: Extra request fields (e.g. ``prompt_cache_key``), merged last.
            engine_hints: Tenant ``cache_salt`` and session-id header for self-hosted engines
                and routers (``EngineHints``); default none, as hosted providers refuse
                unknown fields.

        Raises:
            BackendUnavailableError: ``model`` is None and the endpoint cannot be reached or
                lists no model.
            BackendHTTPError: ``model`` is None and ``GET /models`` answered an HTTP error.
        """
        super().__init__(
            model or "",
            base_url=base_url or env.base_url() or DEFAULT_BASE_URL,
            api_key=api_key if api_key is not None else env.api_key("openai"),
            timeout_s=timeout_s,
            retry=retry,
            transport=transport,
        )
        self._extra = dict(extra_body or {})
        self.engine_hints = engine_hints or EngineHints()
        if model is None:
            self._model = self.list_models()[0]

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def list_models(self) -> list[str]:
        """Model ids the endpoint lists at ``GET {base_url}/models``, in its order.

        Raises:
            BackendUnavailableError: The endpoint cannot be reached, answers something that is
                not a model list, or lists no model.
            BackendHTTPError: The endpoint answered an HTTP error status.
        """
        url = f"{self.base_url}/models"
        try:
            response = self._client.get(url, headers=self._headers())
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(f"cannot reach {url} to list models: {exc}") from exc
        status = response.status_code
        if status >= 400:
            # NOTE: a refused key is not fixed by naming the model (the chat call would be
            # refused too); only an endpoint without a model list is.
            hint = "" if status in (401, 403) else "; pass a model name instead"
            raise BackendHTTPError(
                f"GET {url} answered HTTP {status}: {error_message(response.text)}{hint}",
                status_code=status,
                body=response.text,
            )
        try:
            data = response.json().get("data")
            ids = [str(item["id"]) for item in data]
        except (ValueError, AttributeError, KeyError, TypeError) as exc:
            raise BackendUnavailableError(f"{url} did not answer an OpenAI model list") from exc
        if not ids:
            raise BackendUnavailableError(f"{url} lists no models; pass a model name")
        return ids

    def request_body(self, prompt: PromptInput, options: GenerationOptions) -> dict[str, Any]:
        """The exact JSON body ``stream`` sends for ``prompt`` in the current ``cache_scope``
        (useful for lint/diff): ``engine_hints`` fields, then ``extra_body``, are merged last."""
        params: dict[str, Any] = {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.stop:
            params["stop"] = list(options.stop)
        prompt = as_prompt(prompt)
        if options.tool_choice != "auto" and prompt.tool_schemas():
            params["tool_choice"] = options.tool_choice
        body = prompt.to_openai(model=self._model, **params)
        body.update(self.engine_hints.body_fields())
        body.update(self._extra)
        return order_openai_body(body)  # NOTE: the merged fields go before tools and messages

    def stream(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> Iterator[StreamEvent]:
        """Stream a completion (contract in ``BaseBackend.stream``)."""
        body = self.request_body(prompt, options or GenerationOptions())
        headers = self._headers() | self.engine_hints.headers()
        url = f"{self.base_url}/chat/completions"
        start = time.perf_counter()
        state = _StreamState(start_s=start)
        with open_stream(self._client, url, body=body, headers=headers, retry=self._retry) as resp:
            for event in iter_sse(resp.iter_lines()):
                if event.data.strip() == "[DONE]":
                    break
                delta = state.feed(_decode(event.data))
                if delta:
                    yield StreamEvent(delta)
        yield StreamEvent("", state.response(self._model))


def _decode(data: str) -> dict[str, Any]:
    value = decode_json_event(data, source="endpoint")
    if "error" in value:
        raise BackendError(f"endpoint reported an error mid-stream: {value['error']!r}")
    return value


@dataclass(slots=True)
class _StreamState(StreamAccumulator):
    """Accumulates Chat Completions chunks into one response."""

    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage_payload: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> str:
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage_payload = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        delta = choice.get("delta") or {}
        for item in delta.get("tool_calls") or []:
            self.mark_first()
            empty = {"id": "", "name": "", "args": ""}
            slot = self.calls.setdefault(int(item.get("index", 0)), empty)
            function = item.get("function") or {}
            slot["id"] = item.get("id") or slot["id"]
            slot["name"] += function.get("name") or ""
            slot["args"] += function.get("arguments") or ""
        content = delta.get("content") or ""
        if content:
            self.mark_first()
            self.text.append(content)
        return content

    def response(self, requested_model: str) -> ModelResponse:
        calls = tuple(
            ToolCall(id=slot["id"] or f"call_{index}", name=slot["name"], arguments=slot["args"])
            for index, slot in sorted(self.calls.items())
        )
        return self.finish(
            requested_model,
            usage=openai_usage(self.usage_payload) if self.usage_payload else Usage(),
            tool_calls=calls,
            finish_reason=self.finish_reason,
        )
