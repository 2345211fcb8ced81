"""Backend for Anthropic's Messages API, with the prompt builder's ``cache_control`` breakpoints.

Streams over SSE (``message_start`` ... ``message_stop``) and maps ``cache_read_input_tokens`` /
``cache_creation_input_tokens`` into ``Usage``. Knows the wire format only; the request body
(including where breakpoints go) comes from the prompt's ``to_anthropic`` renderer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentcache import env
from agentcache.backends._http import RetryPolicy, decode_json_event, iter_sse, open_stream
from agentcache.backends._remote import RemoteBackend, StreamAccumulator
from agentcache.backends._usage import anthropic_usage
from agentcache.backends.base import (
    GenerationOptions,
    ModelResponse,
    PromptInput,
    StreamEvent,
    ToolCall,
    as_prompt,
)
from agentcache.exceptions import BackendError
from agentcache.prompt.render import check_anthropic_markers

__all__ = ["AnthropicBackend"]

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"
"""``anthropic-version`` header value (Anthropic API versioning docs)."""


class AnthropicBackend(RemoteBackend):
    """Messages API over httpx, streaming, with bounded retries on 429/5xx/529."""

    name = "anthropic"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """Create the backend.

        Args:
            model: Model name sent as ``model``.
            base_url: API root without ``/v1`` (default ``https://api.anthropic.com``).
            api_key: Key sent as ``x-api-key``; default ``agentcache.env.api_key("anthropic")``.
            timeout_s: Per-request timeout, seconds.
            retry: Retry policy for 429/5xx/529 and connection errors.
            transport: httpx transport override (tests, proxies).
        """
        super().__init__(
            model,
            base_url=base_url or DEFAULT_BASE_URL,
            api_key=api_key if api_key is not None else env.api_key("anthropic"),
            timeout_s=timeout_s,
            retry=retry,
            transport=transport,
        )

    def request_body(self, prompt: PromptInput, options: GenerationOptions) -> dict[str, Any]:
        """The exact JSON body ``stream`` sends for ``prompt``."""
        params: dict[str, Any] = {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "stream": True,
        }
        if options.stop:
            params["stop_sequences"] = list(options.stop)
        prompt = as_prompt(prompt)
        if options.tool_choice != "auto" and prompt.tool_schemas():
            kind = "any" if options.tool_choice == "required" else "none"
            params["tool_choice"] = {"type": kind}
        return prompt.to_anthropic(model=self._model, **params)

    def stream(
        self, prompt: PromptInput, options: GenerationOptions | None = None
    ) -> Iterator[StreamEvent]:
        """Stream a completion (contract in ``BaseBackend.stream``)."""
        body = self.request_body(prompt, options or GenerationOptions())
        check_anthropic_markers(body)  # NOTE: the provider answers 400 beyond 4; fail here instead.
        headers = {"anthropic-version": API_VERSION}
        if self._api_key:
            headers["x-api-key"] = self._api_key
        url = f"{self.base_url}/v1/messages"
        state = _MessageState(start_s=time.perf_counter())
        with open_stream(self._client, url, body=body, headers=headers, retry=self._retry) as resp:
            for event in iter_sse(resp.iter_lines()):
                delta = state.feed(event.event, decode_json_event(event.data, source="Anthropic"))
                if delta:
                    yield StreamEvent(delta)
                if event.event == "message_stop":
                    break
        yield StreamEvent("", state.response(self._model))


@dataclass(slots=True)
class _MessageState(StreamAccumulator):
    """Accumulates Messages API stream events into one response."""

    blocks: dict[int, dict[str, str]] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None

    def feed(self, kind: str, data: dict[str, Any]) -> str:
        if kind == "error" or data.get("type") == "error":
            raise BackendError(f"Anthropic reported an error mid-stream: {data.get('error')!r}")
        if kind == "message_start":
            message = data.get("message") or {}
            self.model = message.get("model") or ""
            self.usage.update(message.get("usage") or {})
        elif kind == "content_block_start":
            self._start_block(int(data.get("index", 0)), data.get("content_block") or {})
        elif kind == "content_block_delta":
            return self._delta(int(data.get("index", 0)), data.get("delta") or {})
        elif kind == "message_delta":
            self.stop_reason = (data.get("delta") or {}).get("stop_reason") or self.stop_reason
            # NOTE: a null here means "not in this event", not zero: keep message_start's counts.
            late = data.get("usage") or {}
            self.usage.update({k: v for k, v in late.items() if v is not None})
        return ""

    def _start_block(self, index: int, block: dict[str, Any]) -> None:
        if block.get("type") == "tool_use":
            self.mark_first()
            initial = block.get("input") or {}
            self.blocks[index] = {
                "id": str(block.get("id", "")),
                "name": str(block.get("name", "")),
                "args": "",
                "initial": json.dumps(initial) if initial else "",
            }
        text = block.get("text")
        if block.get("type") == "text" and text:
            self.mark_first()
            self.text.append(text)

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        if delta.get("type") == "text_delta":
            self.mark_first()
            text = str(delta.get("text", ""))
            self.text.append(text)
            return text
        if delta.get("type") == "input_json_delta" and index in self.blocks:
            self.blocks[index]["args"] += str(delta.get("partial_json", ""))
        return ""

    def response(self, requested_model: str) -> ModelResponse:
        calls = tuple(
            ToolCall(id=b["id"], name=b["name"], arguments=b["args"] or b["initial"] or "{}")
            for _, b in sorted(self.blocks.items())
        )
        return self.finish(
            requested_model,
            usage=anthropic_usage(self.usage),
            tool_calls=calls,
            finish_reason=self.stop_reason,
        )
