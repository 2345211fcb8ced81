"""``agentcache proxy`` over loopback HTTP with the official clients, in front of real servers.

Upstreams: our own server (``agentcache serve``'s app) on the bundled ``tiny`` model or on the
scripted engine, and a small Anthropic-shaped server that validates markers and reports reads by
its own prefix rule (``anthropic_upstream.py``). Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from openai import OpenAI

from agentcache import wrap
from agentcache.cache import MemoryStore
from agentcache.cli import main as cli_main
from agentcache.proxy import create_proxy_app
from agentcache.proxy.app import SESSION_HEADER
from agentcache.proxy.bench import SYSTEM, shuffled_tools
from agentcache.proxy.cli import _redacted
from agentcache.proxy.response_cache import HIT_HEADER, ResponseCache
from runtime.engine import Engine
from runtime.serve.app import create_app
from runtime.serve.server_thread import ServerThread
from tests.agentcache.proxy.anthropic_upstream import create_upstream
from tests.agentcache.proxy.test_rewrite import LONG, anthropic_body
from tests.runtime.serve.server_fakes import ScriptedEngine


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    engine = Engine.from_pretrained("tiny", kv_cache_bytes=64 << 20)
    try:
        with ServerThread(create_app(engine)) as url:
            yield url
    finally:
        engine.close()


def _hit_rate(client: OpenAI, calls: int) -> float:
    rng = random.Random(7)
    prompt = cached = 0
    for i in range(calls):
        out = client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What does module number {i} do?"},
            ],  # fmt: skip
            tools=shuffled_tools(rng),  # type: ignore[arg-type]
            max_tokens=1,
            temperature=0,
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        prompt += out.usage.prompt_tokens
        cached += out.usage.prompt_tokens_details.cached_tokens or 0
    return cached / prompt


def test_shuffling_app_hits_more_through_the_proxy(tiny_url: str) -> None:
    direct = _hit_rate(OpenAI(base_url=f"{tiny_url}/v1", api_key="direct"), 6)
    with ServerThread(create_proxy_app(f"{tiny_url}/v1")) as proxy_url:
        proxied = _hit_rate(OpenAI(base_url=f"{proxy_url}/v1", api_key="proxied"), 6)
    # NOTE: the first call of each run is a miss (different API keys are different tenants).
    assert proxied > 0.7
    assert proxied > direct + 0.2


def test_proxy_closes_its_upstream_connections_when_the_server_stops(tiny_url: str) -> None:
    app = create_proxy_app(f"{tiny_url}/v1")
    with ServerThread(app) as proxy_url:
        assert httpx.get(f"{proxy_url}/v1/models").status_code == 200  # pools one connection
        assert not app.state.proxy.client.is_closed
    assert app.state.proxy.client.is_closed  # else its socket waits for the garbage collector


def test_stream_passes_through_with_usage(tiny_url: str) -> None:
    with ServerThread(create_proxy_app(f"{tiny_url}/v1")) as proxy_url:
        client = OpenAI(base_url=f"{proxy_url}/v1", api_key="k")
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True},
        ))  # fmt: skip
        report = httpx.get(f"{proxy_url}/agentcache/report").json()
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    assert report["models"]["tiny"]["prompt_tokens"] == chunks[-1].usage.prompt_tokens


def test_stream_usage_is_counted_before_the_end_marker_reaches_the_client() -> None:
    """An OpenAI client stops reading at ``data: [DONE]``; an upstream that keeps the stream open
    after it (here 3 s) must not delay the usage count: the report read at once has it. It was
    recorded only when the upstream closed, so a report read right after the client returned
    could miss it (seen in a loaded CI run)."""
    upstream = FastAPI()

    @upstream.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
            }
            usage = {**chunk, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1,
                                                       "total_tokens": 8}}  # fmt: skip
            for event in (chunk, usage):
                yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            await asyncio.sleep(3.0)

        return StreamingResponse(events(), media_type="text/event-stream")

    with ServerThread(upstream) as url, ServerThread(create_proxy_app(f"{url}/v1")) as proxy_url:
        client = OpenAI(base_url=f"{proxy_url}/v1", api_key="k", max_retries=0)
        started = time.monotonic()
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        report = httpx.get(f"{proxy_url}/agentcache/report").json()
        assert time.monotonic() - started < 2.5, "the client waited for the upstream to close"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 7
    assert report["models"]["m"]["prompt_tokens"] == 7


@pytest.fixture()
def scripted_url() -> Iterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine(max_context_len=20_000)
    with ServerThread(create_app(engine)) as url:
        yield url, engine


def _post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_miss_log_names_segment_and_reason(scripted_url: tuple[str, ScriptedEngine]) -> None:
    url, _ = scripted_url
    rng = random.Random(1)
    tools = shuffled_tools(rng)
    base: dict[str, Any] = {"model": "fake-model", "max_tokens": 2, "tools": tools, "messages": [
        {"role": "system", "content": "You help. Today is 2026-12-01 09:00:00."},
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "second"}]}  # fmt: skip
    steps: list[tuple[str, Any]] = []
    timestamp = copy.deepcopy(base)
    timestamp["messages"][0]["content"] = "You help. Today is 2026-12-01 09:00:41."
    steps.append(("timestamp in system", timestamp))
    added = copy.deepcopy(timestamp)
    added["tools"].append(
        shuffled_tools(rng)[0] | {"function": {"name": "zz_new", "parameters": {}}}
    )
    steps.append(("tool added", added))
    reordered = copy.deepcopy(added)
    reordered["tools"] = reordered["tools"][::-1]
    steps.append(("tools reordered", reordered))
    edited = copy.deepcopy(reordered)
    edited["messages"][2]["content"] = "Hello (edited)"
    steps.append(("history edited", edited))
    with ServerThread(create_proxy_app(f"{url}/v1")) as proxy_url:
        assert _post(proxy_url, base, **{SESSION_HEADER: "s1"}).status_code == 200
        for _, body in steps:
            assert _post(proxy_url, body, **{SESSION_HEADER: "s1"}).status_code == 200
        report = httpx.get(f"{proxy_url}/agentcache/report").json()["sessions"]
        metrics = httpx.get(f"{proxy_url}/agentcache/metrics").text
    breaks = report["recent_breaks"]
    assert [b["reason"] for b in breaks] == [reason for reason, _ in steps]
    assert [b["segment"] for b in breaks] == ["system", "tools", "tools", "history"]
    assert [b["fixed"] for b in breaks] == [False, False, True, False]
    assert all(b["byte_offset"] > 0 for b in breaks[:1] + breaks[3:])
    assert "2026-12-01" not in json.dumps(report)  # records hold no prompt content
    assert (
        'agentcache_proxy_prefix_breaks_total{fixed="true",reason="tools reordered"} 1.0' in metrics
    )


def test_upstream_errors_and_bad_bodies_pass_through(
    scripted_url: tuple[str, ScriptedEngine],
) -> None:
    url, _ = scripted_url
    with ServerThread(create_proxy_app(f"{url}/v1")) as proxy_url:
        body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
        direct, proxied = _post(url, body), _post(proxy_url, body)
        assert proxied.status_code == direct.status_code == 404
        assert proxied.json() == direct.json()
        garbage = httpx.post(f"{proxy_url}/v1/chat/completions", content=b"{not json",
                             headers={"content-type": "application/json"})  # fmt: skip
        assert garbage.status_code == 400  # upstream's answer, not the proxy's
        # NOTE: an unpaired \ud800 escape parses but cannot be re-encoded as UTF-8 (was a 500
        # with a traceback in the proxy): forwarded untouched, the upstream names the field.
        lone = b'{"model": "fake-model", "messages": [{"role": "user", "content": "a\\ud800"}]}'
        answer = httpx.post(f"{proxy_url}/v1/chat/completions", content=lone,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "messages[0].content"
        # NOTE: 950 levels parse, then overflowed the recursive rewrite (was a 500): untouched.
        deep = (
            b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "tools": '
            b'[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
            b'"properties": {"a": %s}}}}]}' % (b"[" * 950 + b"]" * 950)
        )
        answer = httpx.post(f"{proxy_url}/v1/chat/completions", content=deep,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert answer.status_code == 400 and "nested deeper" in answer.json()["error"]["message"]
        models = httpx.get(f"{proxy_url}/v1/models")
        assert models.status_code == 200 and models.json() == httpx.get(f"{url}/v1/models").json()
    with ServerThread(create_proxy_app("http://127.0.0.1:9/v1")) as dead_proxy:
        gone = _post(dead_proxy, body)
        assert gone.status_code == 502
        assert gone.json()["error"] == {
            "message": "agentcache proxy: upstream unreachable or broke off: ConnectError",
            "type": "upstream_error", "param": None, "code": "bad_gateway",
        }  # fmt: skip
        counted = httpx.get(f"{dead_proxy}/agentcache/metrics").text
        assert 'agentcache_proxy_errors_total{status="502"} 1.0' in counted
        head = httpx.head(f"{dead_proxy}/v1/models")  # no route takes HEAD: the proxy's own 405
        assert head.status_code == 405
        error = httpx.request("TRACE", f"{dead_proxy}/v1/models").json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] is None


def test_oversized_bodies_are_413_in_the_proxy_before_going_upstream(
    scripted_url: tuple[str, ScriptedEngine],
) -> None:
    url, engine = scripted_url
    limit = 1000
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 2000}]}
    raw = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with ServerThread(create_proxy_app(f"{url}/v1", max_request_bytes=limit)) as proxy_url:
        declared = httpx.post(f"{proxy_url}/v1/chat/completions", content=raw, headers=headers)
        # Chunked upload (no Content-Length): counted as it arrives.
        chunks = (raw[i : i + 100] for i in range(0, len(raw), 100))
        chunked = httpx.post(f"{proxy_url}/v1/messages", content=chunks, headers=headers)
        other_route = httpx.put(f"{proxy_url}/v1/files", content=raw)
        small = json.dumps({**body, "messages": [{"role": "user", "content": "hi"}]}).encode()
        exact = small + b" " * (limit - len(small))
        at_limit = httpx.post(f"{proxy_url}/v1/chat/completions", content=exact, headers=headers)
        counted = httpx.get(f"{proxy_url}/agentcache/metrics").text
    assert 'agentcache_proxy_errors_total{status="413"} 3.0' in counted
    for answer in (declared, chunked, other_route):
        assert answer.status_code == 413, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        assert f"limit of {limit} bytes" in error["message"]
        assert error["message"].startswith("agentcache proxy: ")
    assert at_limit.status_code == 200, at_limit.text
    assert len(engine.seen) == 1  # only the body at the limit reached the upstream
    with pytest.raises(ValueError, match="max_request_bytes must be >= 1"):
        create_proxy_app(f"{url}/v1", max_request_bytes=0)


def test_response_cache_replays_deterministic_answers_per_tenant(
    scripted_url: tuple[str, ScriptedEngine],
) -> None:
    url, engine = scripted_url
    cache = ResponseCache(MemoryStore(), ttl_s=60)
    body = {"model": "fake-model", "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": "same question"}]}  # fmt: skip
    with ServerThread(create_proxy_app(f"{url}/v1", response_cache=cache)) as proxy_url:
        first = _post(proxy_url, body, authorization="Bearer tenant-a")
        second = _post(proxy_url, body, authorization="Bearer tenant-a")
        other = _post(proxy_url, body, authorization="Bearer tenant-b")
        sampled = _post(proxy_url, {**body, "temperature": 0.7}, authorization="Bearer tenant-a")
        again = _post(proxy_url, {**body, "temperature": 0.7}, authorization="Bearer tenant-a")
        stream_body = {**body, "stream": True}
        s1 = _post(proxy_url, stream_body, authorization="Bearer tenant-a")
        s2 = _post(proxy_url, stream_body, authorization="Bearer tenant-a")
    assert second.json() == first.json() and second.headers[HIT_HEADER] == "hit"
    assert HIT_HEADER not in first.headers and HIT_HEADER not in other.headers
    assert HIT_HEADER not in again.headers and HIT_HEADER not in sampled.headers
    assert s2.headers[HIT_HEADER] == "hit" and s2.text == s1.text and "data: [DONE]" in s2.text
    assert len(engine.seen) == 5  # first, other, two sampled, first stream


@pytest.fixture()
def anthropic_url() -> Iterator[tuple[str, Any]]:
    app = create_upstream()
    with ServerThread(app) as url:
        yield url, app


def test_anthropic_client_through_the_proxy_reads_on_the_second_call(
    anthropic_url: tuple[str, Any],
) -> None:
    url, app = anthropic_url
    with ServerThread(create_proxy_app(url)) as proxy_url:
        client = anthropic.Anthropic(base_url=proxy_url, api_key="k", max_retries=0)
        body = anthropic_body()
        first = client.messages.create(**body)
        body["messages"] += [{"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "and then?"}]  # fmt: skip
        second = client.messages.create(**body)
        report = httpx.get(f"{proxy_url}/agentcache/report").json()
    assert first.usage.cache_creation_input_tokens and not first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens and second.usage.cache_read_input_tokens > 1000
    assert len(app.state.bodies) == 2  # both accepted: never a 400
    assert report["models"]["claude-sonnet-5"]["cached_tokens"] > 1000


def test_anthropic_client_markers_trimmed_never_a_400(anthropic_url: tuple[str, Any]) -> None:
    url, app = anthropic_url
    body = anthropic_body(turns=4)
    for message in body["messages"]:
        if isinstance(message["content"], list):
            message["content"][-1]["cache_control"] = {"type": "ephemeral"}
    body["system"] = [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]
    direct = httpx.post(f"{url}/v1/messages", json=body)
    assert direct.status_code == 400  # 6 markers: the provider refuses the body as sent
    with ServerThread(create_proxy_app(url)) as proxy_url:
        client = anthropic.Anthropic(base_url=proxy_url, api_key="k", max_retries=0)
        client.messages.create(**body)
    assert len(app.state.bodies) == 1


def test_wrapped_clients_rewrite_in_process(tiny_url: str, anthropic_url: tuple[str, Any]) -> None:
    wrapped = wrap(OpenAI(base_url=f"{tiny_url}/v1", api_key="wrapped"))
    rate = _hit_rate(wrapped, 4)  # type: ignore[arg-type]
    report = wrapped.cache_report()
    assert rate > 0.6 and report["models"]["tiny"]["requests"] == 4
    # NOTE: the app broke its own prefix on every call; the rewrite repaired each break.
    assert sum(report["breaks_by_reason"].values()) == 3
    assert set(report["breaks_by_reason"]) <= {"tools reordered", "tool schema key order"}
    assert all(b["fixed"] for b in report["recent_breaks"])
    url, app = anthropic_url
    claude = wrap(anthropic.Anthropic(base_url=url, api_key="k", max_retries=0))
    out = claude.messages.create(**anthropic_body())
    assert isinstance(out, anthropic.types.Message)
    assert app.state.bodies[-1]["system"][-1]["cache_control"] == {"type": "ephemeral"}
    with pytest.raises(TypeError, match="cannot wrap"):
        wrap(object())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--upstream", "ftp://x"], "--upstream must be an http(s) URL"),
        (["--upstream", "http://[::1"], "--upstream is not a valid URL (Invalid IPv6 URL)"),
        (["--upstream", "http://h:99999/v1"], "--upstream is not a valid URL (Port out of range"),
        (["--upstream", "ftp://u:sk-secret@x/v1"], "got 'ftp://***@x/v1'"),
        (["--upstream", "http://127.0.0.1:1/v1", "--response-cache-ttl", "-3"], "ttl"),
        (
            ["--upstream", "http://127.0.0.1:1/v1", "--response-cache-ttl", "5"]
            + ["--response-cache-dir", "{file}/cache"],
            "--response-cache-dir: cache directory '{file}/cache': '{file}' is a file",
        ),
    ],
)
def test_proxy_command_refuses_bad_options(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = [arg.format(file=blocker) for arg in argv]
    says = says.format(file=blocker)
    assert cli_main(["proxy", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert says in err and len(err.splitlines()) == 1 and captured.out == ""
    assert "sk-secret" not in err and "Traceback" not in err


def test_the_upstream_is_announced_without_its_credentials() -> None:
    assert _redacted("http://user:sk-1@127.0.0.1:9/v1") == "http://***@127.0.0.1:9/v1"
    assert _redacted("https://sk-2@api.example.com") == "https://***@api.example.com"
    assert _redacted("https://api.example.com/v1?a=b@c") == "https://api.example.com/v1?a=b@c"
    assert _redacted("not a url") == "not a url"
