"""EngineHints on the OpenAI-compatible backend: the tenant's ``cache_salt`` and a session header,
off by default, against recorded vLLM and SGLang stream shapes (respx, no network)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import respx

from agentcache.backends import EngineHints
from agentcache.backends.openai import OpenAIBackend
from agentcache.cache import cache_scope
from agentcache.exceptions import ConfigError

BASE = "http://engine.test/v1"
HINTS = EngineHints(cache_salt=True, session_header="x-session-id")


def sse(*chunks: dict[str, Any]) -> bytes:
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


def chunk(model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    head = {"id": "chatcmpl-7d9e", "object": "chat.completion.chunk", "created": 1764547200}
    return {**head, "model": model, "choices": choices, **extra}


# vLLM 0.9+ with --enable-prompt-tokens-details: the usage chunk comes last, with no choices.
VLLM_MODEL = "Qwen/Qwen2.5-7B-Instruct"
VLLM_STREAM = sse(
    chunk(VLLM_MODEL, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]),
    chunk(VLLM_MODEL, [{"index": 0, "delta": {"content": "Paris"}, "logprobs": None,
                        "finish_reason": None}]),
    chunk(VLLM_MODEL, [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                        "finish_reason": "stop", "stop_reason": None}]),
    chunk(VLLM_MODEL, [], usage={"prompt_tokens": 1043, "total_tokens": 1045,
                                 "completion_tokens": 2,
                                 "prompt_tokens_details": {"cached_tokens": 1024}}),
)  # fmt: skip

# SGLang with --enable-cache-report: every chunk carries "usage": null until the last one.
SGLANG_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_SGLANG_DELTA = {"role": None, "reasoning_content": None, "tool_calls": None}
SGLANG_STREAM = sse(
    chunk(SGLANG_MODEL, [{"index": 0, "delta": {**_SGLANG_DELTA, "role": "assistant",
                          "content": ""}, "logprobs": None, "finish_reason": None,
                          "matched_stop": None}], usage=None),
    chunk(SGLANG_MODEL, [{"index": 0, "delta": {**_SGLANG_DELTA, "content": "Paris"},
                          "logprobs": None, "finish_reason": None, "matched_stop": None}],
          usage=None),
    chunk(SGLANG_MODEL, [{"index": 0, "delta": {**_SGLANG_DELTA, "content": None},
                          "logprobs": None, "finish_reason": "stop", "matched_stop": 128009}],
          usage=None),
    chunk(SGLANG_MODEL, [], usage={"prompt_tokens": 1043, "total_tokens": 1045,
                                   "completion_tokens": 2,
                                   "prompt_tokens_details": {"cached_tokens": 960}}),
)  # fmt: skip


def backend(model: str, hints: EngineHints | None = None, **kw: Any) -> OpenAIBackend:
    return OpenAIBackend(model, base_url=BASE, api_key=None, engine_hints=hints, **kw)


def ask(b: OpenAIBackend, route: respx.Route) -> tuple[dict[str, Any], httpx.Headers, Any]:
    response = b.complete([{"role": "user", "content": "Capital of France?"}])
    request = route.calls.last.request
    return json.loads(request.content), request.headers, response


@pytest.mark.parametrize(
    ("model", "stream", "cached"),
    [(VLLM_MODEL, VLLM_STREAM, 1024), (SGLANG_MODEL, SGLANG_STREAM, 960)],
)
@respx.mock
def test_hints_reach_the_engine_and_cached_tokens_come_back(
    model: str, stream: bytes, cached: int
) -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=stream)
    )
    b = backend(model, HINTS)
    with cache_scope(tenant="acme", user="ann", session="s1"):
        body, headers, response = ask(b, route)
        again, headers_again, _ = ask(backend(model, HINTS), route)  # another worker process
    assert response.text == "Paris" and response.model == model
    usage = response.usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (1043, cached, 2)
    salt, session = body["cache_salt"], headers["x-session-id"]
    assert len(salt) == 32 and int(salt, 16) >= 0 and "acme" not in salt
    assert len(session) == 32 and session != salt
    assert again["cache_salt"] == salt and headers_again["x-session-id"] == session  # stable


@respx.mock
def test_salt_follows_the_tenant_and_the_header_follows_the_session() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=VLLM_STREAM)
    )
    b = backend(VLLM_MODEL, HINTS)
    seen: dict[tuple[str, str, str | None], tuple[str, str | None]] = {}
    for tenant, user, session in [("acme", "ann", "s1"), ("acme", "bob", "s2"),
                                  ("acme", "ann", "s2"), ("globex", "ann", "s1"),
                                  ("acme", "ann", None)]:  # fmt: skip
        with cache_scope(tenant=tenant, user=user, session=session):
            body, headers, _ = ask(b, route)
        seen[(tenant, user, session)] = (body["cache_salt"], headers.get("x-session-id"))
    salts = {key: salt for key, (salt, _) in seen.items()}
    assert len({salts[k] for k in salts if k[0] == "acme"}) == 1  # one namespace per tenant
    assert salts[("globex", "ann", "s1")] != salts[("acme", "ann", "s1")]
    sessions = [header for _, header in seen.values()]
    assert sessions[-1] is None  # no session id set: no header
    assert len(set(sessions[:4])) == 4  # (tenant, user, session) each its own id
    secret = backend(VLLM_MODEL, EngineHints(cache_salt=True, salt_secret="s3cret"))
    with cache_scope(tenant="acme"):
        body, _, _ = ask(secret, route)
    assert body["cache_salt"] != salts[("acme", "ann", "s1")]


@respx.mock
def test_hints_are_off_by_default_and_without_a_tenant() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=VLLM_STREAM)
    )
    with cache_scope(tenant="acme", session="s1"):
        body, headers, _ = ask(backend(VLLM_MODEL), route)  # e.g. OpenAI itself: nothing extra
    assert "cache_salt" not in body and "x-session-id" not in headers
    body, headers, _ = ask(backend(VLLM_MODEL, HINTS), route)  # hints on, no cache_scope
    assert "cache_salt" not in body and "x-session-id" not in headers


@respx.mock
def test_an_explicit_extra_body_salt_wins() -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=VLLM_STREAM)
    )
    b = backend(VLLM_MODEL, HINTS, extra_body={"cache_salt": "mine"})
    with cache_scope(tenant="acme"):
        body, _, _ = ask(b, route)
    assert body["cache_salt"] == "mine"


def test_bad_hints_are_refused() -> None:
    with pytest.raises(ConfigError, match="header name"):
        EngineHints(session_header="x session")
    with pytest.raises(ConfigError, match="salt_secret"):
        EngineHints(salt_secret="s")
    for salt in ("", "acme", 1):  # a salt string is not the switch: the tenant is the salt
        with pytest.raises(ConfigError, match="cache_salt is a switch"):
            EngineHints(cache_salt=salt)  # type: ignore[arg-type]


@respx.mock
def test_engine_without_cache_report_gives_none_not_zero() -> None:
    # vLLM without --enable-prompt-tokens-details sends "prompt_tokens_details": null.
    usage = {"prompt_tokens": 50, "total_tokens": 52, "completion_tokens": 2,
             "prompt_tokens_details": None}  # fmt: skip
    stream = sse(
        chunk(VLLM_MODEL, [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]),
        chunk(VLLM_MODEL, [], usage=usage),
    )
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=stream)
    )
    _, _, response = ask(backend(VLLM_MODEL, HINTS), route)
    assert (response.usage.prompt_tokens, response.usage.cached_tokens) == (50, None)
