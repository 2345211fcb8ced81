"""OpenAI-compatible server on a scripted engine: shapes, streaming, tools, tenants, errors, auth.

The fake engine (tests/runtime/serve/server_fakes.py) makes outputs exact, so these tests check the
wire format byte for byte; tests/runtime/serve/test_server_e2e.py runs the real engine.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from runtime.serve.app import create_app, tenant_salt
from runtime.serve.server_thread import ServerThread
from tests.runtime.serve.server_fakes import ScriptedEngine

MODEL = ScriptedEngine.model_id
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_SCRIPT = [
    "Sure",
    ". <tool",
    '_call>{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "</tool_call>",
]


def make_client(engine: ScriptedEngine | None = None, **kwargs: Any) -> TestClient:
    return TestClient(create_app(engine or ScriptedEngine(), **kwargs))


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return body


def sse_events(text: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


JSON = {"content-type": "application/json"}


def assert_openai_error(resp: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


# --- happy paths ------------------------------------------------------------------------------


def test_chat_completion_body_and_usage() -> None:
    client = make_client()
    resp = client.post("/v1/chat/completions", json=chat_body(temperature=0))
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world!"}
    assert choice["finish_reason"] == "stop"
    prompt_len = len("<user>hi<assistant>")
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 4,
        "total_tokens": prompt_len + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_stream_concatenates_to_the_same_text_and_reports_usage_last() -> None:
    client = make_client()
    body = chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=3)
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == "Hello, world"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in events[:-1])


def test_completions_text_and_token_id_prompts() -> None:
    client = make_client()
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2})
    body = resp.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello,"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": [97, 98], "stream": True})
    events = sse_events(resp.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello, world!"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_sampling_fields_reach_the_engine() -> None:
    engine = ScriptedEngine()
    client = make_client(engine)
    body = chat_body(temperature=0.5, top_p=0.9, top_k=7, seed=3, stop="x", max_completion_tokens=9)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    params = engine.params[-1]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 7, 3)
    assert params.stop == ["x"] and params.max_tokens == 9
    client.post("/v1/chat/completions", json=chat_body())
    assert engine.params[-1].temperature == 1.0  # the OpenAI default


def test_models_health_and_metrics() -> None:
    client = make_client()
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").json()["status"] == "ok"
    client.post("/v1/chat/completions", json=chat_body())
    client.post("/v1/chat/completions", json=chat_body())
    text = client.get("/metrics").text
    n = len("<user>hi<assistant>")  # the fake renders one token per character
    assert f"agentcache_prompt_tokens_total {2 * n}.0" in text
    assert f"agentcache_cached_tokens_total {n - 1}.0" in text  # all but the last token reused
    assert 'agentcache_request_outcomes_total{outcome="stop"} 2.0' in text
    assert "agentcache_time_to_first_token_seconds_count 2.0" in text
    assert "agentcache_num_requests_running 0.0" in text
    assert f"agentcache_prefix_cache_hit_rate {(n - 1) / (2 * n)!r}" in text


def metric(text: str, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} ")]
    return value


def test_outcomes_and_ttft_count_requests_and_tpot_counts_choices() -> None:
    # NOTE: an n=3 request added 3 outcomes and 3 TTFTs, while a cancelled one added 1.
    client = make_client()
    client.post("/v1/chat/completions", json=chat_body(n=3))
    client.post("/v1/chat/completions", json=chat_body(n=3, stream=True))
    client.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "cd"], "n": 3})
    text = client.get("/metrics").text
    assert metric(text, 'agentcache_request_outcomes_total{outcome="stop"}') == 3
    assert metric(text, "agentcache_time_to_first_token_seconds_count") == 3
    assert metric(text, "agentcache_time_per_output_token_seconds_count") == 3 + 3 + 2 * 3


def test_a_hung_up_n3_stream_is_one_cancelled_request() -> None:
    engine = ScriptedEngine(["x"] * 400, max_context_len=1000, step_s=0.01)
    with ServerThread(create_app(engine)) as url:
        body = chat_body(n=3, stream=True, max_tokens=400)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
            next(resp.iter_lines())  # the first chunk, then hang up
        deadline = time.monotonic() + 30
        text = httpx.get(f"{url}/metrics").text
        while "cancelled" not in text and time.monotonic() < deadline:
            time.sleep(0.02)  # NOTE: the server closes the request after the client left
            text = httpx.get(f"{url}/metrics").text
    assert metric(text, 'agentcache_request_outcomes_total{outcome="cancelled"}') == 1
    assert metric(text, "agentcache_time_to_first_token_seconds_count") == 0


def test_each_app_has_its_own_registry() -> None:
    first, second = make_client(), make_client()
    first.post("/v1/chat/completions", json=chat_body())
    assert 'outcome="stop"} 1.0' in first.get("/metrics").text
    assert 'outcome="stop"' not in second.get("/metrics").text


# --- tools ------------------------------------------------------------------------------------


def test_tool_call_is_parsed_into_tool_calls() -> None:
    client = make_client(ScriptedEngine(TOOL_SCRIPT))
    resp = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS))
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_tool_call_stream_holds_back_the_tag_and_sends_the_call_whole() -> None:
    client = make_client(ScriptedEngine(TOOL_SCRIPT))
    resp = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, stream=True))
    events = sse_events(resp.text)
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    assert "<tool" not in content and content.startswith("Sure.")
    [call_delta] = [d for d in deltas if "tool_calls" in d]
    assert call_delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_cut_off_by_max_tokens_finish_with_length() -> None:
    # NOTE: one whole call, then max_tokens cuts a second one: OpenAI says "length", not
    # "tool_calls"; the whole call is still parsed and the cut one stays text.
    script = [*TOOL_SCRIPT, "\n<tool_call>", '{"name": "get_', 'weather"}</tool_call>']
    max_tokens = len(TOOL_SCRIPT) + 2
    for stream in (False, True):
        client = make_client(ScriptedEngine(script))
        body = chat_body(tools=TOOLS, stream=stream, max_tokens=max_tokens)
        resp = client.post("/v1/chat/completions", json=body)
        if stream:
            events = sse_events(resp.text)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            deltas = [e["choices"][0]["delta"] for e in events]
            assert sum(len(d.get("tool_calls", [])) for d in deltas) == 1
        else:
            choice = resp.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert len(choice["message"]["tool_calls"]) == 1


def test_without_tools_or_with_tool_choice_none_the_text_is_left_alone() -> None:
    client = make_client(ScriptedEngine(TOOL_SCRIPT))
    for body in (chat_body(), chat_body(tools=TOOLS, tool_choice="none")):
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert "tool_calls" not in message and "<tool_call>" in message["content"]


def test_openai_client_parses_tool_calls_and_streams() -> None:
    client = OpenAI(
        base_url="http://testserver/v1",
        api_key="k",
        http_client=make_client(ScriptedEngine(TOOL_SCRIPT)),
    )
    messages: Any = [{"role": "user", "content": "x"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    [call] = out.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True
    )
    names = [
        tc.function.name
        for chunk in stream
        for tc in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
        if tc.function
    ]
    assert names == ["get_weather"]


# --- tenants ----------------------------------------------------------------------------------


def test_tenant_salt_combines_key_and_salt() -> None:
    assert tenant_salt(None, None) is None
    salts = {
        tenant_salt("A", None),
        tenant_salt(None, "A"),
        tenant_salt("A", "s"),
        tenant_salt("B", "s"),
        tenant_salt("As", None),
        tenant_salt("A", ""),
    }
    assert len(salts) == 6 and None not in salts
    assert tenant_salt("A", "s") == tenant_salt("A", "s")


def test_same_cache_salt_under_two_keys_never_shares_the_prefix() -> None:
    engine = ScriptedEngine()
    client = make_client(engine, api_key=["key-a", "key-b"])
    body = chat_body(cache_salt="team", messages=[{"role": "user", "content": "x" * 50}])

    def cached(key: str) -> int:
        resp = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("key-a") == 0
    assert cached("key-b") == 0  # same salt, other key: separate namespace
    assert cached("key-a") > 0  # same key and salt: reuse
    assert engine.salts[0] == engine.salts[2] != engine.salts[1]
    assert "team" not in str(engine.salts) and "key-a" not in str(engine.salts)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (chat_body(model="nope"), 404, "model"),
        (chat_body(max_tokens=0), 400, "max_tokens"),
        (chat_body(max_tokens=-5), 400, "max_tokens"),
        (chat_body(max_tokens="ten"), 400, "max_tokens"),
        (chat_body(max_tokens=10_000), 400, "max_tokens"),
        (chat_body(temperature=-1), 400, "temperature"),
        (chat_body(messages=[]), 400, "messages"),
        (chat_body(messages=[{"role": "robot", "content": "x"}]), 400, None),
        (chat_body(messages=[{"role": "user", "content": "y" * 500}]), 400, "messages"),
        (chat_body(messages=[{"role": "user", "content": "RAISE"}]), 400, "messages"),
        (chat_body(n=129), 400, "n"),
        (chat_body(n=0), 400, "n"),
        (chat_body(tools=[{"type": "function"}]), 400, "tools[0].function"),
        (chat_body(tools=[{"type": "fn", "function": {"name": "a"}}]), 400, "tools[0].type"),
        (chat_body(tools=[{"type": "function", "function": {"name": "bad name"}}]), 400, None),
        (
            chat_body(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            ),
            400,
            None,
        ),
        (chat_body(tools="all"), 400, "tools"),
        (chat_body(tools=TOOLS + TOOLS), 400, "tools"),
        (
            chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "zzz"}}),
            400,
            "tool_choice",
        ),
        (chat_body(tool_choice="required"), 400, "tool_choice"),
        # NOTE: these were accepted and ignored (200) before; OpenAI answers 400.
        (chat_body(tool_choice="auto"), 400, "tool_choice"),
        (chat_body(tool_choice="none"), 400, "tool_choice"),
        (chat_body(tools=[], tool_choice="auto"), 400, "tool_choice"),
        (chat_body(parallel_tool_calls=False), 400, "parallel_tool_calls"),
        (chat_body(tools=[], parallel_tool_calls=True), 400, "parallel_tool_calls"),
        (
            chat_body(
                messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "content": "42"},
                ]
            ),
            400,
            "messages[1].tool_call_id",
        ),
        (
            chat_body(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}),
            400,
            "tool_choice.function",
        ),
        (chat_body(tool_choice="x"), 400, "tool_choice"),
        ({"model": MODEL, "prompt": [1, -1]}, 400, "prompt"),
        (chat_body(seed=1 << 64), 400, "seed"),
        (chat_body(seed=1 << 80), 400, "seed"),
        (chat_body(seed=-(1 << 63) - 1), 400, "seed"),
        (chat_body(seed="7"), 400, "seed"),
        (chat_body(max_tokens="10"), 400, "max_tokens"),
        (chat_body(max_tokens=True), 400, "max_tokens"),
        (chat_body(max_tokens=10.0), 400, "max_tokens"),
        (chat_body(stream="yes"), 400, "stream"),
        (chat_body(stream=1), 400, "stream"),
        (chat_body(temperature="0.5"), 400, "temperature"),
        (chat_body(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
        (chat_body(n=True), 400, "n"),
        (chat_body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
        (chat_body(stop=5), 400, "stop"),
        (chat_body(stop=["ok", 5]), 400, "stop[1]"),
        (chat_body(response_format={"type": "xml"}), 400, "response_format.type"),
        (chat_body(response_format={"type": "json_schema"}), 400, "response_format"),
        (chat_body(parallel_tool_calls="no"), 400, "parallel_tool_calls"),
        # NOTE: unknown fields of option objects were dropped in silence (200) before.
        (
            chat_body(stream=True, stream_options={"continuous_usage_stats": True}),
            400,
            "stream_options.continuous_usage_stats",
        ),
        (
            chat_body(stream=True, stream_options={"include_obfuscation": True}),
            400,
            "stream_options.include_obfuscation",
        ),
        (
            chat_body(response_format={"type": "json_object", "schema": {"type": "integer"}}),
            400,
            "response_format.schema",
        ),
        (
            chat_body(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict_mode": True},
                }
            ),
            400,
            "response_format.json_schema.strict_mode",
        ),
        (
            chat_body(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "f"}, "force": True},
            ),
            400,
            "tool_choice.force",
        ),
        (
            chat_body(
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}
            ),
            400,
            "response_format.json_schema.schema",
        ),
        ({"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, 2], []]}, 400, "prompt"),
        ({"model": MODEL, "prompt": ["a"] * 257}, 400, "prompt"),
        ({"model": MODEL, "prompt": []}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    body: dict[str, Any], status: int, param: str | None
) -> None:
    engine = ScriptedEngine()
    client = make_client(engine)
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    assert_openai_error(client.post(path, json=body), status, param)
    assert engine.num_open == 0
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_400(raw: bytes) -> None:
    client = make_client()
    resp = client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert assert_openai_error(resp, 400)["code"] == "invalid_json"


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_non_finite_recompute_fraction_is_named_as_such(value: bytes) -> None:
    client = make_client()
    raw = (b'{"model": "%s", "prompt": "hi there", "chunk_reuse": {"spans": [[0, 1]], '
           b'"mode": "blend", "recompute_fraction": %s}}' % (MODEL.encode(), value))  # fmt: skip
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_openai_error(resp, 400, "chunk_reuse.recompute_fraction")
    assert "finite" in error["message"], error["message"]


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
@pytest.mark.parametrize(
    ("field", "param"),
    [
        (b'"temperature": %s', "temperature"),
        (b'"top_p": %s', "top_p"),
        (b'"min_p": %s', "min_p"),
        (b'"presence_penalty": %s', "presence_penalty"),
        (b'"frequency_penalty": %s', "frequency_penalty"),
        (b'"repetition_penalty": %s', "repetition_penalty"),
        (b'"logit_bias": {"5": %s}', "logit_bias"),
    ],
)
def test_a_non_finite_sampling_number_is_named_as_such(
    value: bytes, field: bytes, param: str
) -> None:
    # NOTE: was "Input should be less than or equal to 2" for a NaN temperature (NaN fails
    # every comparison), which sends the client looking for a value that is too large.
    client = make_client()
    raw = b'{"model": "%s", "prompt": "hi", %s}' % (MODEL.encode(), field % value)
    resp = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_openai_error(resp, 400, param)
    assert "finite" in error["message"], error["message"]


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\uDC00"]}', "prompt[1]"),
        ("/tokenize", b'{"model": "%s", "prompt": "a\\ud800b"}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "tools": '
            b'[{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]}',
            "tools[0].function.description",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(path: str, raw: bytes, param: str) -> None:
    # NOTE: json.loads keeps an unpaired \ud800 escape; the real tokenizer then raised a
    # TypeError (a 500 on /v1/completions and /tokenize, and a 400 blaming "messages" for a tool).
    engine = ScriptedEngine()
    client = make_client(engine)
    resp = client.post(path, content=raw % MODEL.encode(), headers=JSON)
    assert "surrogate" in assert_openai_error(resp, 400, param)["message"]
    assert engine.num_open == 0


def test_stream_options_include_obfuscation_false_is_accepted() -> None:
    client = make_client()
    body = chat_body(
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False}
    )
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and "obfuscation" not in resp.text


def test_a_surrogate_pair_is_text() -> None:
    client = make_client()
    raw = b'{"model": "%s", "prompt": "a\\ud83d\\ude00b"}' % MODEL.encode()
    assert client.post("/v1/completions", content=raw, headers=JSON).status_code == 200


def test_prompt_too_long_from_the_engine_is_400() -> None:
    client = make_client(ScriptedEngine(engine_limit=100))
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * 99})
    assert assert_openai_error(resp, 400, "prompt")["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_plus_max_tokens_past_the_context_is_400_on_both_routes(path: str) -> None:
    engine = ScriptedEngine(max_context_len=100)
    client = make_client(engine)
    if path == "/v1/completions":
        body: dict[str, Any] = {"model": MODEL, "prompt": "z" * 60, "max_tokens": 50}
    else:  # "<user>" + 50 chars + "<assistant>" = 67 tokens on the fake
        body = chat_body(messages=[{"role": "user", "content": "z" * 50}], max_tokens=50)
    error = assert_openai_error(client.post(path, json=body), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert "exceeds the model's context" in error["message"]
    assert engine.params == []  # rejected before the engine
    body["max_tokens"] = 20
    assert client.post(path, json=body).status_code == 200
    assert engine.params[-1].max_tokens == 20


def test_prompt_of_exactly_the_context_is_400_on_completions() -> None:
    client = make_client(ScriptedEngine(max_context_len=100))
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * 100})
    error = assert_openai_error(resp, 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "100 tokens" in error["message"]


def test_error_params_and_messages_name_fields_not_pydantic_internals() -> None:
    client = make_client()
    bad = chat_body(messages=[{"role": "user", "content": 5}])
    error = assert_openai_error(client.post("/v1/chat/completions", json=bad), 400)
    assert error["message"].startswith("messages[0].content: ")
    bad = chat_body(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"})
    error = assert_openai_error(client.post("/v1/chat/completions", json=bad), 400)
    assert "NamedToolChoice" not in error["message"] and "FunctionName" not in error["message"]
    bad = chat_body(response_format={"type": "json_schema"})
    error = assert_openai_error(client.post("/v1/chat/completions", json=bad), 400)
    assert "json_schema is required with type 'json_schema'" in error["message"]
    assert "Value error" not in error["message"]


def test_template_errors_are_said_once() -> None:
    client = make_client()
    bad = chat_body(messages=[{"role": "user", "content": "RAISE"}])
    error = assert_openai_error(client.post("/v1/chat/completions", json=bad), 400, "messages")
    assert error["message"] == "template rejects RAISE"


def test_accepted_edge_values_reach_the_engine() -> None:
    engine = ScriptedEngine()
    client = make_client(engine)
    for seed in (-(1 << 63), -1, (1 << 63) - 1):
        assert client.post("/v1/chat/completions", json=chat_body(seed=seed)).status_code == 200
        assert engine.params[-1].seed == seed
    body = chat_body(response_format={"type": "text"}, temperature=1)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    one = {"model": MODEL, "prompt": ["hi"]}
    assert client.post("/v1/completions", json=one).status_code == 200
    assert engine.seen[-1][1] == [ord("h"), ord("i")]


def test_oversized_bodies_are_413_before_parsing() -> None:
    engine = ScriptedEngine()
    client = make_client(engine, max_request_bytes=1000)
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * 2000}])).encode()
    headers = {"content-type": "application/json"}
    resp = client.post("/v1/chat/completions", content=body, headers=headers)
    error = assert_openai_error(resp, 413)
    assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
    # Chunked upload (no Content-Length): counted as it arrives.
    chunks = (body[i : i + 100] for i in range(0, len(body), 100))
    resp = client.post("/v1/completions", content=chunks, headers=headers)
    assert assert_openai_error(resp, 413)["code"] == "request_too_large"
    assert engine.seen == []
    # A body exactly at the limit is read and served.
    small = json.dumps(chat_body()).encode()
    exact = small + b" " * (1000 - len(small))
    assert client.post("/v1/chat/completions", content=exact, headers=headers).status_code == 200
    assert 'outcome="invalid"} 2.0' in client.get("/metrics").text


def test_unknown_route_and_method_use_the_error_shape() -> None:
    client = make_client()
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/chat/completions"), 405)


def test_api_key_is_required_when_configured() -> None:
    client = make_client(api_key="secret", admin_key="ops")
    assert assert_openai_error(client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    bad = {"Authorization": "Bearer nope"}
    assert_openai_error(client.post("/v1/chat/completions", json=chat_body(), headers=bad), 401)
    good = {"Authorization": "Bearer secret"}
    assert client.post("/v1/chat/completions", json=chat_body(), headers=good).status_code == 200
    assert client.get("/health").status_code == 200
    admin = {"Authorization": "Bearer ops"}
    assert 'outcome="unauthorized"} 2.0' in client.get("/metrics", headers=admin).text


def test_engine_failure_is_a_500_with_the_error_shape_and_the_server_keeps_serving() -> None:
    engine = ScriptedEngine(fail_at=0)
    client = TestClient(create_app(engine), raise_server_exceptions=False)
    error = assert_openai_error(client.post("/v1/chat/completions", json=chat_body()), 500)
    assert error["type"] == "server_error"
    engine.fail_at = None
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert 'outcome="error"} 1.0' in client.get("/metrics").text


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event() -> None:
    engine = ScriptedEngine(fail_at=2)
    client = make_client(engine)
    resp = client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(resp.text)
    assert events[-1]["error"]["type"] == "server_error"
    contents = [e["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert contents == ["", "Hello", ","]
    assert engine.num_open == 0
    assert client.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    assert 'outcome="error"} 1.0' in client.get("/metrics").text
