"""OpenAI-compatible and Anthropic backends against respx-recorded wire shapes (no network)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from agentcache.backends import GenerationOptions, create_backend
from agentcache.backends._http import RetryPolicy, iter_sse
from agentcache.backends.anthropic import AnthropicBackend
from agentcache.backends.openai import OpenAIBackend
from agentcache.exceptions import (
    BackendError,
    BackendHTTPError,
    BackendUnavailableError,
    ConfigError,
)
from agentcache.prompt import Document, Prompt, PromptBuilder

BASE = "http://llm.test/v1"


def make_prompt() -> Prompt:
    def lookup(name: str) -> str:
        """Look a name up.

        Args:
            name: What to look up.
        """
        return name

    return (
        PromptBuilder(namespace="t")
        .system("You answer questions about Python.")
        .tools([lookup])
        .documents([Document("d1", "json.loads parses JSON text.", source="json")])
        .history([{"role": "user", "content": "How do I parse JSON?"}])
        .build()
    )


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def anthropic_sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events).encode()


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def openai_backend(sleeps: Sleeps | None = None, **kw: Any) -> OpenAIBackend:
    retry = RetryPolicy(
        max_attempts=3, base_delay_s=0.25, sleep=sleeps if sleeps is not None else Sleeps()
    )
    return OpenAIBackend("m1", base_url=BASE, api_key="sk-test", retry=retry, **kw)


OPENAI_TEXT_STREAM = sse(
    {"model": "m1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    {"model": "m1", "choices": [{"index": 0, "delta": {"content": "Use "}}]},
    {"model": "m1", "choices": [{"index": 0, "delta": {"content": "json.loads"}}]},
    {"model": "m1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {
        "model": "m1",
        "choices": [],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    },
)


@respx.mock
def test_openai_streams_text_and_usage() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=OPENAI_TEXT_STREAM)
    )
    with openai_backend() as backend:
        events = list(backend.stream(make_prompt(), GenerationOptions(max_tokens=7)))
    deltas = [e.text for e in events if e.text]
    final = events[-1].response
    assert deltas == ["Use ", "json.loads"]
    assert final is not None and final.text == "Use json.loads"
    assert final.usage.prompt_tokens == 120 and final.usage.cached_tokens == 64
    assert final.usage.ttft_s is not None and final.finish_reason == "stop"
    request = route.calls.last.request
    body = json.loads(request.content)
    assert request.headers["authorization"] == "Bearer sk-test"
    assert body["model"] == "m1" and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (
        body["messages"][0]["role"] == "system" and "json.loads" in body["messages"][0]["content"]
    )
    assert body["tools"][0]["function"]["name"] == "lookup"


@respx.mock
def test_openai_assembles_streamed_tool_calls() -> None:
    stream = sse(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "function": {"name": "lookup", "arguments": ""},
                            }
                        ]
                    }
                }
            ]
        },  # noqa: E501
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"name": '}}]}}
            ]
        },  # noqa: E501
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"json"}'}}]}}
            ]
        },  # noqa: E501
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
    )
    respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, content=stream))
    response = openai_backend().complete(make_prompt())
    assert [(c.id, c.name, c.parsed_arguments()) for c in response.tool_calls] == [
        ("c1", "lookup", {"name": "json"})
    ]
    # NOTE: no usage chunk was sent, so every count stays unknown, never a guessed 0.
    assert response.usage.cached_tokens is None and response.usage.prompt_tokens is None


@respx.mock
def test_openai_retries_429_honouring_retry_after_then_succeeds() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        side_effect=[
            httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "slow"}}),
            httpx.Response(503, text="overloaded"),
            httpx.Response(200, content=OPENAI_TEXT_STREAM),
        ]
    )
    sleeps = Sleeps()
    response = openai_backend(sleeps).complete(make_prompt())
    assert response.text == "Use json.loads"
    assert route.call_count == 3
    assert sleeps == [2.0, 0.5]  # Retry-After, then base 0.25 * 2**1


@respx.mock
def test_openai_gives_up_after_bounded_retries() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(500))
    sleeps = Sleeps()
    with pytest.raises(BackendHTTPError) as info:
        openai_backend(sleeps).complete(make_prompt())
    assert info.value.status_code == 500 and route.call_count == 3 and len(sleeps) == 2


@respx.mock
def test_openai_4xx_raises_at_once_with_the_server_message() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(400, json={"error": {"message": "max_tokens too large"}})
    )
    with pytest.raises(BackendHTTPError, match="HTTP 400: max_tokens too large") as info:
        openai_backend().complete(make_prompt())
    assert info.value.status_code == 400 and route.call_count == 1


@respx.mock
def test_openai_connection_errors_become_unavailable() -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    sleeps = Sleeps()
    with pytest.raises(BackendUnavailableError, match="cannot reach"):
        openai_backend(sleeps).complete(make_prompt())
    assert len(sleeps) == 2


def test_api_key_and_base_url_come_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTCACHE_BASE_URL", "http://from-env:9/v1/")
    monkeypatch.delenv("AGENTCACHE_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    backend = OpenAIBackend("m")
    assert backend.base_url == "http://from-env:9/v1" and backend._api_key == "sk-env"


def test_create_backend_by_url_and_unknown_name() -> None:
    backend = create_backend("http://127.0.0.1:1/v1", model="x")
    assert isinstance(backend, OpenAIBackend) and backend.base_url == "http://127.0.0.1:1/v1"
    with pytest.raises(ConfigError, match="valid names: anthropic, fake, local, openai"):
        create_backend("vllm-please")


def test_sse_parser_joins_multiline_data_and_skips_comments() -> None:
    lines = [": keep-alive", "event: x", "data: a", "data: b", "", "data: c"]
    assert [tuple(e) for e in iter_sse(iter(lines))] == [("x", "a\nb"), ("message", "c")]


ANTHROPIC_STREAM = anthropic_sse(
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "model": "claude-x",
                "usage": {
                    "input_tokens": 10,
                    "cache_read_input_tokens": 2000,
                    "cache_creation_input_tokens": 50,
                    "output_tokens": 1,
                },
            },
        },
    ),
    ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    ("ping", {"type": "ping"}),
    ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Let me look."}}),
    ("content_block_stop", {"index": 0}),
    (
        "content_block_start",
        {
            "index": 1,
            "content_block": {"type": "tool_use", "id": "tu1", "name": "lookup", "input": {}},
        },  # noqa: E501
    ),
    (
        "content_block_delta",
        {"index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"name":'}},
    ),  # noqa: E501
    (
        "content_block_delta",
        {"index": 1, "delta": {"type": "input_json_delta", "partial_json": '"json"}'}},
    ),  # noqa: E501
    ("content_block_stop", {"index": 1}),
    ("message_delta", {"delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 12}}),
    ("message_stop", {"type": "message_stop"}),
)


@respx.mock
def test_anthropic_request_shape_and_streamed_response() -> None:
    route = respx.post("https://api.anthropic.test/v1/messages").mock(
        return_value=httpx.Response(200, content=ANTHROPIC_STREAM)
    )
    backend = AnthropicBackend("claude-x", base_url="https://api.anthropic.test", api_key="ak")
    response = backend.complete(make_prompt(), GenerationOptions(max_tokens=5))
    request = route.calls.last.request
    body = json.loads(request.content)
    assert request.headers["x-api-key"] == "ak"
    assert request.headers["anthropic-version"] == "2023-06-01"
    assert body["model"] == "claude-x" and body["max_tokens"] == 5 and body["stream"] is True
    assert body["tools"][0]["name"] == "lookup" and "input_schema" in body["tools"][0]
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert "json.loads parses JSON text." in json.dumps(body["system"])
    assert response.text == "Let me look." and response.finish_reason == "tool_use"
    assert [(c.id, c.name, c.parsed_arguments()) for c in response.tool_calls] == [
        ("tu1", "lookup", {"name": "json"})
    ]
    usage = response.usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (2060, 2000, 50)
    assert usage.completion_tokens == 12
    assert response.cost_usd is None  # "claude-x" is not in the price table


@respx.mock
def test_priced_models_get_a_cost_estimate() -> None:
    respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=OPENAI_TEXT_STREAM.replace(b'"m1"', b'"gpt-4o"'))
    )
    response = openai_backend().complete(make_prompt())
    assert response.model == "gpt-4o" and response.cost_usd is not None and response.cost_usd > 0


@respx.mock
def test_anthropic_body_carries_the_builders_cache_breakpoints() -> None:
    route = respx.post("https://api.anthropic.test/v1/messages").mock(
        return_value=httpx.Response(200, content=ANTHROPIC_STREAM)
    )
    long_doc = Document("big", "The json module encodes and decodes JSON. " * 600, source="json")
    prompt = PromptBuilder().system("Answer.").documents([long_doc]).user("Q?").build()
    AnthropicBackend("claude-sonnet-4-5", base_url="https://api.anthropic.test").complete(prompt)
    body = json.loads(route.calls.last.request.content)
    assert body == prompt.to_anthropic(model="claude-sonnet-4-5", **_anthropic_params())
    assert "cache_control" in json.dumps(body["system"])  # a breakpoint after the documents


def _anthropic_params() -> dict[str, Any]:
    return {"max_tokens": 256, "temperature": 0.0, "stream": True}


@respx.mock
def test_anthropic_529_is_retried() -> None:
    route = respx.post("https://api.anthropic.test/v1/messages").mock(
        side_effect=[httpx.Response(529), httpx.Response(200, content=ANTHROPIC_STREAM)]
    )
    sleeps = Sleeps()
    backend = AnthropicBackend(
        "claude-x",
        base_url="https://api.anthropic.test",
        api_key="ak",
        retry=RetryPolicy(sleep=sleeps),
    )
    assert backend.complete(make_prompt()).text == "Let me look."
    assert route.call_count == 2 and sleeps == [0.5]


@respx.mock
def test_model_none_uses_the_first_model_the_endpoint_lists() -> None:
    models = {"object": "list", "data": [{"id": "tiny", "object": "model"}, {"id": "other"}]}
    listed = respx.get(f"{BASE}/models").mock(return_value=httpx.Response(200, json=models))
    chat = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=OPENAI_TEXT_STREAM)
    )
    backend = create_backend(BASE, api_key="sk-test")
    assert isinstance(backend, OpenAIBackend) and backend.model == "tiny"
    assert listed.calls.last.request.headers["Authorization"] == "Bearer sk-test"
    backend.complete(make_prompt())
    assert json.loads(chat.calls.last.request.content)["model"] == "tiny"


@pytest.mark.parametrize(
    ("response", "error", "match"),
    [
        (httpx.Response(200, json={"data": []}), BackendUnavailableError, "lists no models"),
        (httpx.Response(200, text="<html>"), BackendUnavailableError, "model list"),
        (httpx.Response(404, json={"error": "no"}), BackendHTTPError, "HTTP 404: no; pass a"),
        (
            httpx.Response(401, json={"error": {"message": "invalid or missing API key"}}),
            BackendHTTPError,
            "HTTP 401: invalid or missing API key$",  # not "pass a model name instead"
        ),
    ],
)
@respx.mock
def test_model_discovery_failures_are_typed(
    response: httpx.Response, error: type[Exception], match: str
) -> None:
    respx.get(f"{BASE}/models").mock(return_value=response)
    with pytest.raises(error, match=match):
        OpenAIBackend(None, base_url=BASE)


@respx.mock
def test_model_discovery_on_an_unreachable_endpoint() -> None:
    respx.get(f"{BASE}/models").mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(BackendUnavailableError, match="cannot reach .*/models"):
        create_backend(BASE)


def test_openai_by_name_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="needs a model"):
        create_backend("openai")


@respx.mock
@pytest.mark.parametrize("payload", [b"data: {not json\n\n", b"data: [1, 2]\n\n"])
def test_garbled_stream_events_are_backend_errors(payload: bytes) -> None:
    respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, content=payload))
    with pytest.raises(BackendError, match="endpoint sent a non-"):
        openai_backend().complete(make_prompt())
    respx.post("https://api.anthropic.test/v1/messages").mock(
        return_value=httpx.Response(200, content=b"event: message_start\n" + payload)
    )
    backend = AnthropicBackend("claude-x", base_url="https://api.anthropic.test", api_key="ak")
    with pytest.raises(BackendError, match="Anthropic sent a non-"):
        backend.complete(make_prompt())


def test_stream_timing_is_measured_unless_the_provider_reports_it() -> None:
    from agentcache.backends._remote import with_stream_timing
    from agentcache.usage import Usage

    measured = with_stream_timing(Usage(completion_tokens=11), start_s=1.0, first_s=1.5, end_s=3.5)
    assert (measured.ttft_s, measured.decode_tokens_per_s) == (0.5, 5.0)  # 10 tokens in 2 s
    reported = Usage(completion_tokens=11, ttft_s=0.2, decode_tokens_per_s=40.0)
    assert with_stream_timing(reported, start_s=1.0, first_s=1.5, end_s=3.5) == reported
    silent = with_stream_timing(Usage(), start_s=1.0, first_s=None, end_s=3.5)
    assert (silent.ttft_s, silent.decode_tokens_per_s) == (None, None)
