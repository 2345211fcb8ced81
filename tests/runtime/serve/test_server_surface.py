"""The server's surface beyond completions: hostile bodies, 500s that keep the connection,
several API keys, protected metrics, tokenize/detokenize, model cards, cache reset, OpenAPI, CORS.

Raw httpx over a real loopback server where connections matter; the scripted engine
(tests/runtime/serve/server_fakes.py) elsewhere, so every count is exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal, Protocol, TypedDict

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import NotFoundError, OpenAI

from runtime.serve.app import create_app
from runtime.serve.body_checks import MAX_JSON_DEPTH
from runtime.serve.server_thread import ServerThread
from tests.runtime.serve.server_fakes import ScriptedEngine

MODEL = ScriptedEngine.model_id


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return body


class Reply(Protocol):
    """What ``error_of`` reads of a response: httpx's, or the TestClient's (``httpx2``)."""

    @property
    def status_code(self) -> int: ...
    @property
    def text(self) -> str: ...
    def json(self, **kwargs: Any) -> Any: ...


class OpsKey(TypedDict, total=False):
    """The key options of ``create_app`` that open ``/metrics``."""

    admin_key: str
    metrics_key: str


def error_of(resp: Reply, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class ConnectionCounter:
    """httpcore trace hook: counts TCP connects, i.e. connections that were not reused."""

    def __init__(self) -> None:
        self.num_connects = 0

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.num_connects += name == "connection.connect_tcp.complete"


# --- hostile bodies and unexpected errors -----------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,  # past the JSON parser's recursion limit
        json.dumps(chat_body(tools=[{"deep": json.loads("[" * 500 + "]" * 500)}])).encode(),
        json.dumps(chat_body(x=json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH))).encode(),
    ],
    ids=["unparseable", "deep-field", "one-level-too-deep"],
)
def test_deeply_nested_json_is_a_400_and_the_connection_stays_open(raw: bytes) -> None:
    engine = ScriptedEngine()
    counter = ConnectionCounter()
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url) as client:
        trace = {"trace": counter}
        resp = client.post("/v1/chat/completions", content=raw, extensions=trace)
        assert error_of(resp, 400)["code"] == "invalid_json"
        assert "nested deeper" in resp.json()["error"]["message"]
        ok = client.post("/v1/chat/completions", json=chat_body(), extensions=trace)
        assert ok.status_code == 200
    assert counter.num_connects == 1 and len(engine.seen) == 1  # only the valid body ran


def test_nesting_at_the_limit_is_parsed() -> None:
    client = TestClient(create_app(ScriptedEngine()))
    deep = json.loads("[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2))
    body = chat_body(metadata={"k": deep})  # body, metadata, then the lists: MAX_JSON_DEPTH
    assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(temprature=0.2)),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temprature": 0.2}),
    ],
)
def test_an_unknown_parameter_is_a_400_naming_it(path: str, body: dict[str, Any]) -> None:
    engine = ScriptedEngine()
    error = error_of(TestClient(create_app(engine)).post(path, json=body), 400)
    assert error["param"] == "temprature" and error["code"] == "unknown_parameter"
    assert "temprature" in error["message"] and not engine.seen


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u1", "metadata": {"app": "x"}, "store": False, "prompt_cache_key": "k"},
        {"safety_identifier": "h"},
        {"best_of": 1, "use_beam_search": False},  # unsupported fields set to their off value
    ],
)
def test_no_op_fields_and_off_values_are_accepted(extra: dict[str, Any]) -> None:
    client = TestClient(create_app(ScriptedEngine()))
    assert client.post("/v1/chat/completions", json=chat_body(**extra)).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(n=None, stream=None)),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": None, "stream": None}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": None}),
    ],
)
def test_null_n_stream_and_echo_mean_unset(path: str, body: dict[str, Any]) -> None:
    # NOTE: these were a 400 ("Input should be a valid integer/boolean"); OpenAI documents them
    # as nullable, and null already meant "unset" for every other optional field.
    client = TestClient(create_app(ScriptedEngine()))
    resp = client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    plain = client.post(path, json={k: v for k, v in body.items() if v is not None}).json()
    out = resp.json()
    assert out["object"] == plain["object"] and out["choices"] == plain["choices"]  # one, whole


def test_a_no_op_field_of_the_wrong_type_is_a_400() -> None:
    client = TestClient(create_app(ScriptedEngine()))
    error = error_of(client.post("/v1/chat/completions", json=chat_body(user=5)), 400)
    assert error["param"] == "user"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(stream_options={"include_usage": True}), "stream_options"),  # without stream
        (chat_body(messages=[{"role": "user"}]), "messages[0]"),  # no content
        (chat_body(stop=""), "stop"),  # refused by SamplingParams, named all the same
    ],
)
def test_what_would_be_ignored_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    engine = ScriptedEngine()
    error = error_of(TestClient(create_app(engine)).post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and not engine.seen


def test_an_assistant_message_may_carry_only_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    client = TestClient(create_app(ScriptedEngine()))
    assert client.post("/v1/chat/completions", json=chat_body(messages=messages)).status_code == 200


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"id": "c1", "type": "function", "function": "f"}, "messages[1].tool_calls[0].function"),
        ({"id": "c1", "type": "function", "function": None}, "messages[1].tool_calls[0].function"),
        ({"id": "c1", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
        ({"function": {"name": 5, "arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
        ({"function": {"name": "f", "arguments": None}}, "messages[1].tool_calls[0].function"),
        ({"type": "custom", "function": {"name": "f", "arguments": "{}"}}, "messages[1]"),
    ],
)
def test_a_malformed_tool_call_sent_back_is_a_400_naming_it(
    call: dict[str, Any], param: str
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    engine = ScriptedEngine()
    client = TestClient(create_app(engine))
    error = error_of(client.post("/v1/chat/completions", json=chat_body(messages=messages)), 400)
    assert error["param"].startswith(param), error
    assert not engine.seen


def test_unexpected_error_is_a_500_that_keeps_the_keep_alive_connection() -> None:
    engine = ScriptedEngine(fail_at=0)
    counter = ConnectionCounter()
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url) as client:
        trace = {"trace": counter}
        for _ in range(2):  # the second 500 is read on the same connection as the first
            failed = client.post("/v1/chat/completions", json=chat_body(), extensions=trace)
            error = error_of(failed, 500)
            assert error["type"] == "server_error" and "engine exploded" in error["message"]
            assert failed.headers.get("connection", "keep-alive").lower() != "close"
        engine.fail_at = None
        ok = client.post("/v1/chat/completions", json=chat_body(), extensions=trace)
        assert ok.status_code == 200
        metrics = client.get("/metrics", extensions=trace).text
    assert counter.num_connects == 1
    assert 'agentcache_request_outcomes_total{outcome="error"} 2.0' in metrics


# --- keys, metrics, admin ---------------------------------------------------------------------


def test_each_of_several_keys_is_a_tenant_and_metrics_need_the_admin_key() -> None:
    engine = ScriptedEngine()
    client = TestClient(create_app(engine, api_key=["key-a", "key-b"]))
    body = chat_body(messages=[{"role": "user", "content": "x" * 40}])

    def cached(key: str) -> int:
        resp = client.post("/v1/chat/completions", json=body, headers=bearer(key))
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert (cached("key-a"), cached("key-b")) == (0, 0)
    assert cached("key-b") > 0
    assert error_of(client.get("/metrics"), 401)["code"] == "invalid_api_key"
    assert error_of(client.get("/metrics", headers=bearer("nope")), 401)
    # NOTE: /metrics shows every tenant's traffic: with tenants and no admin key, nobody reads it
    refused = error_of(client.get("/metrics", headers=bearer("key-b")), 403)
    assert refused["type"] == "permission_error" and "--admin-key" in refused["message"]
    assert "key-b" not in refused["message"]
    assert client.get("/health").status_code == 200  # liveness stays open


@pytest.mark.parametrize("flag", ["admin_key", "metrics_key"])
def test_the_admin_key_alone_opens_metrics(flag: Literal["admin_key", "metrics_key"]) -> None:
    """``metrics_key`` (``--metrics-key``) is the admin key's older name, with its rights."""
    ops: OpsKey = {}
    ops[flag] = "ops"
    client = TestClient(create_app(ScriptedEngine(), api_key="tenant", **ops))
    refused = error_of(client.get("/metrics", headers=bearer("tenant")), 403)
    assert refused["type"] == "permission_error"  # a valid key, not the metrics key: not a 401
    error_of(client.get("/metrics", headers=bearer("wrong")), 401)
    text = client.get("/metrics", headers=bearer("ops")).text
    assert 'outcome="unauthorized"} 2.0' in text
    error_of(client.post("/v1/chat/completions", json=chat_body(), headers=bearer("ops")), 401)
    open_api = TestClient(create_app(ScriptedEngine(), **ops))
    assert open_api.post("/v1/chat/completions", json=chat_body()).status_code == 200
    error_of(open_api.get("/metrics"), 401)


