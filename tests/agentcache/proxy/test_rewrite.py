"""The proxy's rewrite: canonical tools and tool JSON, message text untouched, markers bounded."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentcache.proxy import RewriteOptions, rewrite
from agentcache.proxy.rewrite import stable_fingerprint

LONG = "Answer from the documents; cite the source of every fact you give. " * 80  # ~1.3k tokens


def count_cache_markers(body: dict[str, Any]) -> int:
    """Markers counted on the wire text, independently of the walker under test."""
    return json.dumps(body).count('"cache_control":')


def openai_tool(name: str, *, reverse_keys: bool = False) -> dict[str, Any]:
    props = {"query": {"type": "string"}, "k": {"type": "integer"}}
    fn: dict[str, Any] = {"name": name, "description": f"{name} things",
                          "parameters": {"type": "object", "properties": props}}  # fmt: skip
    if reverse_keys:
        fn = {k: fn[k] for k in reversed(fn)}
        fn["parameters"] = {k: fn["parameters"][k] for k in reversed(fn["parameters"])}
    return {"function": fn, "type": "function"}


TOOL_RESULT = '{"z": [1, 2], "a": {"y": 1, "b": 2}}'


def test_openai_tools_sorted_and_keys_canonical_but_message_text_untouched() -> None:
    user_text = '{"b": 1, "a": 2}  keep   my spacing'
    body = {
        "model": "gpt-4o",
        "tools": [openai_tool("search", reverse_keys=True), openai_tool("fetch")],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "search", "arguments": '{"query": "x", "k": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": TOOL_RESULT},
        ],
    }  # fmt: skip
    before = copy.deepcopy(body)
    out = rewrite(body, "openai").body
    assert body == before  # the caller's body is not modified
    assert [t["function"]["name"] for t in out["tools"]] == ["fetch", "search"]
    assert list(out["tools"][1]["function"]) == ["description", "name", "parameters"]
    assert out["messages"][1]["content"] == user_text
    assert out["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"k":2,"query":"x"}'
    assert out["messages"][3]["content"] == '{"a":{"b":2,"y":1},"z":[1,2]}'
    assert out["prompt_cache_key"].startswith("ac-")


def test_openai_key_order_and_tool_order_give_the_same_body() -> None:
    a = {"model": "m", "tools": [openai_tool("b"), openai_tool("a", reverse_keys=True)],
         "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    b = {"model": "m", "tools": [openai_tool("a"), openai_tool("b", reverse_keys=True)],
         "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    ra, rb = rewrite(a, "openai").body, rewrite(b, "openai").body
    assert json.dumps(ra) == json.dumps(rb)


def test_prompt_cache_key_from_session_else_stable_prefix_and_never_replaced() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user",
            "content": "q1"}]}  # fmt: skip
    other_turn = {**body, "messages": [body["messages"][0], {"role": "user", "content": "q2"}]}
    assert (
        rewrite(body, "openai").body["prompt_cache_key"]
        == (rewrite(other_turn, "openai").body["prompt_cache_key"])
    )
    assert (
        rewrite(body, "openai", session_id="s1").body["prompt_cache_key"]
        != (rewrite(body, "openai", session_id="s2").body["prompt_cache_key"])
    )
    kept = rewrite({**body, "prompt_cache_key": "mine"}, "openai").body
    assert kept["prompt_cache_key"] == "mine"
    off = RewriteOptions(set_prompt_cache_key=False, sort_tools=False)
    assert "prompt_cache_key" not in rewrite(body, "openai", options=off).body
    assert stable_fingerprint(body) == stable_fingerprint(other_turn)


def test_keep_tool_order_option() -> None:
    body = {"model": "m", "tools": [openai_tool("b"), openai_tool("a")], "messages": []}
    out = rewrite(body, "openai", options=RewriteOptions(sort_tools=False)).body
    assert [t["function"]["name"] for t in out["tools"]] == ["b", "a"]


def anthropic_body(*, system: str = LONG, turns: int = 1) -> dict[str, Any]:
    tools = [{"name": n, "description": "d", "input_schema": {"type": "object",
              "properties": {"q": {"type": "string"}}}} for n in ("search", "fetch")]  # fmt: skip
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} " + "detail " * 40})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]})
    messages.append({"role": "user", "content": [{"type": "text", "text": "last question"}]})
    return {"model": "claude-sonnet-5", "max_tokens": 64, "system": system, "tools": tools,
            "messages": messages}  # fmt: skip


def test_anthropic_planner_places_markers_when_the_client_sent_none() -> None:
    out = rewrite(anthropic_body(), "anthropic").body
    assert [t["name"] for t in out["tools"]] == ["fetch", "search"]
    assert out["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert out["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in out["tools"][-1]  # tools alone are below the 1024 minimum
    assert 1 <= count_cache_markers(out) <= 4


def test_anthropic_no_marker_below_the_minimum() -> None:
    out = rewrite(anthropic_body(system="Be brief."), "anthropic").body
    assert count_cache_markers(out) == 0


def test_anthropic_client_markers_kept_and_excess_nested_ones_dropped() -> None:
    body = anthropic_body(turns=3)
    body["system"] = [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]
    for message in body["messages"][1:]:
        content = message["content"]
        if isinstance(content, list):
            content[-1]["cache_control"] = {"type": "ephemeral"}
    body["messages"][2]["content"] = [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "r1", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "r2", "cache_control": {"type": "ephemeral"}}]}]  # fmt: skip
    assert count_cache_markers(body) == 7
    out = rewrite(body, "anthropic").body
    assert count_cache_markers(out) == 4
    assert out["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}


_block = st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.text(max_size=400)},
    optional={"cache_control": st.just({"type": "ephemeral"})},
)
_tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.just("t1"),
     "content": st.lists(_block, max_size=3)},
    optional={"cache_control": st.just({"type": "ephemeral"})},
)  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    system=st.lists(_block, min_size=1, max_size=3),
    contents=st.lists(
        st.lists(st.one_of(_block, _tool_result), min_size=1, max_size=3), min_size=1, max_size=6
    ),  # fmt: skip
)
def test_anthropic_never_more_than_four_markers(
    system: list[dict[str, Any]], contents: list[list[dict[str, Any]]]
) -> None:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)
    ]
    body = {"model": "claude-opus-5", "max_tokens": 8, "system": system, "messages": messages}
    out = rewrite(body, "anthropic").body
    assert count_cache_markers(out) <= 4
    # NOTE: markers are only ever removed from a client's body, never moved or added.
    if count_cache_markers(body):
        assert count_cache_markers(out) <= count_cache_markers(body)


def test_sse_usage_tap_reads_openai_and_anthropic_streams() -> None:
    from agentcache.proxy.usage_tap import SSEUsageTap

    openai_tap = SSEUsageTap("openai")
    stream = (b'data: {"choices":[{"delta":{"content":"Hi"}}],"usage":null}\n\ndata: {"choices":[],'
              b'"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":'
              b'{"cached_tokens":8}}}\n\ndata: [DONE]\n\n')  # fmt: skip
    for i in range(0, len(stream), 7):  # NOTE: chunk edges fall inside lines
        assert not openai_tap.done  # NOTE: the end marker is the stream's last line
        openai_tap.feed(stream[i : i + 7])
    assert openai_tap.done and openai_tap.usage is not None
    assert (openai_tap.usage.prompt_tokens, openai_tap.usage.cached_tokens) == (12, 8)
    claude_tap = SSEUsageTap("anthropic")
    claude_tap.feed(b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                    b'{"input_tokens":5,"cache_read_input_tokens":1500,'
                    b'"cache_creation_input_tokens":0,"output_tokens":1}}}\n\n'
                    b'event: message_delta\ndata: {"type":"message_delta","usage":'
                    b'{"output_tokens":9,"cache_read_input_tokens":null}}\n\n')  # fmt: skip
    assert claude_tap.usage is not None and not claude_tap.done
    assert claude_tap.usage.cached_tokens == 1500 and claude_tap.usage.completion_tokens == 9
    claude_tap.feed(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert claude_tap.done


def test_a_tool_parameter_named_cache_control_is_data_not_a_marker() -> None:
    body = anthropic_body()
    body["tools"][0]["input_schema"] = {
        "type": "object",
        "properties": {"cache_control": {"type": "string"}},
    }
    out = rewrite(body, "anthropic").body
    assert out["system"][-1]["cache_control"] == {"type": "ephemeral"}  # planned as usual
    assert out["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    (tool,) = (t for t in out["tools"] if t["name"] == body["tools"][0]["name"])
    assert tool["input_schema"]["properties"]["cache_control"] == {"type": "string"}