@pytest.mark.parametrize("path", ["/v1/admin/cache/reset", "/reset_prefix_cache"])
def test_cache_reset_needs_a_key_and_drops_the_cached_prefixes(path: str) -> None:
    engine = ScriptedEngine()
    client = TestClient(create_app(engine, api_key="k"))
    body = chat_body(messages=[{"role": "user", "content": "y" * 30}])

    def cached() -> int:
        resp = client.post("/v1/chat/completions", json=body, headers=bearer("k"))
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached() == 0 and cached() > 0
    error_of(client.post(path), 401)
    assert cached() > 0  # the refused reset changed nothing
    reset = client.post(path, headers=bearer("k"))
    assert reset.status_code == 200
    assert reset.json() == {"status": "ok", "scope": "tenant", "num_blocks_freed": 3}
    assert cached() == 0
    assert client.get(path).status_code == 405  # POST only


@pytest.mark.parametrize("path", ["/v1/admin/cache/reset", "/reset_prefix_cache"])
def test_a_tenant_reset_drops_its_own_namespace_and_only_the_admin_key_drops_all(
    path: str,
) -> None:
    engine = ScriptedEngine()
    client = TestClient(create_app(engine, api_key=["key-a", "key-b"], admin_key="ops"))
    body = chat_body(messages=[{"role": "user", "content": "z" * 30}])

    def cached(key: str, salt: str | None = None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        resp = client.post("/v1/chat/completions", json={**body, **extra}, headers=bearer(key))
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    for key, salt in (("key-a", None), ("key-b", None), ("key-a", "s1")):
        assert cached(key, salt) == 0 and cached(key, salt) > 0
    reset = client.post(path, headers=bearer("key-b"))  # B's reset: B's namespace alone
    assert reset.json() == {"status": "ok", "scope": "tenant", "num_blocks_freed": 2}
    assert cached("key-a") > 0 and cached("key-a", "s1") > 0 and cached("key-b") == 0
    salted = client.post(path, json={"cache_salt": "s1"}, headers=bearer("key-a"))
    assert salted.json()["scope"] == "tenant" and cached("key-a", "s1") == 0
    assert cached("key-a") > 0  # A's unsalted namespace was not named
    bad = error_of(client.post(path, json={"cache_salt": ""}, headers=bearer("key-a")), 400)
    assert bad["param"] == "cache_salt"
    error_of(client.post(path, json={"cache_salt": "s1"}, headers=bearer("ops")), 400)
    error_of(client.post(path, headers=bearer("nope")), 401)
    error_of(client.post(path), 401)
    assert cached("key-a") > 0  # the refused resets changed nothing
    reset = client.post(path, headers=bearer("ops"))
    assert reset.status_code == 200 and reset.json()["scope"] == "all"
    assert cached("key-a") == 0 and cached("key-b") == 0
    metrics = client.get("/metrics", headers=bearer("ops")).text
    assert 'outcome="unauthorized"} 2.0' in metrics


def test_without_keys_the_cache_reset_stays_open() -> None:
    # NOTE: as before: a server without keys (loopback by default) has no caller to tell apart.
    client = TestClient(create_app(ScriptedEngine()))
    assert client.post("/v1/admin/cache/reset").json()["status"] == "ok"
    only_admin = TestClient(create_app(ScriptedEngine(), admin_key="ops"))
    error_of(only_admin.post("/reset_prefix_cache"), 401)
    assert only_admin.post("/reset_prefix_cache", headers=bearer("ops")).status_code == 200


def test_prefill_counter_excludes_cached_tokens() -> None:
    client = TestClient(create_app(ScriptedEngine()))
    for _ in range(2):
        client.post("/v1/chat/completions", json=chat_body())
    text = client.get("/metrics").text
    n = len("<user>hi<assistant>")
    assert f"agentcache_prompt_tokens_total {2 * n}.0" in text
    assert f"agentcache_cached_tokens_total {n - 1}.0" in text
    assert f"agentcache_prefill_tokens_computed_total {n + 1}.0" in text
    assert "# HELP agentcache_prefill_tokens_computed_total" in text
    assert "cached tokens excluded" in text and "cached tokens included" in text


# --- tokenize, detokenize, models, OpenAPI, CORS ----------------------------------------------


def test_tokenize_text_and_chat_and_detokenize() -> None:
    client = TestClient(create_app(ScriptedEngine()))
    text = client.post("/tokenize", json={"model": MODEL, "prompt": "ab"}).json()
    assert text == {"count": 2, "max_model_len": 400, "tokens": [97, 98], "token_strs": None}
    chat = client.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
    ).json()
    done = client.post("/v1/chat/completions", json=chat_body()).json()
    assert chat["count"] == done["usage"]["prompt_tokens"]
    assert "".join(chat["token_strs"]) == "<user>hi<assistant>"
    plain = client.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    ).json()
    assert plain["count"] == chat["count"] - len("<assistant>")
    back = client.post("/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()
    assert back == {"prompt": "<user>hi<assistant>"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
            None,
        ),
        ("/tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ],
)
def test_tokenize_refuses_what_it_cannot_honour(
    path: str, body: dict[str, Any], param: str | None
) -> None:
    client = TestClient(create_app(ScriptedEngine()))
    error = error_of(client.post(path, json=body), 400)
    if param is not None:
        assert error["param"] == param


def test_tokenize_needs_a_key_when_keys_are_set() -> None:
    client = TestClient(create_app(ScriptedEngine(), api_key="k"))
    error_of(client.post("/tokenize", json={"prompt": "a"}), 401)
    error_of(client.post("/detokenize", json={"tokens": [97]}), 401)
    assert client.post("/tokenize", json={"prompt": "a"}, headers=bearer("k")).status_code == 200
    other = client.post("/tokenize", json={"prompt": "a", "model": "x"}, headers=bearer("k"))
    assert error_of(other, 404)["code"] == "model_not_found"


def test_model_card_by_id_and_unknown_model_404() -> None:
    openai = OpenAI(
        base_url="http://testserver/v1",
        api_key="k",
        http_client=TestClient(create_app(ScriptedEngine())),
    )
    card = openai.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(NotFoundError) as caught:
        openai.models.retrieve("gpt-4o")
    assert caught.value.body is not None
    assert caught.value.code == "model_not_found"


def test_openapi_schema_lists_every_route_with_request_bodies() -> None:
    client = TestClient(create_app(ScriptedEngine(), api_key="k"))
    schema = client.get("/openapi.json", headers=bearer("k")).json()
    paths = schema["paths"]
    routes = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
    routes += ["/v1/models", "/v1/models/{model_id}", "/v1/admin/cache/reset", "/metrics"]
    assert set(routes) <= set(paths)
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "messages" in body["schema"]["properties"]
    refs = {m.split("/")[-1] for m in _refs(schema)}
    assert refs and refs <= set(schema["components"]["schemas"])


def test_openapi_schema_needs_a_key_when_keys_are_set() -> None:
    # NOTE: issue 35: FastAPI's own /openapi.json answered anyone, keys or not.
    with ServerThread(create_app(ScriptedEngine(), api_key=["key-a", "key-b"])) as url:
        assert error_of(httpx.get(f"{url}/openapi.json"), 401)["code"] == "invalid_api_key"
        error_of(httpx.get(f"{url}/openapi.json", headers=bearer("nope")), 401)
        for key in ("key-a", "key-b"):
            schema = httpx.get(f"{url}/openapi.json", headers=bearer(key)).json()
            assert "/v1/chat/completions" in schema["paths"]
            assert "/openapi.json" not in schema["paths"]
    with ServerThread(create_app(ScriptedEngine())) as url:  # no keys: open, like /v1
        assert "/v1/models" in httpx.get(f"{url}/openapi.json").json()["paths"]


@pytest.fixture(scope="module")
def open_server() -> Iterator[str]:
    """The URL of a real loopback server over the scripted engine, without keys."""
    with ServerThread(create_app(ScriptedEngine())) as url:
        yield url


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("PUT", "/v1/models/some-model", "GET"),
        ("GET", "/reset_prefix_cache", "POST"),
        ("GET", "/v1/admin/cache/reset", "POST"),
        ("POST", "/health", "GET"),
        ("POST", "/metrics", "GET"),
        ("POST", "/openapi.json", "GET"),
        ("GET", "/tokenize", "POST"),
    ],
)
def test_a_405_names_the_allowed_methods(
    open_server: str, method: str, path: str, allowed: str
) -> None:
    # NOTE: issue 35: RFC 9110 section 15.5.6: a 405 must carry Allow; ours had none.
    resp = httpx.request(method, f"{open_server}{path}")
    error_of(resp, 405)
    assert resp.headers.get("allow") == allowed
    answer = httpx.request(allowed, f"{open_server}{path}", json=chat_body())
    assert answer.status_code != 405  # the method it names is served there


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def test_cors_is_off_by_default_and_opt_in_per_origin() -> None:
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    off = TestClient(create_app(ScriptedEngine()))
    assert (
        "access-control-allow-origin"
        not in off.get("/v1/models", headers={"Origin": origin}).headers
    )
    assert off.options("/v1/chat/completions", headers=preflight).status_code == 405
    on = TestClient(create_app(ScriptedEngine(), api_key="k", cors_origins=[origin]))
    allowed = on.options(
        "/v1/chat/completions",
        headers={**preflight, "Access-Control-Request-Headers": "authorization,content-type"},
    )
    assert allowed.status_code == 200  # a preflight carries no key and must not need one
    assert allowed.headers["access-control-allow-origin"] == origin
    resp = on.get("/v1/models", headers={"Origin": origin, **bearer("k")})
    assert resp.headers["access-control-allow-origin"] == origin
    other = on.options(
        "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
